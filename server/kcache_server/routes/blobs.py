"""``GET``/``HEAD /v1/blobs/{digest}``: content-addressed bytes, immutable."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from kcache.errors import ArtifactNotFoundError
from kcache_server.http_cache import blob_headers, etag_matches
from kcache_server.routes._deps import ERRORS, Reader, State
from kcache_server.schemas import DigestPath, check_key

router = APIRouter(prefix="/v1/blobs", tags=["blobs"])

_BYTES = "application/octet-stream"
_RESPONSES: dict[int | str, dict[str, Any]] = {
    **ERRORS,
    200: {"content": {_BYTES: {}}},
    304: {"description": "unchanged"},
}


@router.head("/{digest}", response_class=Response, responses=_RESPONSES)
async def head_blob(digest: DigestPath, _: Reader, state: State) -> Response:
    """The blob's headers (type, size, ETag) without its bytes: what ``GET`` would send."""
    check_key(digest, "digest")
    try:
        size = state.backends.store.path(digest).stat().st_size
    except FileNotFoundError:
        raise ArtifactNotFoundError(f"no blob {digest}") from None
    return Response(
        media_type=_BYTES, headers={**blob_headers(digest, size), "Content-Length": str(size)}
    )


@router.get("/{digest}", response_class=Response, responses=_RESPONSES)
async def get_blob(digest: DigestPath, request: Request, _: Reader, state: State) -> Response:
    """The blob's bytes, verified against the digest."""
    check_key(digest, "digest")
    store = state.backends.store
    if etag_matches(request.headers.get("if-none-match"), digest) and store.has(digest):
        return Response(
            status_code=304, headers=blob_headers(digest, store.path(digest).stat().st_size)
        )
    data = await state.resolver.blob(digest)
    return Response(data, media_type=_BYTES, headers=blob_headers(digest, len(data)))
