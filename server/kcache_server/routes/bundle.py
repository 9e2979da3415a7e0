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

``foreign`` names a job's foreign groups (docs/design.md section 10): when it names any,
the answer opens with their section (:mod:`kcache.foreign_section`: each group whole, with
the server's "published by <writer>" signature, or a missing line), then the kernels'
bundle as above (``recipe_keys`` may then be empty). Each name is audited as a foreign
lookup with the caller's context, so the job's manifest names the groups its nodes
prefetched too.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import AfterValidator, ConfigDict, Field, model_validator

from kcache.artifact import ArtifactMeta
from kcache.artifact_header import encode_withdrawals_through
from kcache.bundle_format import (
    BUNDLE_MEDIA_TYPE,
    end_line,
    entry_head,
    header_line,
    missing_line,
)
from kcache.errors import ArtifactNotFoundError, CompileError
from kcache.foreign import KEY_PATTERN, LABEL_PATTERN, LIBRARY_PATTERN, ForeignName, check_name
from kcache.foreign_section import end_line as foreign_end_line
from kcache.foreign_section import group_head
from kcache.foreign_section import header_line as foreign_header_line
from kcache.foreign_section import missing_line as foreign_missing_line
from kcache.signing import BundleDigest
from kcache_server.auditing.writer import AuditRecord
from kcache_server.foreign import StoredBinding
from kcache_server.routes._deps import ERRORS, WITHDRAWALS_DOC, Reader, State, body_doc, read_body
from kcache_server.routes.foreign import audit_lookup
from kcache_server.schemas import (
    MAX_BUNDLE_KEYS,
    BundleRequest,
    HexKey,
    SchemaPattern,
    _Strict,
    load_model,
    parse_json,
)
from kcache_server.state import ServerState

__all__ = ["router"]

router = APIRouter(prefix="/v1/bundle", tags=["recipes"])


def _name_part(field: str, pattern: str) -> Any:
    """A part of a foreign name: checked as kcache.foreign checks it (422 naming the field)."""
    return Annotated[
        str, AfterValidator(lambda value: check_name(field, value)), SchemaPattern(pattern)
    ]


class ForeignNameBody(_Strict):
    """A foreign binding's name, as a hook names it (docs/design.md section 10)."""

    library: _name_part("library", LIBRARY_PATTERN)  # type: ignore[valid-type]
    version: _name_part("version", LABEL_PATTERN)  # type: ignore[valid-type]
    target: _name_part("target", LABEL_PATTERN)  # type: ignore[valid-type]
    toolchain: _name_part("toolchain", LABEL_PATTERN)  # type: ignore[valid-type]
    key: _name_part("key", KEY_PATTERN)  # type: ignore[valid-type]


class BundleWithForeignRequest(BundleRequest):
    """Body of ``POST /v1/bundle``: recipe keys, and a job's foreign groups by name."""

    # Recipe keys, foreign names, or both: one of them is required (a 422 says so).
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "anyOf": [
                {"required": ["recipe_keys"], "properties": {"recipe_keys": {"minItems": 1}}},
                {"required": ["foreign"], "properties": {"foreign": {"minItems": 1}}},
            ]
        },
    )

    recipe_keys: list[HexKey] = Field(
        default_factory=list,
        max_length=MAX_BUNDLE_KEYS,
        description="recipe keys (a manifest's); may be empty when foreign names some",
    )
    foreign: list[ForeignNameBody] = Field(
        default_factory=list,
        max_length=MAX_BUNDLE_KEYS,
        description="foreign groups by name (a version 2 manifest's); their section comes first",
    )

    @model_validator(mode="after")
    def _something_asked(self) -> BundleWithForeignRequest:
        if not self.recipe_keys and not self.foreign:
            raise ValueError("name recipe_keys, foreign names, or both")
        return self


def _parse(raw: bytes) -> BundleWithForeignRequest:
    return load_model(BundleWithForeignRequest, parse_json(raw))


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


async def _foreign_section(
    state: ServerState, body: BundleWithForeignRequest, context: dict[str, Any]
) -> AsyncIterator[bytes]:
    """The foreign groups' section (kcache.foreign_section), in writes of about _WRITE_BYTES."""
    groups = missing = 0
    parts: list[bytes] = [foreign_header_line()]
    held = len(parts[0])
    # Each part was checked with the body (ForeignNameBody): the name as it was given.
    names = {n.binding_key: n for n in (ForeignName(**f.model_dump()) for f in body.foreign)}
    for key, name in names.items():  # each name once, in the order asked
        if held >= _WRITE_BYTES:
            yield b"".join(parts)
            parts, held = [], 0
        started = time.perf_counter()
        found: StoredBinding | None = await state.run(state.foreign.get, key)
        files: list[bytes] = []
        if found is not None:
            try:
                for ref in found.binding.files:
                    files.append(await state.resolver.blob(ref.digest))
            except ArtifactNotFoundError:
                files = []
                found = None  # a file gone: the whole group is missing
        latency_ms = (time.perf_counter() - started) * 1000.0
        audit_lookup(state, name, found is not None, latency_ms, context)
        if found is None:
            missing += 1
            parts.append(foreign_missing_line(key, "no group is stored under the name"))
            continue
        head = group_head(found.binding, state.foreign.signature(found.binding))
        parts += (head, *files, b"\n")
        held += len(head) + sum(len(f) for f in files) + 1
        groups += 1
    parts.append(foreign_end_line(groups, missing))
    yield b"".join(parts)


async def _stream(state: ServerState, body: BundleWithForeignRequest) -> AsyncIterator[bytes]:
    resolver = state.resolver
    entries = missing = 0
    context = body.context.model_dump()  # once, not per key
    if body.foreign:
        async for piece in _foreign_section(state, body, context):
            yield piece
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
            "headers": WITHDRAWALS_DOC,
        },
    },
    openapi_extra=body_doc(BundleWithForeignRequest),
)
async def post_bundle(request: Request, _: Reader, state: State) -> StreamingResponse:
    """The artifacts of up to 10000 recipe keys in one streamed answer, each signed, after
    the groups of up to 10000 foreign names (their own section, each group whole)."""
    body = await read_body(request, state, _parse)
    headers = encode_withdrawals_through(state.resolver.withdrawn_through)
    return StreamingResponse(_stream(state, body), media_type=BUNDLE_MEDIA_TYPE, headers=headers)
