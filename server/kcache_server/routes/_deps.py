"""Dependencies shared by the routes: the server state, the caller's token, and body reading.

Request bodies are read by :func:`read_body` rather than declared as FastAPI body
parameters, because FastAPI would parse and validate them on the event loop: a
32 MiB body of a million specialization keys took the loop for half a minute.
Small bodies are still handled inline (a thread hop costs more than they do);
larger ones are parsed, validated and keyed on a worker thread.

A worker thread is not enough on its own: parsing JSON is one C call that holds the
GIL throughout, and a 17 MiB body of a million keys held it (and so the loop) for
0.2 s on a quiet machine. So the values of every body are counted as it arrives
(:class:`~kcache_server.json_budget.JsonValueCounter`, a few byte operations per
chunk), and one holding more than ``max_request_values`` is refused (413) unparsed;
what is parsed costs at most that many values.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated, Any, TypeVar

from fastapi import Depends, Header, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from kcache.artifact_header import CONTEXT_HEADER, MAX_CONTEXT_CHARS, WITHDRAWALS_HEADER
from kcache_server.auth import PRINCIPAL_KEY, Principal, authorization_header
from kcache_server.errors import InvalidRequestError, PayloadTooLargeError
from kcache_server.fairness import caller_identity, current_caller
from kcache_server.json_budget import JsonValueCounter
from kcache_server.schemas import ErrorBody
from kcache_server.state import ServerState

__all__ = [
    "BODY_LIMITS_DOC",
    "ERRORS",
    "INLINE_BODY_BYTES",
    "WITHDRAWALS_DOC",
    "Admin",
    "Compiler",
    "Publisher",
    "Reader",
    "Reporter",
    "State",
    "body_doc",
    "caller",
    "context_header",
    "get_state",
    "is_json_content_type",
    "read_body",
    "require_admin",
    "require_compile",
    "require_publish",
    "require_read",
    "require_report",
]

#: Bodies up to this size are parsed, validated and keyed on the event loop (well
#: under a millisecond); larger ones on a worker thread.
INLINE_BODY_BYTES = 64 << 10

#: What every JSON request body is bounded by, as the published document says it
#: (``{setting:...}`` is filled in with this server's values by :mod:`kcache_server.serving.openapi`).
BODY_LIMITS_DOC = (
    "JSON, at most {setting:max_request_bytes} bytes (max_request_bytes) holding at most "
    "{setting:max_request_values} values (max_request_values: every member's value and array "
    "element, counted as the body arrives, before it is parsed); past either, 413 too_large"
)

T = TypeVar("T")

_bearer = HTTPBearer(auto_error=False, description="a token from `kcache token create`")


def state_of(request: Request) -> ServerState:
    """The per-process :class:`ServerState`."""
    state: ServerState = request.app.state.kcache
    return state


async def get_state(request: Request) -> ServerState:
    """:func:`state_of` as a dependency (async: FastAPI runs sync dependencies on threads)."""
    return state_of(request)


async def caller(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> Principal:
    """The principal behind the request's bearer token (raises 401 when one is needed).

    The :class:`~kcache_server.auth.AuthGate` has decided it already, before the body
    was read; the check below only serves an app mounted without the gate.
    """
    decided = request.scope.get(PRINCIPAL_KEY)
    if isinstance(decided, Principal):
        return _on_behalf_of(decided, request)
    state = state_of(request)
    header = authorization_header(request.scope)
    principal = state.tokens.authenticate_cached(header)
    if principal is None:  # the database must answer: off the event loop
        principal = await run_in_threadpool(state.tokens.authenticate, header)
    return _on_behalf_of(principal, request)


def _on_behalf_of(principal: Principal, request: Request) -> Principal:
    """Name the caller for fair compiling (the token, or the client address on an open server)."""
    current_caller.set(
        caller_identity(principal.name, request.client.host if request.client else None)
    )
    return principal


def _requiring(scope: str, what: str) -> Callable[..., Awaitable[Principal]]:
    """The dependency giving the caller once it holds ``scope`` or one above (403 naming ``what``)."""

    async def require(principal: Annotated[Principal, Depends(caller)]) -> Principal:
        principal.require(scope, what)
        return principal

    require.__name__ = require.__qualname__ = f"require_{scope}"
    return require


#: Any valid token (``read`` is the weakest scope).
require_read = _requiring("read", "this request")
#: A token that may post client audit events (``report``, or a scope above it).
require_report = _requiring("report", "posting client audit events")
#: A token that may compile, route-wide (a resolve asks for it only with ``compile`` true).
require_compile = _requiring("compile", "reading a recorded recipe (its source)")
#: A token that may publish foreign artifacts (``publish``, or ``admin``).
require_publish = _requiring("publish", "publishing foreign artifacts")
#: A token with the ``admin`` scope (pins, the store, verification).
require_admin = _requiring("admin", "managing pins, the store and verification")

#: The calling principal, checked for at least the ``read`` scope.
Reader = Annotated[Principal, Depends(require_read)]
#: The calling principal, checked for at least the ``report`` scope.
Reporter = Annotated[Principal, Depends(require_report)]
#: The calling principal, checked for at least the ``compile`` scope.
Compiler = Annotated[Principal, Depends(require_compile)]
#: The calling principal, checked for the ``publish`` scope (or ``admin``).
Publisher = Annotated[Principal, Depends(require_publish)]
#: The calling principal, checked for the ``admin`` scope.
Admin = Annotated[Principal, Depends(require_admin)]
#: The server state.
State = Annotated[ServerState, Depends(get_state)]


#: The OpenAPI entry of the header every answer giving bindings carries (fetch, bundle).
WITHDRAWALS_DOC: dict[str, Any] = {
    WITHDRAWALS_HEADER: {
        "description": (
            "the newest withdrawal id the answering server process had acted on when the "
            "answer began: the answer is right as of it. A client whose node has read "
            "GET /v1/withdrawals that far needs no read of it now (an empty page); absent "
            "while the server has not read its withdrawals yet"
        ),
        "schema": {"type": "integer"},
    },
}


def context_header(recorded: str) -> Any:
    """The ``X-KCache-Context`` header of a lookup route (who asks, as a resolve's context
    says), bounded; ``recorded``: what the route records it with, for the contract's text."""
    return Header(
        alias=CONTEXT_HEADER,
        max_length=MAX_CONTEXT_CHARS,
        description=(
            "who asks, form-encoded as a resolve's context fields (client_id, host, pid, "
            f"job_id, rank, world_size): recorded with {recorded}; a field that does not fit "
            "is left out, never refused"
        ),
    )


