"""``/v1/foreign``: artifacts library cache hooks published under the library's own key.

A file's bytes go first to ``PUT /v1/blobs/{digest}`` (publish,
:mod:`~kcache_server.routes.blobs`); ``PUT /v1/foreign/{library}/{key}`` (publish)
publishes a group whose blobs are all stored, in one transaction (the first publish of a
name wins); ``GET`` (read) answers the group with the server's signature of "published by
<writer>" and is audited as a lookup; ``DELETE`` (admin) removes it. The namespace
(version, target, toolchain, as the library reports them) is in the body of a publish and
in the query of the others. docs/design.md section 10 says what kcache promises for
these, and what it does not.
"""

from __future__ import annotations

import time
from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Path, Query, Request
from pydantic import BaseModel, ConfigDict, Field

from kcache.errors import ArtifactNotFoundError
from kcache.foreign import (
    FILE_NAME_PATTERN,
    KEY_PATTERN,
    LABEL_PATTERN,
    LIBRARY_PATTERN,
    MAX_FILES,
    ForeignBinding,
    ForeignConflictError,
    ForeignName,
    ForeignNameError,
    check_files,
    check_name,
)
from kcache_server.auditing.writer import AuditRecord
from kcache_server.errors import BadRequestError, InvalidRequestError
from kcache_server.fairness import caller_identity
from kcache_server.foreign import StoredBinding
from kcache_server.resolving import fetch_context
from kcache_server.routes._deps import (
    ERRORS,
    Admin,
    Publisher,
    Reader,
    State,
    body_doc,
    context_header,
    read_body,
)
from kcache_server.schemas import (
    HEX_KEY_PATTERN,
    INTEGRAL,
    ErrorBody,
    SchemaPattern,
    load_model,
    parse_json,
)

__all__ = ["ForeignFileBody", "audit_lookup", "router"]

router = APIRouter(tags=["foreign"])

_LIBRARY_DOC = "the library whose cache hook published it: cupy, cuda-core, triton, ..."
_KEY_DOC = "the library's own key, verbatim (a hook hex-encodes or hashes keys of other characters)"
LibraryPath = Annotated[
    str, Path(description=_LIBRARY_DOC, json_schema_extra={"pattern": LIBRARY_PATTERN})
]
KeyPath = Annotated[str, Path(description=_KEY_DOC, json_schema_extra={"pattern": KEY_PATTERN})]


def _label_query(what: str) -> Any:
    return Query(
        description=f"the {what} as the library reports it",
        json_schema_extra={"pattern": LABEL_PATTERN},
    )


class ForeignFileBody(BaseModel):
    """One file of a group."""

    model_config = ConfigDict(extra="forbid")

    name: Annotated[str, SchemaPattern(FILE_NAME_PATTERN)] = Field(
        description="the file's name within the group"
    )
    digest: Annotated[str, SchemaPattern(HEX_KEY_PATTERN)]
    size: Annotated[int, Field(strict=True, ge=0, le=(1 << 63) - 1), INTEGRAL]


class PublishRequest(BaseModel):
    """Body of ``PUT /v1/foreign/{library}/{key}``: the namespace and the group."""

    model_config = ConfigDict(extra="forbid")

    version: Annotated[str, SchemaPattern(LABEL_PATTERN)] = Field(
        description="the library's version"
    )
    target: Annotated[str, SchemaPattern(LABEL_PATTERN)] = Field(
        description="the architecture the library compiled for (sm_90, ...)"
    )
    toolchain: Annotated[str, SchemaPattern(LABEL_PATTERN)] = Field(
        description="the compiler as the library reports it (nvrtc-13.0, ...)"
    )
    files: list[ForeignFileBody] = Field(
        min_length=1, max_length=MAX_FILES, description="the group: names unique, blobs stored"
    )


class ForeignEntry(BaseModel):
    """A foreign binding as the server answers it, signed."""

    library: str
    version: str
    target: str
    toolchain: str
    key: str
    binding_key: Annotated[str, SchemaPattern(HEX_KEY_PATTERN)] = Field(
        description="sha256 of the name (kcache.foreign.binding_key): what pins and node tiers use"
    )
    files: list[ForeignFileBody]
    size: int = Field(description="the group's bytes")
    writer: str = Field(description="who published it (token:<name>, client:<address>)")
    published_at: datetime
    signature: dict[str, str] = Field(
        description='{"key_id", "signature"}: the server\'s signature of "published by <writer>" '
        "(kcache.foreign.ForeignBinding.message), never of a compile"
    )


class PublishResponse(BaseModel):
    """Body of ``PUT /v1/foreign/{library}/{key}``."""

    published: bool = Field(
        description="false: the name was bound already (the first publish wins)"
    )
    same: bool = Field(description="whether the binding in place has the files this request named")
    entry: ForeignEntry


class Removed(BaseModel):
    """Body of ``DELETE /v1/foreign/{library}/{key}``."""

    removed: bool


def _named(field: str, value: str, *, path: bool) -> str:
    try:
        return check_name(field, value)
    except ForeignNameError as exc:
        if path:
            raise BadRequestError(str(exc)) from None
        raise InvalidRequestError(f"query.{field}", str(exc)) from None


