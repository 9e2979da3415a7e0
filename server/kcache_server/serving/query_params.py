"""Unknown query parameters are refused on every route: 422 naming the parameter and the known ones.

A misspelled parameter used to be ignored: ``GET /v1/stats?job=J`` (the parameter is
``job_id``) answered 200 with the whole fleet's numbers, as if filtered. Every route
now takes only the query parameters it declares (its own and its dependencies', as
``/openapi.json`` publishes them); anything else is a 422 ``invalid_request`` whose
``field`` is ``query.<name>`` and whose detail lists what the route takes.

:class:`KnownQueryParameters` is ASGI middleware inside the token gate, so a caller
without a token still gets its 401 first; it looks only at requests that carry a
query string, and finds their route the way the router does (a path no route serves
is left to the router's 404 or 405). The fast paths in front of the app
(:mod:`~kcache_server.serving.artifact_fastpath`,
:mod:`~kcache_server.serving.resolve_fastpath`) leave any request with a query string
to the app, so the rule holds there too.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any
from urllib.parse import parse_qsl

from fastapi.routing import APIRoute
from starlette.responses import JSONResponse
from starlette.routing import Match

from kcache_server.asgi_types import ASGIApp, Receive, Scope, Send
from kcache_server.errors import InvalidRequestError, error_body

__all__ = ["KnownQueryParameters", "declared_query_parameters"]


def declared_query_parameters(route: APIRoute) -> tuple[str, ...]:
    """The query parameters ``route`` declares (its own and its dependencies'), sorted."""
    names: set[str] = set()
    pending = [route.dependant]
    while pending:
        dependant = pending.pop()
        names.update(field.alias for field in dependant.query_params)
        pending.extend(dependant.dependencies)
    return tuple(sorted(names))


def _routes(routes: Iterable[Any]) -> list[APIRoute]:
    """Every :class:`APIRoute` under ``routes``, included routers opened (FastAPI >= 0.160 mounts
    each as one route holding its own)."""
    found: list[APIRoute] = []
    pending = list(routes)
    while pending:
        route = pending.pop(0)
        inner = getattr(route, "original_router", None)
        if inner is not None:
            pending[:0] = list(inner.routes)
        elif isinstance(route, APIRoute):
            found.append(route)
    return found


class KnownQueryParameters:
    """422 for a query parameter the request's route does not declare; see the module docstring."""

    def __init__(self, app: ASGIApp, router: Any) -> None:
        self.app = app
        self._router = router
        self._table: list[tuple[APIRoute, frozenset[str], tuple[str, ...]]] | None = None

    def _known(self) -> list[tuple[APIRoute, frozenset[str], tuple[str, ...]]]:
        # Built on first use: the routes are all included by then.
        if self._table is None:
            table = []
            for route in _routes(self._router.routes):
                names = declared_query_parameters(route)
                table.append((route, frozenset(names), names))
            self._table = table
        return self._table

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Pass the request on, unless its query string names a parameter its route does not take."""
        if scope["type"] == "http" and scope.get("query_string"):
            refusal = self._refusal(scope)
            if refusal is not None:
                await JSONResponse(error_body(refusal), 422)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _refusal(self, scope: Scope) -> InvalidRequestError | None:
        for route, known, names in self._known():
            match, _ = route.matches(scope)
            if match is not Match.FULL:
                continue
            raw = scope["query_string"].decode("latin-1")
            for name, _value in parse_qsl(raw, keep_blank_values=True):
                if name not in known:
                    takes = (
                        f"it takes {', '.join(names)}" if names else "it takes no query parameters"
                    )
                    return InvalidRequestError(
                        f"query.{name[:64]}",
                        f"unknown query parameter {name[:64]!r} for {scope['method']} "
                        f"{route.path}: {takes}",
                    )
            return None
        return None
