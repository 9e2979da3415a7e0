"""The hot path "fetch a cubin by recipe", answered below the framework when it can be.

It sits in front of FastAPI and imports nothing of it: the caching headers come
from :mod:`~kcache_server.http_cache`, the memory caches from the
:class:`~kcache_server.resolving.Resolver`, as the route's do.

``GET /v1/recipes/{recipe_key}/artifact`` is what every rank of every job sends. When
the key's metadata and the blob are already in this process's memory caches, and the
caller's token is decided by the token cache, this ASGI middleware answers with two
``send`` calls: no routing, dependency injection, thread hop or response object.
It still audits the fetch and counts it in the request metrics, exactly as the
FastAPI route (``routes/recipes.py``) does; anything else (a cold key, a token the
database must check, an error) goes to that route unchanged, which also fills the
caches for next time. Both answer with the same headers, the artifact's metadata among
them (``X-KCache-Meta``, :mod:`kcache.artifact_header`), encoded here once per artifact:
a client's fetch is one round trip.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from kcache.artifact import ArtifactMeta
from kcache.keys import is_hex_key
from kcache.lru import LruCache
from kcache_server.http_cache import artifact_headers, etag_matches
from kcache_server.request_ids import HEADER, new_request_id
from kcache_server.state import ServerState

__all__ = ["ArtifactFastPath"]

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

# The path is /v1/recipes/<recipe_key>/artifact with a key that passes the one key check;
# anything else (a bad key, a trailing newline) goes to the route, which says what is wrong.
_PREFIX = "/v1/recipes/"
_SUFFIX = "/artifact"
#: The route template the metrics label this path with (the FastAPI route's own).
ROUTE = "/v1/recipes/{recipe_key}/artifact"


class ArtifactFastPath:
    """Pure ASGI middleware in front of the app; see the module docstring."""

    def __init__(
        self,
        app: Callable[[Scope, Receive, Send], Awaitable[None]],
        state: ServerState,
    ) -> None:
        self.app = app
        self.tokens = state.tokens
        self.resolver = state.resolver
        metrics = state.metrics
        self.ok = metrics.requests.labels(route=ROUTE, method="GET", status="200")
        self.not_modified = metrics.requests.labels(route=ROUTE, method="GET", status="304")
        self.seconds = metrics.request_seconds.labels(route=ROUTE)
        # Response headers per digest, encoded once (the metadata header included), with
        # the metadata they were made from: a digest's row can be rewritten (a recovered
        # row completed by a later compile); as many digests as the resolver keeps keys.
        self._headers: LruCache[str, tuple[ArtifactMeta, list[tuple[bytes, bytes]]]] = LruCache(
            max_entries=100_000
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Answer from memory, or hand the request to the app."""
        if scope["type"] == "http" and scope["method"] == "GET":
            path: str = scope["path"]
            if path.startswith(_PREFIX) and path.endswith(_SUFFIX):
                recipe_key = path[len(_PREFIX) : -len(_SUFFIX)]
                if is_hex_key(recipe_key) and await self._serve(recipe_key, scope, send):
                    return
        await self.app(scope, receive, send)

    async def _serve(self, recipe_key: str, scope: Scope, send: Send) -> bool:
        started = time.perf_counter()
        resolver = self.resolver
        meta = resolver.cached_artifact(recipe_key)
        if meta is None:
            return False
        data = resolver.cached_blob(meta.digest)
        if data is None:
            return False
        authorization = if_none_match = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                if authorization is not None:
                    return False  # two of them: the app answers 400, as for every route
                authorization = value.decode("latin-1")
            elif name == b"if-none-match":
                if_none_match = value.decode("latin-1")
        principal = self.tokens.authenticate_cached(authorization)
        if principal is None or not principal.allows("read"):
            return False  # the route produces the precise 401/403
        encoded = self._headers.get(meta.digest)
        if encoded is not None and (encoded[0] is meta or encoded[0] == meta):
            headers = encoded[1]
        else:
            headers = [
                (name.lower().encode(), value.encode())
                for name, value in artifact_headers(meta).items()
            ]
            self._headers.put(meta.digest, (meta, headers))
        request_id = (HEADER, new_request_id().encode())
        if etag_matches(if_none_match, meta.digest):
            await send(
                {"type": "http.response.start", "status": 304, "headers": [*headers, request_id]}
            )
            await send({"type": "http.response.body", "body": b""})
            counter = self.not_modified
        else:
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [
                        *headers,
                        request_id,
                        (b"content-type", b"application/octet-stream"),
                        (b"content-length", str(len(data)).encode()),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": data})
            counter = self.ok
        resolver.record_fetch(recipe_key, meta, started, "hit")
        counter.inc()
        self.seconds.observe(time.perf_counter() - started)
        return True
