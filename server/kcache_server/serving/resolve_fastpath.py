"""``POST /v1/resolve`` hits, answered below the framework when they can be.

A rank resolving a recipe the server already holds is the second hot path after the
fetch by key (:mod:`~kcache_server.serving.artifact_fastpath`). Through FastAPI a hit paid for routing,
dependency solving, a ``Request``, response validation and serialisation on every
call: several times what the answer itself costs. This ASGI middleware answers such a
hit itself:

- the body is read here, within the same limits (a ``Content-Length`` over
  ``max_request_bytes`` or a body past :data:`~kcache_server.routes._deps.INLINE_BODY_BYTES`
  is not read further), and only as JSON (:func:`~kcache_server.routes._deps.is_json_content_type`);
- it is parsed, validated and keyed by the route's own function
  (:meth:`~kcache_server.recipe_checks.RecipeChecks.parse_resolve`), decided a hit by the resolver's
  own check (:meth:`~kcache_server.resolving.Resolver.memory_hit`: key known and
  servable, include-set files unchanged, blob still in the store) and audited by its own
  :meth:`~kcache_server.resolving.Resolver.record_hit` (the same record, tallied alike);
- the answer is the route's :class:`~kcache_server.schemas.ResolveResponse`, encoded
  once per key (nothing in it belongs to the request), and the request is counted in the
  request metrics under the route's label.

Whenever anything is in doubt (no hit, a body that does not parse or validate, a token
the token cache cannot decide or without the scopes the body needs, an unusual
request) the request goes to the app with the body already read replayed to it, so
the route produces every answer but a hit, errors included. A body that parsed is
not parsed again there: its parse goes with the request
(:data:`~kcache_server.routes.resolve.PARSED_BODY`), and the route takes it for those bytes.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import NamedTuple

from kcache.artifact import ArtifactMeta
from kcache.lru import LruCache
from kcache.recipe import Recipe
from kcache_server.asgi_types import ASGIApp, Message, Receive, Scope, Send
from kcache_server.auth import Principal
from kcache_server.request_ids import HEADER, new_request_id
from kcache_server.routes._deps import INLINE_BODY_BYTES, is_json_content_type
from kcache_server.routes.resolve import PARSED_BODY
from kcache_server.schemas import Context
from kcache_server.security_headers import NOSNIFF
from kcache_server.state import ServerState

__all__ = ["ROUTE", "ResolveFastPath", "ResolveHit"]


#: The path served, and the route template the metrics label it with (the route's own).
ROUTE = "/v1/resolve"
_CONTENT_TYPE = (b"content-type", b"application/json")
#: Bytes of encoded answers kept; past it the least recently used are encoded again.
_MAX_ENCODED_BYTES = 64 << 20


def _replaying(messages: list[Message], receive: Receive) -> Receive:
    """A ``receive`` that first hands out ``messages`` (already read), then reads on."""
    pending = list(reversed(messages))

    async def replayed() -> Message:
        if pending:
            return pending.pop()
        return await receive()

    return replayed


class ResolveFastPath:
    """Pure ASGI middleware in front of the app; see the module docstring."""

    def __init__(
        self,
        app: ASGIApp,
        state: ServerState,
    ) -> None:
        self.app = app
        self.tokens = state.tokens
        self.resolver = state.resolver
        self.recipes = state.recipes
        # Never read more than the route would: the lower of the two limits.
        self.limit = min(INLINE_BODY_BYTES, state.settings.max_request_bytes)
        metrics = state.metrics
        # Counted without locks: this runs on the event loop's thread only.
        self.ok = metrics.loop_counter(
            metrics.requests.labels(route=ROUTE, method="POST", status="200")
        )
        self.seconds = metrics.loop_histogram(metrics.request_seconds.labels(route=ROUTE))
        # Encoded answers per recipe key, with the metadata they were made from (a
        # key's row can be rewritten); as many keys as the resolver keeps, within a
        # byte bound (an answer carries the compile log and the dependency list).
        self._bodies: LruCache[str, tuple[ArtifactMeta, bytes]] = LruCache(
            max_entries=100_000, max_bytes=_MAX_ENCODED_BYTES, size=lambda entry: len(entry[1])
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Answer a resolve hit, or hand the request (its body replayed) to the app."""
        if (
            scope["type"] == "http"
            and scope["method"] == "POST"
            and scope["path"] == ROUTE
            and not scope.get("query_string")  # the app refuses a query parameter
        ):
            replayed = await self._serve(scope, receive, send)
            if replayed is None:
                return
            receive = replayed
        await self.app(scope, receive, send)

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> Receive | None:
        """None when answered; else the ``receive`` the app must read the body from."""
        started = time.perf_counter()
        admitted = self.admit(scope["headers"])
        if admitted is None:
            return receive
        messages: list[Message] = []
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                return _replaying(messages, receive)  # a disconnect: the app sees it as sent
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                return _replaying(messages, receive)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        hit = self.answer(admitted[0], chunks[0] if len(chunks) == 1 else b"".join(chunks), scope)
        if hit is None:
            return _replaying(messages, receive)
        self.record(hit)  # audited before answering, as the route does
        status, headers, body = self.response(hit)
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
        self.count(started)
        return None

    def admit(self, headers: Iterable[tuple[bytes, bytes]]) -> tuple[Principal, int | None] | None:
        """The caller and the body's declared length, if these request headers may be a hit.

        None sends the request to the app: two ``Authorization`` or ``Content-Type``
        headers, a length over the limit or not a number, a body not sent as JSON, a
        token the token cache cannot decide or without the read scope.
        """
        authorization = content_type = length = None
        for name, value in headers:
            if name == b"authorization":
                if authorization is not None:
                    return None  # two of them: the app answers 400
                authorization = value.decode("latin-1")
            elif name == b"content-type":
                if content_type is not None:
                    return None
                content_type = value.decode("latin-1")
            elif name == b"content-length":
                if length is not None or not value.isdigit() or int(value) > self.limit:
                    return None  # the route refuses, or reads it on a worker thread
                length = int(value)
        if not is_json_content_type(content_type):
            return None
        principal = self.tokens.authenticate_cached(authorization)
        if principal is None or not principal.allows("read"):
            return None  # the gate and the route produce the precise 401/403
        return principal, length

    def answer(
        self, principal: Principal, raw: bytes, scope: Scope | None = None
    ) -> ResolveHit | None:
        """The hit this body asks for, encoded, or None for the app to answer it.

        Nothing is recorded: :meth:`record` audits the hit, :meth:`count` counts it. A body
        that parses is left on ``scope`` (:data:`~kcache_server.routes.resolve.PARSED_BODY`)
        for the route, which reads the same bytes when this declines.
        """
        try:
            # The base key is in the encoded answer: a hit needs it once per key, not per request.
            body, recipe = self.recipes.parse_resolve(raw, base_key=False)
            if scope is not None:
                scope[PARSED_BODY] = (raw, body, recipe)
            if body.compile and not principal.allows("compile"):
                return None  # the route answers 403
            looked_up = time.perf_counter()  # where the route's audit starts its clock
            meta = self.resolver.memory_hit(recipe)
            if meta is None:
                return None
            key = recipe.key()
            encoded = self._bodies.get(key)
            if encoded is not None and encoded[0] is meta:
                data = encoded[1]
            else:
                data = (
                    self.resolver.hit_response(recipe, meta).model_dump_json(by_alias=True).encode()
                )
                self._bodies.put(key, (meta, data))
        except Exception:  # the route produces the answer to whatever this was, errors included
            return None
        return ResolveHit(recipe, body.context, meta, looked_up, data)

    def record(self, hit: ResolveHit) -> None:
        """Audit ``hit`` as the route audits a hit (tallied per caller)."""
        self.resolver.record_hit(hit.recipe, hit.context, "resolve", hit.looked_up, hit.meta)

    def count(self, started: float) -> None:
        """Count an answered hit in the request metrics, under the route's label."""
        self.ok.inc()
        self.seconds.observe(time.perf_counter() - started)

    def response(self, hit: ResolveHit) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        """Status, headers (a new request id among them) and body of the answer to ``hit``."""
        length = (b"content-length", str(len(hit.data)).encode())
        return 200, [length, _CONTENT_TYPE, NOSNIFF, (HEADER, new_request_id().encode())], hit.data


class ResolveHit(NamedTuple):
    """What :meth:`ResolveFastPath.answer` found: the recipe, who asked, the artifact, the answer."""

    recipe: Recipe
    context: Context
    meta: ArtifactMeta
    #: When the lookup started (perf_counter), where the route's audit starts its clock.
    looked_up: float
    data: bytes
