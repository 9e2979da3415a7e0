"""``GET /v1/recipes/{recipe_key}`` and the hot path ``GET /v1/recipes/{recipe_key}/artifact``."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from kcache.errors import ArtifactNotFoundError
from kcache_server.routes._deps import ERRORS, Reader, State
from kcache_server.routes.blobs import blob_headers, not_modified
from kcache_server.schemas import ArtifactBody
from kcache_server.service import check_key

router = APIRouter(prefix="/v1/recipes", tags=["recipes"])


@router.get("/{recipe_key}", response_model=ArtifactBody, responses=ERRORS)
async def recipe_metadata(
    recipe_key: str,
    _: Reader,
    state: State,
) -> JSONResponse:
    """The metadata of the artifact recorded for ``recipe_key``."""
    check_key(recipe_key, "recipe_key")
    meta = await state.run(state.artifact_for_key, recipe_key)
    return JSONResponse(meta.to_dict())


@router.get(
    "/{recipe_key}/artifact",
    response_class=Response,
    responses={**ERRORS, 200: {"content": {"application/octet-stream": {}}}, 304: {"description": "unchanged"}},
)
async def recipe_artifact(
    recipe_key: str,
    request: Request,
    _: Reader,
    state: State,
) -> Response:
    """The artifact's bytes in one round trip; ``ETag`` is the digest, cacheable forever."""
    started = time.perf_counter()
    check_key(recipe_key, "recipe_key")
    try:
        meta = state.warm_artifact(recipe_key) or await state.run(state.artifact_for_key, recipe_key)
        headers = blob_headers(meta.digest, meta.size)
        if not_modified(request, meta.digest):
            state.record_fetch(recipe_key, meta, started, "hit")
            return Response(status_code=304, headers=headers)
        data = state.blobs.get(meta.digest) or await state.run(state.blob, meta.digest)
    except ArtifactNotFoundError:
        state.metas.discard(recipe_key)
        state.record_fetch(recipe_key, None, started, "miss")
        raise
    state.record_fetch(recipe_key, meta, started, "hit")
    return Response(data, media_type="application/octet-stream", headers=headers)
