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

Nothing the network sends is trusted further than it must be, on either path:

* Every try ends by a deadline over connect, send, headers and the whole body
  (``RetryPolicy.deadline_s``; ``compile_deadline_s`` for a request that may wait for
  a compile), and the whole call by the retry budget (:meth:`RetryPolicy.call_bound`):
  a server or proxy that trickles its answer costs a try its deadline, then the call
  its budget, never more. The lean path bounds every socket read by the deadline; the
  httpx path caps httpx's timeouts by it and waits for the exchange (in a thread of
  its own) no longer than it.
* Every body is read against a limit decided before it is read: for an answer in
  ``ok``, what the caller's ``expect`` says (from the headers, for an artifact: the size
  its metadata names), else :data:`MAX_JSON_BYTES`. A body announcing more, or sending
  one byte more, is refused at once (:class:`~kcache_client.errors.ResponseRefusedError`),
  the connection dropped; so are oversized headers, and a redirect, which is never
  followed (the token is sent to the configured server only).
* Such refusals are not retried: the same server would answer the same.
"""

from __future__ import annotations

import email.utils
import json as jsonlib
import re
import threading
import time
import urllib.request
from collections.abc import Callable, Mapping
from typing import Any, Protocol, TypeVar
from urllib.parse import urlsplit

import httpx

from kcache_client._lean_http import (
    AnswerRefused,
    BodyLimit,
    DeadlineExceeded,
    LeanClient,
    LeanResponse,
    Limit,
)
from kcache_client._settings import DEFAULT_TIMEOUT, RetryPolicy
from kcache_client.errors import (
    AuthenticationError,
    ClientError,
    RecipeRefusedError,
    RemoteCompileError,
    RemoteNotFoundError,
    RequestRejectedError,
    ResponseRefusedError,
    ServerBusyError,
    ServerResponseError,
    ServerUnavailableError,
)

__all__ = [
    "MAX_JSON_BYTES",
    "BodyLimit",
    "Limit",
    "Reply",
    "Transport",
    "batch_item_error",
    "lean_path_serves",
    "parse_retry_after",
    "tls_advice",
]

_BUSY = frozenset({429, 502, 503, 504})
_T = TypeVar("_T")

#: The most bytes of a JSON answer (metadata, a resolve, a batch of them, an error,
#: an admin listing): the server's own cap on a request body, with room for compile logs.
MAX_JSON_BYTES = 32 << 20
_JSON_LIMIT = Limit(MAX_JSON_BYTES, "a JSON answer may have")

#: What a caller may say of the body it expects: a fixed limit, or one decided from
#: the answer's headers (it may raise, to refuse the answer before its body is read).
ExpectedBody = Limit | Callable[[Mapping[str, str]], Limit]

#: A request target ``http.client`` sends as it is (httpx would percent-encode the rest).
_PLAIN_TARGET = re.compile(r"[!-~]*")


#: What OpenSSL says when the other end answered a TLS hello with something else (HTTP).
_NOT_TLS = ("WRONG_VERSION_NUMBER", "wrong version number", "record layer failure", "HTTP_REQUEST")
#: ... and when it does speak TLS, with a certificate this machine does not trust.
_UNTRUSTED = ("CERTIFICATE_VERIFY_FAILED",)


def tls_advice(url: str, cause: str) -> str | None:
    """What to change when ``cause`` (a transport error's text) is a TLS handshake that failed.

    None for every other cause. Retrying or starting the server fixes neither: an
    ``https://`` URL whose server speaks plain HTTP needs ``http://``; a certificate
    this machine does not trust needs its CA named.
    """
    if not url.startswith("https://"):
        return None
    if any(word in cause for word in _NOT_TLS):
        plain = "http://" + url[len("https://") :]
        return f"the server at {url} does not speak TLS (it answers plain HTTP): use {plain}"
    if any(word in cause for word in _UNTRUSTED):
        return (
            f"the certificate of {url} is not trusted here: set SSL_CERT_FILE to the CA "
            "bundle that signed it"
        )
    return None


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
    proxies, event hooks and transport apply, except that redirects are never
    followed) and never closed here; kcache adds its ``Authorization`` and
    ``User-Agent`` headers to each request and sends absolute URLs. Otherwise the
    transport makes its own: GETs and POSTs take the lean path when
    :func:`lean_path_serves` the URL (decided here, once, as httpx reads its proxies
    once), the rest a client with ``timeout`` made on first use; :meth:`close` closes
    both. ``requests`` counts the HTTP requests sent (retries included), for
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
        expect: ExpectedBody = _JSON_LIMIT,
        compiles: bool = False,
    ) -> Reply:
        """Send with retries; return a reply whose status is in ``ok``, or raise a typed error.

        ``expect`` bounds the body of an answer in ``ok`` (a :class:`Limit`, or a function
        of the headers that decides one, or raises to refuse them); other answers may
        have :data:`MAX_JSON_BYTES`. ``compiles``: the request may wait for a compile,
        so each try has ``compile_deadline_s``. ``timeout`` (seconds) overrides the
        timeouts of each wait for bytes. Raises ServerUnavailableError (ServerBusyError)
        once the tries or the budget are spent, ResponseRefusedError at once for an
        answer that breaks the protocol, the mapped error for any other error status.
        """
        policy = retry or self.retry
        started = time.monotonic()
        per_try = policy.try_deadline(compiles=compiles)
        ends = started + policy.call_bound(compiles=compiles)
        retries_end = started + policy.budget_s
        url = self.url + path
        limit = _limit_of(expect, ok)
        last_status = 0
        last_retry_after: float | None = None
        cause = ""
        for attempt in range(policy.attempts):
            with self._count_lock:
                self.requests += 1
            tried = time.monotonic()
            until = min(tried + per_try, ends)
            try:
                reply = self._send(method, path, json, timeout, until, limit)
            except DeadlineExceeded:
                cause = (
                    f"DeadlineExceeded: no whole answer within {until - tried:.3g}s "
                    "(connect, headers and body)"
                )
                wait = policy.backoff(attempt)
                last_status = 0
            except httpx.TransportError as exc:
                # Connection refused/reset, DNS, timeouts, a server that died mid-reply.
                cause = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                advice = tls_advice(self.url, cause)
                cause = f"{cause}; {advice}" if advice else cause
                wait = policy.backoff(attempt)
                last_status = 0
            except AnswerRefused as exc:
                raise ResponseRefusedError(url, _said(exc), status=exc.status) from None
            else:
                if reply.status_code in ok:
                    return reply
                if reply.status_code not in _BUSY:
                    raise _error(
                        reply.status_code, str(reply.url), reply.text, reply.headers, self.url
                    )
                last_status = reply.status_code
                last_retry_after = parse_retry_after(reply.headers.get("Retry-After"))
                wait = (
                    min(last_retry_after, policy.max_retry_after_s)
                    if last_retry_after is not None
                    else policy.backoff(attempt)
                )
            # A retry starts within the budget (no wait past it); a try ends by `ends`.
            if attempt + 1 >= policy.attempts or time.monotonic() + wait > retries_end:
                break
            time.sleep(wait)
        if last_status:
            raise ServerBusyError(self.url, last_status, last_retry_after)
        raise ServerUnavailableError(self.url, cause or "no response")

    def request_json(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        ok: tuple[int, ...] = (200,),
        retry: RetryPolicy | None = None,
        compiles: bool = False,
    ) -> Any:
        """:meth:`request`, the answer's body parsed as JSON (ResponseRefusedError if it is not)."""
        reply = self.request(method, path, json=json, ok=ok, retry=retry, compiles=compiles)
        try:
            return reply.json()
        except ValueError as exc:
            raise ResponseRefusedError(
                self.url + path,
                f"HTTP {reply.status_code} with a body that is not JSON ({exc})",
                status=reply.status_code,
            ) from None

    def _send(
        self,
        method: str,
        path: str,
        json: Any,
        timeout: float | None,
        until: float,
        limit: BodyLimit,
    ) -> Reply:
        """One try: the lean path for a GET or a JSON POST it serves, httpx for the rest."""
        lean = self._lean
        if lean is not None and _PLAIN_TARGET.fullmatch(path):
            if method == "GET" and json is None:
                return lean.get(path, self._headers, timeout=timeout, until=until, limit=limit)
            if method == "POST":
                if json is None:  # as httpx sends it: no body, no content type
                    headers, body = self._headers, b""
                else:
                    headers, body = self._json_headers, _json_body(json)
                return lean.request(
                    "POST", path, headers, body, timeout=timeout, until=until, limit=limit
                )
        client = self._httpx()
        request = client.build_request(
            method,
            self.url + path,
            json=json,
            headers=self._headers,
            timeout=_capped(client.timeout if timeout is None else httpx.Timeout(timeout), until),
        )
        return _before(until, lambda abandoned: _exchange(client, request, limit, abandoned))

    def _httpx(self) -> httpx.Client:
        """The injected client, or our own, made on first use (once, whichever thread asks)."""
        client = self._client
        if client is None:
            with self._client_lock:
                if self._client is None:
                    if self._closed:  # as a closed httpx.Client would answer
                        raise RuntimeError("the transport has been closed")
                    # A plain-http server needs no TLS context, whose certificate store
                    # costs 20 ms to load (a prefetch's first request paid it: B12); no
                    # redirect is ever followed, so nothing here can reach https.
                    plain = self.url.startswith("http://")
                    self._client = httpx.Client(timeout=self._timeout, verify=not plain)
                client = self._client
        return client


def _limit_of(expect: ExpectedBody, ok: tuple[int, ...]) -> BodyLimit:
    """The body limit of an answer by its status: ``expect`` for those in ``ok``, else JSON's."""

    def limit(status: int, headers: Mapping[str, str]) -> Limit:
        if status not in ok:
            return _JSON_LIMIT
        return expect if isinstance(expect, Limit) else expect(headers)

    return limit


def _said(exc: AnswerRefused) -> str:
    """What a refused answer did, its status first when it had one."""
    return f"HTTP {exc.status}: {exc.problem}" if exc.status is not None else exc.problem


def _capped(timeout: httpx.Timeout, until: float) -> httpx.Timeout:
    """``timeout`` with no wait longer than what is left until ``until`` (DeadlineExceeded if nothing)."""
    left = until - time.monotonic()
    if left <= 0:
        raise DeadlineExceeded()

    def cap(value: float | None) -> float:
        return left if value is None else min(value, left)

    return httpx.Timeout(
        connect=cap(timeout.connect),
        read=cap(timeout.read),
        write=cap(timeout.write),
        pool=cap(timeout.pool),
    )


def _before(until: float, work: Callable[[threading.Event], _T]) -> _T:
    """``work(abandoned)`` in a thread of its own, waited for until ``until``; else DeadlineExceeded.

    httpx has no deadline over a whole exchange (its timeouts bound each wait for bytes,
    and a trickle of bytes resets them), so the exchange runs beside the caller, who
    stops waiting at the deadline. ``abandoned`` is set then: the exchange stops at its
    next piece of the body, and its own timeouts (capped by the deadline) end any wait.
    """
    done = threading.Event()
    abandoned = threading.Event()
    outcome: list[tuple[bool, Any]] = []

    def run() -> None:
        try:
            outcome.append((True, work(abandoned)))
        except BaseException as exc:  # handed to the caller, who raises it
            outcome.append((False, exc))
        finally:
            done.set()

    threading.Thread(target=run, name="kcache-http", daemon=True).start()
    if not done.wait(max(0.0, until - time.monotonic())):
        abandoned.set()
        raise DeadlineExceeded()
    succeeded, value = outcome[0]
    if not succeeded:
        raise value
    result: _T = value
    return result


def _exchange(
    client: httpx.Client, request: httpx.Request, limit: BodyLimit, abandoned: threading.Event
) -> LeanResponse:
    """One request through httpx, its body streamed against ``limit``; redirects not followed."""
    try:
        response = client.send(request, stream=True, follow_redirects=False)
    except httpx.RemoteProtocolError as exc:
        if "Receive buffer too long" in str(exc):  # h11's bound on the status line and headers
            raise AnswerRefused(f"its status line or headers are too long ({exc})") from exc
        raise
    try:
        status = response.status_code
        bound = limit(status, response.headers)
        declared = response.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > bound.bytes:
            raise AnswerRefused(
                f"its Content-Length is {declared} bytes, more than the {bound.bytes} bytes {bound.why}",
                status,
            )
        pieces: list[bytes] = []
        got = 0
        for piece in response.iter_bytes():
            if abandoned.is_set():
                raise DeadlineExceeded()
            got += len(piece)
            if got > bound.bytes:
                raise AnswerRefused(
                    f"its body is longer than the {bound.bytes} bytes {bound.why}", status
                )
            pieces.append(piece)
        return LeanResponse(status, response.headers, b"".join(pieces), str(response.url))
    finally:
        response.close()


def _error(
    status: int, url: str, text: str, headers: Mapping[str, str], server: str
) -> ClientError:
    """Map an error status and its JSON body ``{"error", "detail", ...}`` to a typed error.

    A redirect is refused as such: it is never followed, so the token is never sent to
    wherever it points.
    """
    if 300 <= status < 400:
        location = headers.get("location") or "nowhere (no Location header)"
        return ResponseRefusedError(
            url,
            f"HTTP {status} redirect to {location}, not followed "
            f"(kcache sends its token to {server} only; set KCACHE_URL to the server itself)",
            status=status,
        )
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
