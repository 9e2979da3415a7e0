"""``GET /v1/recipes/{recipe_key}`` and the hot path ``GET /v1/recipes/{recipe_key}/artifact``."""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import APIRouter, Header, Request
from fastapi.responses import Response

from kcache.artifact_header import HEADER as META_HEADER
from kcache.artifact_header import (
    MAX_CHARS,
    ON_MISS_HEADER,
    ON_MISS_RESOLVE,
    encode_withdrawals_through,
)
from kcache.errors import ArtifactNotFoundError, CompileError
from kcache.signing import HEADER as SIGNATURE_HEADER
from kcache_server.errors import ArtifactSetAsideError
from kcache_server.http_cache import artifact_headers, etag_matches
from kcache_server.routes._deps import ERRORS, WITHDRAWALS_DOC, Reader, State, context_header
from kcache_server.routes.blobs import bytes_answer
from kcache_server.schemas import ArtifactBody, RecipeKeyPath, check_key

router = APIRouter(prefix="/v1/recipes", tags=["recipes"])


@router.get("/{recipe_key}", response_model=ArtifactBody, responses=ERRORS)
async def recipe_metadata(
    recipe_key: RecipeKeyPath,
    response: Response,
    _: Reader,
    state: State,
) -> ArtifactBody:
    """The metadata of the artifact recorded for ``recipe_key``; its signature in ``X-KCache-Signature``."""
    check_key(recipe_key, "recipe_key")
    meta = await state.resolver.artifact(recipe_key)
    response.headers[SIGNATURE_HEADER] = state.signer.sign(recipe_key, meta).header_value()
    return ArtifactBody.model_validate(meta.to_dict())


_FETCH_HEADERS = {
    "ETag": {
        "description": "the digest (sha256 of the bytes), quoted",
        "schema": {"type": "string"},
    },
    "X-Kcache-Digest": {"description": "the digest, unquoted", "schema": {"type": "string"}},
    "X-Kcache-Size": {"description": "the size in bytes", "schema": {"type": "integer"}},
    META_HEADER: {
        "description": (
            "the artifact's metadata: base64url (RFC 4648 section 5, no padding) of the compact "
            "JSON object GET /v1/recipes/{recipe_key} returns (digest, size, kind, target, "
            "toolchain, lowered_names, kernel, dependencies, dependencies_exact, "
            "compile_seconds, created_at, dependency_check, log). Check the body's sha256 and size "
            f"against it. Absent when it would exceed {MAX_CHARS} characters (read the metadata "
            "route then)."
        ),
        "schema": {"type": "string"},
    },
    SIGNATURE_HEADER: {
        "description": (
            "the server's Ed25519 signature of this recipe key -> the metadata, "
            "<key_id>.<signature> (base64url); GET /v1/keys publishes the keys. Check it before "
            "the bytes are used or stored"
        ),
        "schema": {"type": "string"},
    },
    **WITHDRAWALS_DOC,
}


@router.get(
    "/{recipe_key}/artifact",
    response_class=Response,
    responses={
        **ERRORS,
        200: {
            "description": "the bytes; the metadata in X-KCache-Meta",
            "content": {"application/octet-stream": {}},
            "headers": _FETCH_HEADERS,
        },
        304: {
            "description": "unchanged (If-None-Match named the digest)",
            "headers": _FETCH_HEADERS,
        },
    },
)
async def recipe_artifact(
    recipe_key: RecipeKeyPath,
    request: Request,
    _: Reader,
    state: State,
    on_miss: Annotated[
        str | None,
        Header(
            alias=ON_MISS_HEADER,
            max_length=64,
            description=(
                f"'{ON_MISS_RESOLVE}': a POST /v1/resolve of the same recipe follows a 404, "
                "and that resolve is the lookup audited (so a 404 here is not counted as a "
                "miss); anything else, or absent: a 404 is audited as a miss"
            ),
        ),
    ] = None,
    context: Annotated[str | None, context_header("the fetch's audit event")] = None,
) -> Response:
    """The artifact's bytes and its metadata in one round trip; ``ETag`` is the digest.

    The body is the bytes, kept by caches only if they ask again before each use (a
    withdrawal ends a key's answer); ``X-KCache-Meta`` carries the metadata a client needs
    to trust and use them (see the 200 response's headers). Warm keys are
    answered before this route by :mod:`kcache_server.serving.artifact_fastpath`; this one serves the
    rest (and fills the memory caches the fast path reads). A blob that fails its
    check on the read is a 404 ``not_found`` saying so, as for an evicted artifact
    (:class:`~kcache_server.errors.ArtifactSetAsideError`); the fast path serves only
    bytes verified into memory. A recipe whose compile failed answers its recorded error,
    audited as an ``error``. A 404 is audited as a miss unless the caller says a
    resolve follows (``X-KCache-On-Miss: resolve``, as ``KernelCache`` does): the
    resolve is then the one lookup, with the outcome the caller sees.
    """
    started = time.perf_counter()
    check_key(recipe_key, "recipe_key")
    resolver = state.resolver
    try:
        meta = await resolver.artifact(recipe_key)
        headers = artifact_headers(meta)
        headers[SIGNATURE_HEADER] = state.signer.sign(recipe_key, meta).header_value()
        headers.update(encode_withdrawals_through(resolver.withdrawn_through))
        if etag_matches(request.headers.get("if-none-match"), meta.digest):
            resolver.record_fetch(recipe_key, meta, started, "hit", context)
            return Response(status_code=304, headers=headers)
        data = await resolver.blob(meta.digest)
    except ArtifactNotFoundError as exc:  # evicted, collected, or set aside as damaged
        resolver.forget(recipe_key)
        if on_miss != ON_MISS_RESOLVE:  # else the resolve that follows is the lookup
            resolver.record_fetch(recipe_key, None, started, "miss", context)
        if isinstance(exc, ArtifactSetAsideError) and exc.recipe_key is None:
            raise ArtifactSetAsideError(exc.digest, recipe_key) from None
        raise
    except CompileError:
        # A recorded failure answers here (422): the caller's lookup ends in that error,
        # and no resolve follows to count it.
        resolver.record_fetch(recipe_key, None, started, "error", context)
        raise
    resolver.record_fetch(recipe_key, meta, started, "hit", context)
    return await bytes_answer(
        request, state, meta.digest, data, headers
    )  # behind nginx: a redirect
