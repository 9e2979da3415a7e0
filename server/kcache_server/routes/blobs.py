"""``GET``/``HEAD /v1/blobs/{digest}``: content-addressed bytes, immutable; ``PUT``: a foreign file's bytes.

``PUT`` (publish scope) stores the bytes a foreign group will name (docs/design.md
section 10): checked against the digest, at most ``foreign_max_bytes``; the group is
published after, by ``PUT /v1/foreign/{library}/{key}`` (:mod:`~kcache_server.routes.foreign`).

Behind the deploy's nginx (``accel_redirect`` set) a ``GET`` whose bytes this process
has verified is answered with the headers and ``X-Accel-Redirect`` instead of the bytes
(:func:`bytes_answer`, used by the fetch by key too): the token is checked here, nginx
sends the file. ``HEAD`` carries no bytes and is answered here in any case.
"""

from __future__ import annotations

import os
from typing import Annotated, Any

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, Field

from kcache.errors import ArtifactNotFoundError
from kcache.store.base import ArtifactStore
from kcache_server.accel_redirect import ACCEL_HEADER, accel_path, accel_wanted, on_disk
from kcache_server.errors import PayloadTooLargeError
from kcache_server.http_cache import blob_headers, etag_matches
from kcache_server.routes._deps import ERRORS, Publisher, Reader, State
from kcache_server.schemas import HEX_KEY_PATTERN, DigestPath, SchemaPattern, check_key
from kcache_server.state import ServerState

router = APIRouter(prefix="/v1/blobs", tags=["blobs"])

__all__ = ["BlobStored", "bytes_answer", "router"]

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
    return await bytes_answer(request, state, digest, data, blob_headers(digest, len(data)))


def _local_copy(store: ArtifactStore, digest: str) -> bool:
    """Whether the blob's local file is there for nginx, put back from the bucket if it was not."""
    return on_disk(os.fspath(store.path(digest)))  # a bucket's store fills its local copy


async def bytes_answer(
    request: Request, state: ServerState, digest: str, data: bytes, headers: dict[str, str]
) -> Response:
    """A 200 of ``data``, or, behind nginx, of no body and ``X-Accel-Redirect`` to its file.

    The redirect is asked for by ``accel_redirect``; nginx's fallback (its copy of the
    file gone) says ``X-KCache-Accel: off`` and gets the bytes, which this process has
    read and verified either way. A local copy evicted meanwhile is put back from the
    bucket first; where there is none, the bytes go from here.
    """
    prefix = state.settings.accel_redirect
    if (
        prefix is not None
        and accel_wanted(prefix, request.headers.get(ACCEL_HEADER))
        and await anyio.to_thread.run_sync(
            _local_copy, state.backends.store, digest, limiter=state.limiter
        )
    ):
        redirect = {**headers, "X-Accel-Redirect": accel_path(prefix, digest)}
        return Response(b"", media_type=_BYTES, headers=redirect)
    return Response(data, media_type=_BYTES, headers=headers)


class BlobStored(BaseModel):
    """Body of ``PUT /v1/blobs/{digest}``."""

    digest: Annotated[str, SchemaPattern(HEX_KEY_PATTERN)]
    size: int
    stored: bool = Field(description="false: the store held these bytes already")


_BYTES_BODY = {
    "requestBody": {
        "required": True,
        "description": "a foreign file's bytes, at most {setting:foreign_max_bytes} bytes "
        "(foreign_max_bytes); they must hash to the digest",
        "content": {_BYTES: {"schema": {"type": "string", "format": "binary"}}},
    }
}


@router.put("/{digest}", response_model=BlobStored, responses=ERRORS, openapi_extra=_BYTES_BODY)
async def put_blob(digest: DigestPath, request: Request, _: Publisher, state: State) -> BlobStored:
    """Store a foreign file's bytes (idempotent); the group that names them is published after."""
    check_key(digest, "digest")
    limit = state.settings.foreign_max_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLargeError(
            f"the file is {int(declared)} bytes; the limit is {limit} (foreign_max_bytes)"
        )
    chunks: list[bytes] = []
    seen = 0
    async for chunk in request.stream():
        seen += len(chunk)
        if seen > limit:
            raise PayloadTooLargeError(
                f"the file is over the limit of {limit} bytes (foreign_max_bytes)"
            )
        chunks.append(chunk)
    data = b"".join(chunks)
    stored: bool = await state.run(state.foreign.store_blob, digest, data)
    return BlobStored(digest=digest, size=len(data), stored=stored)
