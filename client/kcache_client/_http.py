"""HTTP to the kcache server: auth, bounded retries with backoff and jitter, error mapping.

Retries cover what a retry can fix: connection failures (refused, reset, timed
out) and the server saying it is overloaded (429/503/502/504), where its
``Retry-After`` is honoured. Every other error status is mapped once, here, to a
typed error from :mod:`kcache_client.errors`. Resolve requests are safe to repeat:
identical concurrent resolves join one compile on the server.

Two ways out, one policy. GETs (every fetch: artifact, blob, metadata, toolchains)
and POSTs (resolves, audit events; a JSON body, encoded as httpx encodes it) go
through :class:`~kcache_client._lean_http.LeanClient`, a keep-alive ``http.client``
pool that costs a third of httpx's CPU per request, as long as it would do what
httpx does: no injected client (its hooks, proxies and transport must apply), an
``http``/``https`` URL without credentials, and no proxy from the environment for it
(``HTTP_PROXY``/``HTTPS_PROXY``/``ALL_PROXY`` unset, or ``NO_PROXY`` covering the
host). Everything else (DELETEs, an injected client, a proxied server) goes through
httpx, whose client is made on first use only, so a client that never needs it never
builds one (nor its SSL context). Both answer a :class:`Reply`; the retry loop, the
request count and the error mapping are the same code for both.
"""

from __future__ import annotations

import email.utils
import json as jsonlib
import re
import threading
import time
import urllib.request
from collections.abc import Mapping
from typing import Any, Protocol
from urllib.parse import urlsplit

import httpx

from kcache_client._lean_http import LeanClient
from kcache_client._settings import DEFAULT_TIMEOUT, RetryPolicy
from kcache_client.errors import (
    AuthenticationError,
    ClientError,
    RecipeRefusedError,
    RemoteCompileError,
    RemoteNotFoundError,
    RequestRejectedError,
    ServerBusyError,
    ServerResponseError,
    ServerUnavailableError,
)

__all__ = ["Reply", "Transport", "batch_item_error", "lean_path_serves", "parse_retry_after"]

_BUSY = frozenset({429, 502, 503, 504})

#: A request target ``http.client`` sends as it is (httpx would percent-encode the rest).
_PLAIN_TARGET = re.compile(r"[!-~]*")


class Reply(Protocol):
    """What :meth:`Transport.request` answers: an ``httpx.Response`` or a lean one."""

    @property
    def status_code(self) -> int: ...

    @property
    def headers(self) -> Mapping[str, str]: ...

    @property
    def content(self) -> bytes: ...

    @property
    def text(self) -> str: ...

    @property
    def url(self) -> object: ...

    def json(self, **kwargs: Any) -> Any: ...


def lean_path_serves(url: str) -> bool:
    """Whether a GET to ``url`` may skip httpx: it would connect to the host itself.

    True for an ``http``/``https`` URL without user info (httpx would send those as
    Basic auth) that no proxy from the environment applies to: httpx reads the same
    ``urllib.request.getproxies()``; ``NO_PROXY`` is judged by ``proxy_bypass``.
    """
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return False
    if parts.username is not None or parts.password is not None or parts.query or parts.fragment:
        return False
    proxies = urllib.request.getproxies()
    if not proxies.get(parts.scheme) and not proxies.get("all"):
        return True
    return bool(urllib.request.proxy_bypass(parts.netloc))


def _json_body(value: Any) -> bytes:
    """``value`` as httpx sends a ``json=`` body: compact UTF-8, NaN refused (ValueError)."""
    return jsonlib.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