def _doc(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {status: {"model": ErrorBody} for status in statuses}


#: OpenAPI error responses shared by the authenticated routes (statuses of errors.ERROR_TABLE).
ERRORS = _doc(400, 401, 403, 404, 413, 422, 503, 507)


def is_json_content_type(content_type: str | None) -> bool:
    """Whether a request body sent with ``content_type`` is taken as JSON (the rest are refused)."""
    if not content_type:
        return True  # curl -d without -H: taken as JSON, as FastAPI does
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (
        media.startswith("application/") and media.endswith("+json")
    )


async def read_body(request: Request, state: ServerState, parse: Callable[[bytes], T]) -> T:
    """The request body, read within ``max_request_bytes`` and turned into ``parse(raw)``.

    ``parse`` does everything that grows with the body (JSON, validation, keying);
    it runs inline for bodies up to :data:`INLINE_BODY_BYTES`, else on a worker thread.
    A body that is not sent as JSON is refused: a browser form cannot post one
    cross-site without a preflight. A body of more than ``max_request_values`` JSON
    values is refused (413) without being parsed; it is read to its end first (within
    ``max_request_bytes``), so the client reads the answer rather than a reset.
    """
    if not is_json_content_type(request.headers.get("content-type")):
        raise InvalidRequestError("body", "send the body as JSON (Content-Type: application/json)")
    limit = state.settings.max_request_values
    counter = JsonValueCounter()
    chunks: list[bytes] = []
    over = False
    async for chunk in request.stream():
        if over or not chunk:
            continue  # past the limit: the rest is only drained
        if counter.feed(chunk) > limit:
            over = True
            chunks.clear()
        else:
            chunks.append(chunk)
    if over:
        raise PayloadTooLargeError(
            f"the request body holds more than {limit} JSON values (max_request_values); it was "
            "not parsed: send fewer values (a smaller batch, fewer keys)"
        )
    raw = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    if len(raw) <= INLINE_BODY_BYTES:
        return parse(raw)
    result: T = await state.run(parse, raw)
    return result


def body_doc(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` documenting ``model`` as the JSON request body of a route that reads it itself."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    defs = schema.pop("$defs", {})

    # Nested models are inlined: this schema is not registered in the components.
    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/components/schemas/"):
                return inline(defs[ref.rsplit("/", 1)[1]])
            return {k: inline(v) for k, v in node.items()}
        if isinstance(node, list):
            return [inline(v) for v in node]
        return node

    return {
        "requestBody": {
            "required": True,
            "description": BODY_LIMITS_DOC,
            "content": {"application/json": {"schema": inline(schema)}},
        }
    }
