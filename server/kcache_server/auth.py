"""Bearer tokens with scopes ``read`` < ``report`` < ``compile`` < ``admin``, and the gate that checks them.

Tokens are random, shown once at creation, and stored as their sha256; a presented
token is hashed and compared with ``hmac.compare_digest``. With no active token in
the database the server is open (the loopback development default; a non-loopback
bind without tokens is refused at start-up unless forced). Once a server process has
seen an active token it needs one for the rest of its life: revoking the last token
(a leaked one, say) leaves it refusing every request until a token is created again,
never open.

Each scope includes the ones before it. ``report`` (post client audit events)
sits above ``read``: a reporting worker also fetches, but a token that may only
read cannot add figures to the dashboard. ``compile`` includes ``report``, so a
job's compile token keeps reporting its node-tier hits as before.

:class:`AuthGate` checks the token at the ASGI level, before anything reads the
request body: an unauthenticated request is answered 401 having read none of its
body, whatever it claims to send.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property

import anyio
import sqlalchemy as sa

from kcache.lru import LruCache
from kcache_server.asgi_types import ASGIApp, Receive, Scope, Send
from kcache_server.errors import (
    BadRequestError,
    InvalidRequestError,
    PermissionDeniedError,
    ServerError,
    UnauthenticatedError,
    error_body,
    error_info,
)
from kcache_server.models import tokens_table as _tokens
from kcache_server.models import utcnow
from kcache_server.scopes import ALL_SCOPES, PUBLISH, SCOPES

__all__ = [
    "PRINCIPAL_KEY",
    "SCOPES",
    "AuthGate",
    "Principal",
    "TokenInfo",
    "TokenStore",
    "authorization_header",
    "hash_token",
]

_RANK = {scope: i for i, scope in enumerate(SCOPES)}
# ``publish`` sits outside the chain: it reads and reports as ``report`` does, and only it
# (or ``admin``) publishes foreign artifacts (Principal.allows).
_RANK_OF = {**_RANK, PUBLISH: _RANK["report"]}
# Token names are printed by `kcache token list`: printable, no control characters.
# A token made elsewhere (`kcache token create --token-file`): printable ASCII, no spaces.
_TOKEN_VALUE = re.compile(r"[!-~]{24,512}")
_TOKEN_NAME = re.compile(r"[^\x00-\x1f\x7f-\x9f\ud800-\udfff]{1,256}")


def hash_token(token: str) -> str:
    """sha256 hex of a token (what the database stores)."""
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True)
class Principal:
    """Who is calling: a token's name and scopes (name None when the server is open)."""

    name: str | None
    scopes: frozenset[str]

    @cached_property
    def _rank(self) -> int:
        """The highest rank among the scopes (-1 with none known): asked on every request."""
        return max((_RANK_OF[s] for s in self.scopes if s in _RANK_OF), default=-1)

    def allows(self, scope: str) -> bool:
        """True when one of the scopes includes ``scope``."""
        if scope == PUBLISH:
            return PUBLISH in self.scopes or "admin" in self.scopes
        return self._rank >= _RANK[scope]

    def require(self, scope: str, what: str) -> None:
        """Raise :class:`PermissionDeniedError` unless ``scope`` is allowed."""
        if not self.allows(scope):
            raise PermissionDeniedError(
                f"token {self.name!r} has scopes {', '.join(sorted(self.scopes))}; {what} needs {scope!r}"
            )


OPEN = Principal(None, frozenset({"admin"}))


@dataclass(frozen=True)
class TokenInfo:
    """A token as ``kcache token list`` shows it (never the token itself)."""

    name: str
    scopes: tuple[str, ...]
    created_at: datetime
    last_used_at: datetime | None
    revoked_at: datetime | None


