"""``POST /v1/bundle``: many artifacts by recipe key in one streamed answer (a node's prefetch).

The answer is :mod:`kcache.bundle_format`: a header line, then per key either an entry
(its metadata, the server's signature of the key -> metadata, its bytes) or a
``missing`` line saying why not (never compiled, failed, evicted), then a trailer that
counts them. Entries are streamed as they are read from the store, in writes of about
256 KiB, so the answer's memory is that and one artifact, whatever the bundle's size; a
client writes each into its node tier as it arrives, once verified.

Each key is one lookup on the server's books (route ``bundle``): ``hit`` for an entry,
``miss`` for a missing one, with the caller's ``context``, so a job's manifest counts
what its nodes prefetched. Nothing is compiled here: a bundle replays a manifest, it
does not build one (``/v1/resolve/batch`` does).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from kcache.artifact import ArtifactMeta
from kcache.bundle_format import (
    BUNDLE_MEDIA_TYPE,
    end_line,
    entry_head,
    header_line,
    missing_line,
)
from kcache.errors import ArtifactNotFoundError, CompileError
from kcache.signing import BundleDigest
from kcache_server.auditing.writer import AuditRecord
from kcache_server.routes._deps import ERRORS, Reader, State, body_doc, read_body
from kcache_server.schemas import BundleRequest, load_model, parse_json
from kcache_server.state import ServerState

__all__ = ["router"]

router = APIRouter(prefix="/v1/bundle", tags=["recipes"])


def _parse(raw: bytes) -> BundleRequest:
    return load_model(BundleRequest, parse_json(raw))


def _audit(
    state: ServerState,
    context: dict[str, Any],
    key: str,
    meta: ArtifactMeta | None,
    started: float,
) -> None:
    outcome = "hit" if meta is not None else "miss"
    state.audit.record(
        AuditRecord(
            outcome=outcome,
            route="bundle",
            latency_ms=(time.perf_counter() - started) * 1000.0,
            recipe_key=key,
            digest=meta.digest if meta else None,
            kernel=meta.kernel if meta else None,
            target=meta.target if meta else None,
            toolchain=meta.toolchain if meta else None,
            compile_seconds_saved=meta.compile_seconds if meta else 0.0,
            **context,
        )
    )
    state.metrics.lookup(outcome, "server")


#: Parts are sent in writes of about this size: one write per part (three per entry) was
#: most of a bundle's time on the server (B12), while a bound keeps the answer's memory small.
_WRITE_BYTES = 256 << 10


async def _stream(state: ServerState, body: BundleRequest) -> AsyncIterator[bytes]:
    resolver = state.resolver
    entries = missing = 0
    context = body.context.model_dump()  # once, not per key
    signed = BundleDigest()
    parts: list[bytes] = [header_line()]
    held = len(parts[0])
    for key in dict.fromkeys(body.recipe_keys):  # each key once, in the order asked
        if held >= _WRITE_BYTES:
            yield b"".join(parts)
            parts, held = [], 0
        started = time.perf_counter()
        try:
            meta = await resolver.artifact(key)
            data = await resolver.blob(meta.digest)
        except ArtifactNotFoundError as exc:
            resolver.forget(key)
            reason = "no artifact is stored for it" if "no artifact" in str(exc) else str(exc)
            missing += 1
            _audit(state, context, key, None, started)
            parts.append(missing_line(key, reason))
            continue
        except CompileError:
            missing += 1
            _audit(state, context, key, None, started)
            parts.append(missing_line(key, "its compile failed"))
            continue
        signature = state.signer.sign(key, meta)
        signed.add(key, meta)
        entries += 1
        _audit(state, context, key, meta, started)
        head = entry_head(key, meta, signature)
        parts += (head, data, b"\n")
        held += len(head) + len(data) + 1
    parts.append(end_line(entries, missing, state.signer.sign_bundle(signed)))
    yield b"".join(parts)


@router.post(
    "",
    response_class=StreamingResponse,
    responses={
        **ERRORS,
        200: {
            "description": (
                "the artifacts in the kcache bundle format (docs/design.md, Bundles): a header "
                "line, per key an entry (JSON line with recipe_key, artifact, signature, size, "
                "then size bytes and a newline) or a missing line, then the trailer "
                '{"end": true, "entries": E, "missing": M}. Without the trailer the answer was cut'
            ),
            "content": {BUNDLE_MEDIA_TYPE: {}},
        },
    },
    openapi_extra=body_doc(BundleRequest),
)
async def post_bundle(request: Request, _: Reader, state: State) -> StreamingResponse:
    """The artifacts of up to 10000 recipe keys in one streamed answer, each signed."""
    body = await read_body(request, state, _parse)
    return StreamingResponse(_stream(state, body), media_type=BUNDLE_MEDIA_TYPE)
