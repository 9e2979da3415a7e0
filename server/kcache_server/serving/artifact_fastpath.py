"""The hot path "fetch a cubin by recipe", answered below the framework when it can be.

It sits in front of FastAPI and imports nothing of it: the caching headers come
from :mod:`~kcache_server.http_cache`, the memory caches from the
:class:`~kcache_server.resolving.Resolver`, as the route's do.

``GET /v1/recipes/{recipe_key}/artifact`` is what every rank of every job sends. When
the key's metadata and the blob are already in this process's memory caches, and the
caller's token is decided by the token cache, this ASGI middleware answers with two
``send`` calls: no routing, dependency injection, thread hop or response object
(:meth:`ArtifactFastPath.prepare` decides, :meth:`ArtifactFastPath.finish` records).
It still audits the fetch and counts it in the request metrics, exactly as the
FastAPI route (``routes/recipes.py``) does; anything else (a cold key, a token the
database must check, an error) goes to that route unchanged, which also fills the
caches for next time. Both answer with the same headers, the artifact's metadata among
them (``X-KCache-Meta``, :mod:`kcache.artifact_header`), encoded here once per artifact:
a client's fetch is one round trip.

Behind the deploy's nginx (``accel_redirect`` set, ``deploy/nginx/kcache.conf.template``) both
answer a 200 with those headers, an empty body and ``X-Accel-Redirect`` to the blob's
file (:func:`~kcache_server.accel_redirect.accel_path`, built from the validated digest only); nginx sends the bytes.
The token was checked here first, and the fetch is audited here, as without nginx.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import NamedTuple

from kcache.artifact import ArtifactMeta
from kcache.artifact_header import CONTEXT_HEADER, MAX_CONTEXT_CHARS, WITHDRAWALS_HEADER
from kcache.keys import is_hex_key
from kcache.lru import LruCache
from kcache.signing import HEADER as SIGNATURE_HEADER
from kcache_server.accel_redirect import ACCEL_HEADER, accel_path, accel_wanted, on_disk
from kcache_server.asgi_types import ASGIApp, Receive, Scope, Send
from kcache_server.http_cache import artifact_headers, etag_matches
from kcache_server.request_ids import HEADER, new_request_id
from kcache_server.security_headers import NOSNIFF
from kcache_server.state import ServerState

__all__ = ["ArtifactFastPath", "WarmFetch"]


# The path is /v1/recipes/<recipe_key>/artifact with a key that passes the one key check;
# anything else (a bad key, a trailing newline) goes to the route, which says what is wrong.
_PREFIX = "/v1/recipes/"
_SUFFIX = "/artifact"
#: The route template the metrics label this path with (the FastAPI route's own).
ROUTE = "/v1/recipes/{recipe_key}/artifact"
_OCTETS = (b"content-type", b"application/octet-stream")
SIGNATURE = SIGNATURE_HEADER.lower().encode()
_ACCEL = ACCEL_HEADER.lower().encode()
_CONTEXT = CONTEXT_HEADER.lower().encode()
_THROUGH = WITHDRAWALS_HEADER.lower().encode()


class ArtifactFastPath:
    """Pure ASGI middleware in front of the app; see the module docstring."""

    def __init__(
        self,
        app: ASGIApp,
        state: ServerState,
    ) -> None:
        self.app = app
        self.tokens = state.tokens
        self.resolver = state.resolver
        self.signer = state.signer
        #: nginx's internal location of the blobs, when it sends the bytes (``accel_redirect``).
        self.accel = state.settings.accel_redirect
        store = state.backends.store
        #: Where a blob's local file is, never filled from a bucket (the route fills it).
        self._local_path = store.local_file
        metrics = state.metrics
        # Counted without locks: this runs on the event loop's thread only.
        requests = metrics.requests
        self.ok = metrics.loop_counter(requests.labels(route=ROUTE, method="GET", status="200"))
        self.not_modified = metrics.loop_counter(
            requests.labels(route=ROUTE, method="GET", status="304")
        )
        self.seconds = metrics.loop_histogram(metrics.request_seconds.labels(route=ROUTE))
        # Response headers per digest, encoded once (the metadata header included), with
        # the metadata they were made from: a digest's row can be rewritten (a recovered
        # row completed by a later compile); as many digests as the resolver keeps keys.
        self._headers: LruCache[str, EncodedHeaders] = LruCache(max_entries=100_000)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Answer from memory, or hand the request to the app."""
        # A query string goes to the app, which refuses a parameter the route does not take.
        if scope["type"] == "http" and scope["method"] == "GET" and not scope.get("query_string"):
            started = time.perf_counter()
            answer = self.prepare(scope["path"], scope["headers"])
            if answer is not None:
                status, headers, body = answer.response()
                await send({"type": "http.response.start", "status": status, "headers": headers})
                await send({"type": "http.response.body", "body": body})
                self.finish(answer, started)
                return
        await self.app(scope, receive, send)

    def prepare(self, path: str, headers: Iterable[tuple[bytes, bytes]]) -> WarmFetch | None:
        """The answer to ``GET path`` with these (lower-case) headers if memory has it, else None.

        None for anything but a warm fetch of a valid key by a caller the token cache
        allows to read: the app answers those (a 401, a 404, a cold key, two
        ``Authorization`` headers). Nothing is recorded until :meth:`finish`.
        """
        if not (path.startswith(_PREFIX) and path.endswith(_SUFFIX)):
            return None
        recipe_key = path[len(_PREFIX) : -len(_SUFFIX)]
        if not is_hex_key(recipe_key):
            return None
        resolver = self.resolver
        meta = resolver.cached_artifact(recipe_key)
        if meta is None:
            return None
        data = resolver.cached_blob(meta.digest)
        if data is None:
            return None
        authorization = if_none_match = accel = context = None
        for name, value in headers:
            if name == b"authorization":
                if authorization is not None:
                    return None  # two of them: the app answers 400, as for every route
                authorization = value.decode("latin-1")
            elif name == b"if-none-match":
                if_none_match = value.decode("latin-1")
            elif name == _ACCEL:
                accel = value.decode("latin-1")
            elif name == _CONTEXT:
                context = value.decode("latin-1")
        principal = self.tokens.authenticate_cached(authorization)
        if principal is None or not principal.allows("read"):
            return None  # the route produces the precise 401/403
        encoded = self._headers.get(meta.digest)
        if encoded is None or not (encoded.meta is meta or encoded.meta == meta):
            local = (self._local_path(meta.digest) or "") if self.accel is not None else ""
            encoded = EncodedHeaders.of(meta, len(data), self.accel, local)
            self._headers.put(meta.digest, encoded)
        fresh = etag_matches(if_none_match, meta.digest)
        redirect = not fresh and accel_wanted(self.accel, accel)
        if redirect and not on_disk(encoded.local_path):
            return None  # the route puts the local copy back (from the bucket), then redirects
        signature = (SIGNATURE, self.signer.header_pair(recipe_key, meta))
        if context is not None and len(context) > MAX_CONTEXT_CHARS:
            return None  # the route refuses it (422), as for any header over its bound
        through = resolver.withdrawn_through  # none claimed before the follower's first read
        answer_pairs = (signature,) if through is None else (signature, (_THROUGH, b"%d" % through))
        return WarmFetch(recipe_key, meta, data, encoded, answer_pairs, fresh, redirect, context)

    def finish(self, answer: WarmFetch, started: float) -> None:
        """Audit the fetch and count it, as the route does, once its answer was sent."""
        self.resolver.record_fetch(answer.recipe_key, answer.meta, started, "hit", answer.context)
        (self.not_modified if answer.not_modified else self.ok).inc()
        self.seconds.observe(time.perf_counter() - started)