class TokenStore:
    """Create, list, revoke and check tokens; checks are cached for ``cache_s`` seconds."""

    def __init__(self, engine: sa.Engine, cache_s: float = 2.0) -> None:
        self.engine = engine
        self.cache_s = cache_s
        self._lock = threading.Lock()
        self._any: tuple[float, bool] | None = None
        # Set once an active token was seen: from then on this process is never open.
        self._guarded = False
        # Token hash -> (checked at, principal); bounded, so a flood of random tokens cannot grow it.
        self._cache: LruCache[str, tuple[float, Principal | None]] = LruCache(max_entries=10_000)

    # ------------------------------------------------------------------ management
    def create(
        self, name: str, scopes: Iterable[str], *, token: str | None = None, exist_ok: bool = False
    ) -> str:
        """Store a new token and return it (the only time it is visible).

        ``token`` stores a value made elsewhere (a deployment's secret) instead of a
        fresh random one. ``exist_ok`` makes that idempotent: a token of this name with
        the same value and scopes is left as it is (an init step run on every start).
        """
        if token is not None and not _TOKEN_VALUE.fullmatch(token):
            raise InvalidRequestError(
                "token", "a given token is 24 to 512 printable ASCII characters without spaces"
            )
        scope_set = (
            sorted(set(scopes), key=ALL_SCOPES.index) if set(scopes) <= set(ALL_SCOPES) else None
        )
        if not scope_set:
            raise InvalidRequestError("scope", f"choose from {', '.join(ALL_SCOPES)}")
        if not isinstance(name, str) or not _TOKEN_NAME.fullmatch(name):
            raise InvalidRequestError(
                "name", "a token name is 1 to 256 printable characters (no control characters)"
            )
        token = token if token is not None else "kc_" + secrets.token_urlsafe(32)
        with self.engine.begin() as conn:
            exists = conn.execute(
                sa.select(_tokens.c.token_hash, _tokens.c.scopes, _tokens.c.revoked_at).where(
                    _tokens.c.name == name
                )
            ).first()
            if exists is not None:
                same = (
                    exists.token_hash == hash_token(token)
                    and exists.scopes == " ".join(scope_set)
                    and exists.revoked_at is None
                )
                if exist_ok and same:
                    return token
                differs = " with another value, scopes or state" if exist_ok else ""
                raise InvalidRequestError(
                    "name",
                    f"a token named {name!r} exists{differs}; revoke it or pick another name",
                )
            conn.execute(
                sa.insert(_tokens).values(
                    name=name,
                    token_hash=hash_token(token),
                    scopes=" ".join(scope_set),
                    created_at=utcnow(),
                )
            )
        self._invalidate()
        return token

    def list(self) -> list[TokenInfo]:
        """Every token, revoked ones included."""
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(_tokens).order_by(_tokens.c.id)).all()
        return [
            TokenInfo(r.name, tuple(r.scopes.split()), r.created_at, r.last_used_at, r.revoked_at)
            for r in rows
        ]

    def revoke(self, name: str) -> bool:
        """Revoke the token called ``name``; False if there is no such active token."""
        with self.engine.begin() as conn:
            result = conn.execute(
                sa.update(_tokens)
                .where(_tokens.c.name == name, _tokens.c.revoked_at.is_(None))
                .values(revoked_at=utcnow())
            )
        self._invalidate()
        return bool(result.rowcount)

    def any_active(self) -> bool:
        """True when every request needs a token: an unrevoked token exists, or one did
        since this store was made (the module docstring: a guarded server never opens)."""
        now = time.monotonic()
        with self._lock:
            if self._any is not None and now - self._any[0] < self.cache_s:
                return self._any[1]
        with self.engine.connect() as conn:
            found = conn.execute(
                sa.select(_tokens.c.id).where(_tokens.c.revoked_at.is_(None)).limit(1)
            ).first()
        with self._lock:
            self._guarded = self._guarded or found is not None
            self._any = (now, self._guarded)
            return self._guarded

    def active_count(self) -> int:
        """How many unrevoked tokens the database holds."""
        with self.engine.connect() as conn:
            count = conn.execute(
                sa.select(sa.func.count())
                .select_from(_tokens)
                .where(_tokens.c.revoked_at.is_(None))
            ).scalar()
        return int(count or 0)

    def _invalidate(self) -> None:
        with self._lock:
            self._any = None
            self._cache.clear()

    # ------------------------------------------------------------------ checking
    def authenticate_cached(self, authorization: str | None) -> Principal | None:
        """The principal when memory alone decides it (no database round trip), else None.

        The hot paths call this on the event loop and fall back to :meth:`authenticate`
        on a worker thread when it returns None (cache cold or expired, or a bad token,
        whose precise error the slow path produces).
        """
        now = time.monotonic()
        with self._lock:
            any_active = self._any
            if any_active is None or now - any_active[0] >= self.cache_s:
                return None
            if not any_active[1]:
                return OPEN
            if not authorization:
                return None
            scheme, _, token = authorization.partition(" ")
            if scheme.lower() != "bearer" or not token.strip():
                return None
            cached = self._cache.get(hash_token(token.strip()))
        if cached is None or now - cached[0] >= self.cache_s:
            return None
        return cached[1]

    def authenticate(self, authorization: str | None) -> Principal:
        """The principal for an ``Authorization`` header, or UnauthenticatedError."""
        if not self.any_active():
            return OPEN
        if not authorization:
            raise UnauthenticatedError(
                "this server needs a bearer token: send 'Authorization: Bearer <token>' "
                "(an admin creates one with `kcache token create NAME --scope read`)"
            )
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise UnauthenticatedError("the Authorization header must be 'Bearer <token>'")
        digest = hash_token(token.strip())
        now = time.monotonic()
        with self._lock:
            cached = self._cache.get(digest)
        if cached is not None and now - cached[0] < self.cache_s:
            principal = cached[1]
        else:
            principal = self._check(digest)
            self._cache.put(digest, (now, principal))
        if principal is None:
            raise UnauthenticatedError("the bearer token is unknown or revoked")
        return principal

    def _check(self, digest: str) -> Principal | None:
        with self.engine.begin() as conn:
            row = conn.execute(
                sa.select(_tokens.c.name, _tokens.c.token_hash, _tokens.c.scopes).where(
                    _tokens.c.token_hash == digest, _tokens.c.revoked_at.is_(None)
                )
            ).first()
            # Constant-time comparison of the stored hash, defence in depth behind the lookup.
            if row is None or not hmac.compare_digest(row.token_hash, digest):
                return None
            conn.execute(
                sa.update(_tokens)
                .where(_tokens.c.token_hash == digest)
                .values(last_used_at=utcnow())
            )
        return Principal(row.name, frozenset(row.scopes.split()))


