"""``GET /v1/recipes/{recipe_key}`` and the hot path ``GET /v1/recipes/{recipe_key}/artifact``."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import Response

from kcache.errors import ArtifactNotFoundError
from kcache_server.http_cache import blob_headers, etag_matches
from kcache_server.routes._deps import ERRORS, Reader, State
from kcache_server.schemas import ArtifactBody, check_key

router = APIRouter(prefix="/v1/recipes", tags=["recipes"])


@router.get("/{recipe_key}", response_model=ArtifactBody, responses=ERRORS)
async def recipe_metadata(
    recipe_key: str,
    _: Reader,
    state: State,
) -> ArtifactBody:
    """The metadata of the artifact recorded for ``recipe_key``."""
    check_key(recipe_key, "recipe_key")
    meta = await state.resolver.artifact(recipe_key)
    return ArtifactBody.model_validate(meta.to_dict())


@router.get(
    "/{recipe_key}/artifact",
    response_class=Response,
    responses={
        **ERRORS,
        200: {"content": {"application/octet-stream": {}}},
        304: {"description": "unchanged"},
    },
)
async def recipe_artifact(
    recipe_key: str,
    request: Request,
    _: Reader,
    state: State,
) -> Response:
    """The artifact's bytes in one round trip; ``ETag`` is the digest, cacheable forever.

    Warm keys are answered before this route by :mod:`kcache_server.fastpath`; this
    one serves the rest (and fills the memory caches the fast path reads).
    """
    started = time.perf_counter()
    check_key(recipe_key, "recipe_key")
    resolver = state.resolver
    try:
        meta = await resolver.artifact(recipe_key)
        headers = blob_headers(meta.digest, meta.size)
        if etag_matches(request.headers.get("if-none-match"), meta.digest):
            resolver.record_fetch(recipe_key, meta, started, "hit")
            return Response(status_code=304, headers=headers)
        data = await resolver.blob(meta.digest)
    except ArtifactNotFoundError:
        resolver.forget(recipe_key)
        resolver.record_fetch(recipe_key, None, started, "miss")
        raise
    resolver.record_fetch(recipe_key, meta, started, "hit")
    return Response(data, media_type="application/octet-stream", headers=headers)