def _entry(state: Any, found: StoredBinding) -> ForeignEntry:
    binding = found.binding
    return ForeignEntry(
        **binding.name.to_dict(),
        binding_key=binding.binding_key,
        files=[ForeignFileBody(**f.to_dict()) for f in binding.files],
        size=binding.size,
        writer=binding.writer,
        published_at=found.published_at,
        signature=state.foreign.signature(binding).to_dict(),
    )


def audit_lookup(
    state: Any,
    name: ForeignName,
    found: bool,
    latency_ms: float,
    context: dict[str, Any],
    tally: Any = None,
) -> None:
    """Audit a foreign lookup of ``name`` (library, version, target, toolchain, key) with who
    asked (``context``: a resolve's context fields): a ``GET`` here, or a bundle's group.
    ``tally``: identical hits between two flushes are one row and its count, under it."""
    library, version, target, toolchain, key = name

    def record() -> AuditRecord:
        return AuditRecord(
            outcome="hit" if found else "miss",
            route="foreign",
            latency_ms=latency_ms,
            kernel=f"foreign:{library}:{key}"[:1024],
            target=target[:32],
            toolchain=f"{library}-{version}/{toolchain}"[:128],
            error=None if found else "not_found",
            **context,
        )

    if found and tally is not None:
        state.audit.tally(tally, record, latency_ms, 0.0)
    else:
        state.audit.record(record())


def _parse(raw: bytes) -> PublishRequest:
    return load_model(PublishRequest, parse_json(raw))


@router.put(
    "/v1/foreign/{library}/{key}",
    response_model=PublishResponse,
    responses={**ERRORS, 409: {"model": ErrorBody}},
    openapi_extra=body_doc(PublishRequest),
)
async def publish(
    library: LibraryPath, key: KeyPath, request: Request, principal: Publisher, state: State
) -> PublishResponse:
    """Publish a group under the library's key, once its blobs are stored; the first publish wins."""
    library, key = _named("library", library, path=True), _named("key", key, path=True)
    body = await read_body(request, state, _parse)
    try:
        # Sizes are held to the stored blobs' (which foreign_max_bytes bounded) by the publish.
        files = check_files([f.model_dump() for f in body.files])
        for field in ("version", "target", "toolchain"):
            check_name(field, getattr(body, field))
    except ForeignConflictError:
        raise  # 409
    except ForeignNameError as exc:
        raise InvalidRequestError(exc.field, str(exc)) from None
    writer = caller_identity(principal.name, request.client.host if request.client else None)
    name = ForeignName(library, body.version, body.target, body.toolchain, key)
    binding = ForeignBinding(name, files, writer)
    found, published = await state.run(state.foreign.publish, binding)
    return PublishResponse(
        published=published, same=found.binding.files == files, entry=_entry(state, found)
    )


@router.get("/v1/foreign/{library}/{key}", response_model=ForeignEntry, responses=ERRORS)
async def lookup(
    library: LibraryPath,
    key: KeyPath,
    _: Reader,
    state: State,
    version: Annotated[str, _label_query("library's version")],
    target: Annotated[str, _label_query("target")],
    toolchain: Annotated[str, _label_query("toolchain")],
    context: Annotated[
        str | None,
        context_header(
            "the lookup's audit event, so a job's manifest names the foreign groups it used"
        ),
    ] = None,
) -> ForeignEntry:
    """The group under the name, signed "published by <writer>"; 404 when none (audited either way)."""
    started = time.perf_counter()
    library, key = _named("library", library, path=True), _named("key", key, path=True)
    version = _named("version", version, path=False)
    target = _named("target", target, path=False)
    toolchain = _named("toolchain", toolchain, path=False)
    name = ForeignName(library, version, target, toolchain, key)
    found: StoredBinding | None = await state.run(state.foreign.get, name.binding_key)
    latency_ms = (time.perf_counter() - started) * 1000.0
    # Identical hits between two flushes are one row and its count, per caller (as a fetch's).
    tally = ("foreign", *name, context)
    audit_lookup(state, name, found is not None, latency_ms, fetch_context(context), tally)
    if found is None:
        raise ArtifactNotFoundError(
            f"no {library} {version} entry {key} for {target} ({toolchain}): a miss, the library compiles"
        )
    return _entry(state, found)


@router.delete("/v1/foreign/{library}/{key}", response_model=Removed, responses=ERRORS)
async def remove(
    library: LibraryPath,
    key: KeyPath,
    _: Admin,
    state: State,
    version: Annotated[str, _label_query("library's version")],
    target: Annotated[str, _label_query("target")],
    toolchain: Annotated[str, _label_query("toolchain")],
) -> Removed:
    """Remove the binding; the next publish of the name wins again. A withdrawal too: node
    tiers and processes holding the group stop using it (docs/design.md section 10)."""
    library, key = _named("library", library, path=True), _named("key", key, path=True)
    version = _named("version", version, path=False)
    target = _named("target", target, path=False)
    toolchain = _named("toolchain", toolchain, path=False)
    name = ForeignName(library, version, target, toolchain, key)
    reason = f"removed by an admin: DELETE {name.path()}"
    return Removed(removed=await state.run(state.foreign.delete, name.binding_key, reason))
