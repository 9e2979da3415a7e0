"""Dependencies shared by the routes: the server state and the caller's token."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.concurrency import run_in_threadpool

from kcache_server.auth import Principal
from kcache_server.schemas import ErrorBody
from kcache_server.service import ServerState

__all__ = ["ERRORS", "Reader", "State", "caller", "get_state", "require_read"]

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
    """The principal behind the request's bearer token (raises 401 when one is needed)."""
    state = state_of(request)
    header = request.headers.get("authorization")
    principal = state.tokens.authenticate_cached(header)
    if principal is None:  # the database must answer: off the event loop
        principal = await run_in_threadpool(state.tokens.authenticate, header)
    return principal


async def require_read(principal: Annotated[Principal, Depends(caller)]) -> Principal:
    """Any valid token (``read`` is the weakest scope)."""
    principal.require("read", "this request")
    return principal


#: The calling principal, checked for at least the ``read`` scope.
Reader = Annotated[Principal, Depends(require_read)]
#: The server state.
State = Annotated[ServerState, Depends(get_state)]


def _doc(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {status: {"model": ErrorBody} for status in statuses}


#: OpenAPI error responses shared by the authenticated routes (statuses of errors.ERROR_TABLE).
ERRORS = _doc(400, 401, 403, 404, 413, 422, 503, 507)