class EncodedHeaders(NamedTuple):
    """An artifact's response headers as ASGI header pairs; ``meta`` is what they were made from."""

    meta: ArtifactMeta
    #: The metadata headers (``ETag``, ``Cache-Control``, ``X-KCache-Meta``, ...) and ``nosniff``.
    pairs: list[tuple[bytes, bytes]]
    #: A 200's content type and length, after the request id.
    body_pairs: list[tuple[bytes, bytes]]
    #: A redirected 200's ``X-Accel-Redirect``, content type and empty length (no prefix: none).
    accel_pairs: list[tuple[bytes, bytes]]
    #: The blob's local file, which nginx sends (with a prefix only).
    local_path: str

    @classmethod
    def of(
        cls, meta: ArtifactMeta, size: int, accel: str | None = None, local_path: str = ""
    ) -> EncodedHeaders:
        """The headers of ``meta``'s artifact of ``size`` bytes (redirected under ``accel``)."""
        pairs = [
            (name.lower().encode(), value.encode())
            for name, value in artifact_headers(meta).items()
        ]
        pairs.append(NOSNIFF)  # as the app's answers carry it (kcache_server.security_headers)
        body_pairs = [_OCTETS, (b"content-length", str(size).encode())]
        accel_pairs = []
        if accel is not None:
            redirect = accel_path(accel, meta.digest).encode()
            accel_pairs = [(b"x-accel-redirect", redirect), _OCTETS, (b"content-length", b"0")]
        return cls(meta, pairs, body_pairs, accel_pairs, local_path)


class WarmFetch(NamedTuple):
    """What :meth:`ArtifactFastPath.prepare` decided: the artifact, its bytes and headers.

    A named tuple: one is made per warm fetch, and a tuple is made in a fraction of a
    frozen dataclass's time.
    """

    recipe_key: str
    meta: ArtifactMeta
    data: bytes
    headers: EncodedHeaders
    #: Per answer: the server's signature of this key -> artifact (``X-KCache-Signature``)
    #: and how far the withdrawals behind it go (``X-KCache-Withdrawals-Through``).
    answer_pairs: tuple[tuple[bytes, bytes], ...]
    not_modified: bool
    #: Answer with ``X-Accel-Redirect`` and no body: nginx sends the bytes.
    redirect: bool = False
    #: The request's ``X-KCache-Context`` (who asks), for the audit event.
    context: str | None = None

    def response(self) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        """Status, headers (a new request id among them) and body."""
        request_id = (HEADER, new_request_id().encode())
        if self.not_modified:
            return 304, [*self.headers.pairs, *self.answer_pairs, request_id], b""
        if self.redirect:
            return (
                200,
                [*self.headers.pairs, *self.answer_pairs, request_id, *self.headers.accel_pairs],
                b"",
            )
        pairs = [*self.headers.pairs, *self.answer_pairs, request_id, *self.headers.body_pairs]
        return 200, pairs, self.data
