"""``GET /metrics``: Prometheus text format (requests, lookups, compiles, queue, store)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from kcache_server.metrics import CONTENT_TYPE_LATEST
from kcache_server.routes._deps import ERRORS, Reader, State

router = APIRouter(tags=["metrics"])


@router.get(
    "/metrics",
    response_class=Response,
    responses={**ERRORS, 200: {"content": {CONTENT_TYPE_LATEST: {}}}},
)
async def metrics(_: Reader, state: State) -> Response:
    """The process's metrics; gauges (compile pool, store size) are sampled now."""
    body = await state.run(state.metrics.render)
    return Response(body, media_type=CONTENT_TYPE_LATEST)