def parse_retry_after(value: str | None) -> float | None:
    """``Retry-After`` as seconds: a number, or an HTTP date; None if absent or garbled."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


class Transport:
    """One server: the lean GET pool and an ``httpx.Client``, plus the retry and error policy.

    ``client``, when given, is used as it is for every request (its timeouts, limits,
    proxies, event hooks and transport apply) and never closed here; kcache adds its
    ``Authorization`` and ``User-Agent`` headers to each request and sends absolute
    URLs. Otherwise the transport makes its own: GETs and POSTs take the lean
    path when :func:`lean_path_serves` the URL (decided here, once, as httpx reads its
    proxies once), the rest a client with ``timeout`` made on first use; :meth:`close`
    closes both. ``requests`` counts the HTTP requests sent (retries included), for
    diagnostics.
    """

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        retry: RetryPolicy | None = None,
        timeout: httpx.Timeout | None = None,
        client: httpx.Client | None = None,
        user_agent: str = "kcache-client",
    ) -> None:
        self.url = url.rstrip("/")
        self.retry = retry or RetryPolicy()
        self._headers = {"User-Agent": user_agent}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._json_headers = {**self._headers, "Content-Type": "application/json"}
        self._timeout = timeout or DEFAULT_TIMEOUT
        self._owned = client is None
        self._client = client
        self._client_lock = threading.Lock()
        self._closed = False
        self._lean = (
            LeanClient(self.url, self._timeout)
            if client is None and lean_path_serves(self.url)
            else None
        )
        self._count_lock = threading.Lock()
        self.requests = 0

    def close(self) -> None:
        """Close the connection pools (not an injected client: its owner closes it)."""
        if self._lean is not None:
            self._lean.close()
        if self._owned:
            with self._client_lock:
                self._closed = True
                client = self._client
            if client is not None:
                client.close()

    def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        ok: tuple[int, ...] = (200,),
        retry: RetryPolicy | None = None,
        timeout: float | None = None,
    ) -> Reply:
        """Send with retries; return a reply whose status is in ``ok``, or raise a typed error."""
        policy = retry or self.retry
        deadline = time.monotonic() + policy.budget_s
        last_status = 0
        last_retry_after: float | None = None
        cause = ""
        for attempt in range(policy.attempts):
            with self._count_lock:
                self.requests += 1
            try:
                reply = self._send(method, path, json, timeout)
            except httpx.TransportError as exc:
                # Connection refused/reset, DNS, timeouts, a server that died mid-reply.
                cause = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                wait = policy.backoff(attempt)
                last_status = 0
            else:
                if reply.status_code in ok:
                    return reply
                if reply.status_code not in _BUSY:
                    raise _error(reply.status_code, str(reply.url), reply.text)
                last_status = reply.status_code
                last_retry_after = parse_retry_after(reply.headers.get("Retry-After"))
                wait = (
                    min(last_retry_after, policy.max_retry_after_s)
                    if last_retry_after is not None
                    else policy.backoff(attempt)
                )
            if attempt + 1 >= policy.attempts or time.monotonic() + wait > deadline:
                break
            time.sleep(wait)
        if last_status:
            raise ServerBusyError(self.url, last_status, last_retry_after)
        raise ServerUnavailableError(self.url, cause or "no response")

    def _send(self, method: str, path: str, json: Any, timeout: float | None) -> Reply:
        """One try: the lean path for a GET or a JSON POST it serves, httpx for the rest."""
        if self._lean is not None and _PLAIN_TARGET.fullmatch(path):
            if method == "GET" and json is None:
                return self._lean.get(path, self._headers, timeout=timeout)
            if method == "POST":
                if json is None:  # as httpx sends it: no body, no content type
                    return self._lean.request("POST", path, self._headers, b"", timeout=timeout)
                return self._lean.request(
                    "POST", path, self._json_headers, _json_body(json), timeout=timeout
                )
        return self._httpx().request(
            method,
            self.url + path,
            json=json,
            headers=self._headers,
            timeout=timeout if timeout is not None else httpx.USE_CLIENT_DEFAULT,
        )

    def _httpx(self) -> httpx.Client:
        """The injected client, or our own, made on first use (once, whichever thread asks)."""
        client = self._client
        if client is None:
            with self._client_lock:
                if self._client is None:
                    if self._closed:  # as a closed httpx.Client would answer
                        raise RuntimeError("the transport has been closed")
                    self._client = httpx.Client(timeout=self._timeout)
                client = self._client
        return client


def _error(status: int, url: str, text: str) -> ServerResponseError | RemoteCompileError:
    """Map an error status and its JSON body ``{"error", "detail", ...}`` to a typed error."""
    try:
        body = jsonlib.loads(text)
    except ValueError:
        body = None
    if not isinstance(body, dict):
        body = {"error": "http_error", "detail": text[:500]}
    code = str(body.get("error", "http_error"))
    detail = body.get("detail", "")
    detail = detail if isinstance(detail, str) else str(detail)
    if code == "compile_error":
        return RemoteCompileError(body.get("recipe_key"), str(body.get("log") or ""), detail=detail)
    if status in (401, 403):
        return AuthenticationError(url, status, code, detail or "set KCACHE_TOKEN to a valid token")
    if status == 404:
        return RemoteNotFoundError(url, status, code, detail)
    if status in (400, 413, 422):
        return RequestRejectedError(url, status, code, detail)
    return ServerResponseError(url, status, code, detail)


def batch_item_error(url: str, item: dict[str, Any], recipe_key: str) -> ClientError:
    """The typed error of one failed recipe of ``POST /v1/resolve/batch``.

    ``item`` is its result ``{"status": "error", "error", "detail", "log"?, "recipe_key"?}``:
    a compile error is a RemoteCompileError, a miss without compile a RemoteNotFoundError,
    anything else a RecipeRefusedError carrying the server's code.
    """
    code = str(item.get("error") or "error")
    detail = str(item.get("detail") or "")
    log = str(item.get("log") or "")
    if code == "compile_error":
        return RemoteCompileError(str(item.get("recipe_key") or recipe_key), log, detail=detail)
    if code == "not_found":
        return RemoteNotFoundError(url, 404, code, detail)
    return RecipeRefusedError(url, code, detail, recipe_key=recipe_key, log=log)
