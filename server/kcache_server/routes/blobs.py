"""``GET``/``HEAD /v1/blobs/{digest}``: content-addressed bytes, immutable."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from kcache.errors import ArtifactNotFoundError
from kcache_server.routes._deps import ERRORS, Reader, State
from kcache_server.service import check_key

router = APIRouter(prefix="/v1/blobs", tags=["blobs"])

IMMUTABLE = "public, max-age=31536000, immutable"


def blob_headers(digest: str, size: int) -> dict[str, str]:
    """Caching headers for a blob: a name that is its hash never changes."""
    return {"ETag": f'"{digest}"', "Cache-Control": IMMUTABLE, "X-Kcache-Digest": digest, "X-Kcache-Size": str(size)}


def etag_matches(if_none_match: str | None, digest: str) -> bool:
    """True when an ``If-None-Match`` header value names this digest (or ``*``)."""
    if not if_none_match:
        return False
    tags = {t.strip().removeprefix("W/").strip('"') for t in if_none_match.split(",")}
    return digest in tags or "*" in tags


def not_modified(request: Request, digest: str) -> bool:
    """True when the request's ``If-None-Match`` names this digest (or ``*``)."""
    return etag_matches(request.headers.get("if-none-match"), digest)


_RESPONSES: dict[int | str, dict[str, Any]] = {
    **ERRORS,
    200: {"content": {"application/octet-stream": {}}},
    304: {"description": "unchanged"},
}


@router.head("/{digest}", response_class=Response, responses=_RESPONSES)
async def head_blob(digest: str, _: Reader, state: State) -> Response:
    """The blob's headers (size, ETag) without its bytes."""
    check_key(digest, "digest")
    try:
        size = state.backends.store.path(digest).stat().st_size
    except FileNotFoundError:
        raise ArtifactNotFoundError(f"no blob {digest}") from None
    return Response(headers={**blob_headers(digest, size), "Content-Length": str(size)})


@router.get("/{digest}", response_class=Response, responses=_RESPONSES)
async def get_blob(digest: str, request: Request, _: Reader, state: State) -> Response:
    """The blob's bytes, verified against the digest."""
    check_key(digest, "digest")
    if not_modified(request, digest) and state.backends.store.has(digest):
        return Response(status_code=304, headers=blob_headers(digest, state.backends.store.path(digest).stat().st_size))
    data = state.blobs.get(digest) or await state.run(state.blob, digest)
    return Response(data, media_type="application/octet-stream", headers=blob_headers(digest, len(data)))