# ---------------------------------------------------------------------- the ASGI gate

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
#: Where the gate leaves the request's :class:`Principal` in the ASGI scope.
PRINCIPAL_KEY = "kcache.principal"
# Probes, the dashboard page (it asks for a token itself), / (a redirect to it) and the API
# contract need none. (No /docs page is served: see kcache_server.serving.app.)
_PUBLIC = frozenset({"/", "/healthz", "/readyz", "/dashboard", "/openapi.json"})
_PUBLIC_PREFIXES = ("/dashboard/",)


def authorization_header(scope: Scope) -> str | None:
    """The request's one ``Authorization`` header; two or more are a :class:`BadRequestError`.

    Two headers are ambiguous (a proxy may have added one, and frameworks disagree
    on which wins), so the request is refused rather than guessed at.
    """
    found: str | None = None
    for name, value in scope["headers"]:
        if name == b"authorization":
            if found is not None:
                raise BadRequestError(
                    "the request has more than one Authorization header; send exactly one"
                )
            found = value.decode("latin-1")
    return found


async def _answer(exc: ServerError, scope: Scope, receive: Receive, send: Send) -> None:
    # Imported here: starlette is the web layer, the token store above is used without it.
    from starlette.responses import JSONResponse

    await JSONResponse(error_body(exc), error_info(exc).status)(scope, receive, send)


class AuthGate:
    """Pure ASGI middleware: the bearer token is checked before the body is read.

    A request that is ambiguous before any token is looked at (two ``Authorization``
    headers, a control character in its path) is a 400. The principal is left in ``scope[PRINCIPAL_KEY]`` for the routes (each route
    then requires its scope); public paths pass with none.
    """

    def __init__(self, app: ASGIApp, tokens: TokenStore) -> None:
        self.app = app
        self.tokens = tokens

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Authenticate, then pass the request on (its body still unread)."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            path: str = scope["path"]
            if _CONTROL.search(path):
                # Starlette's route patterns end in "$": "/artifact\n" would reach a route.
                raise BadRequestError("the request path holds a control character")
            header = authorization_header(scope)
            if path not in _PUBLIC and not path.startswith(_PUBLIC_PREFIXES):
                principal = self.tokens.authenticate_cached(header)
                if principal is None:  # the database must answer: off the event loop
                    principal = await anyio.to_thread.run_sync(self.tokens.authenticate, header)
                scope[PRINCIPAL_KEY] = principal
        except (UnauthenticatedError, BadRequestError) as exc:
            await _answer(exc, scope, receive, send)
            return
        await self.app(scope, receive, send)
