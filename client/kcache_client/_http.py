"""HTTP to the kcache server: auth, bounded retries with backoff and jitter, error mapping.

Retries cover what a retry can fix: connection failures (refused, reset, timed
out) and the server saying it is overloaded (429/503/502/504), where its
``Retry-After`` is honoured. Every other error status is mapped once, here, to a
typed error from :mod:`kcache_client.errors`. Resolve requests are safe to repeat:
identical concurrent resolves join one compile on the server.

One policy over one wire: a :class:`Transport` sends each try through the
:class:`~kcache_client._wire.Wire` it picked when it was made, the lean ``http.client``
pool for everything kcache sends, or the caller's own ``httpx.Client`` when one is
injected (:mod:`kcache_client._wire`). The retry loop, the request count, the retry hook
and the error mapping are the code here, the same whichever wire carries the bytes
(tested once, on a wire of the tests' own).

Nothing the network sends is trusted further than it must be:

* Every try ends by a deadline over connect, send, headers and the whole body
  (``RetryPolicy.deadline_s``; ``compile_deadline_s`` for a request that may wait for
  a compile), and the whole call by the retry budget (:meth:`RetryPolicy.call_bound`):
  a server or proxy that trickles its answer costs a try its deadline, then the call
  its budget, never more (through an injected ``httpx.Client``, a try is bounded as
  :mod:`kcache_client._httpx_wire` states).
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
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, NamedTuple

from kcache_client._lean_answer import (
    AnswerRefused,
    BodyLimit,
    DeadlineExceeded,
    Limit,
)
from kcache_client._lean_errors import TransportError
from kcache_client._settings import DEFAULT_TIMEOUT, RetryPolicy
from kcache_client._waits import Timeouts
from kcache_client._wire import Reply, Wire, open_wire
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

if TYPE_CHECKING:
    import httpx

__all__ = [
    "MAX_JSON_BYTES",
    "BodyLimit",
    "Limit",
    "Reply",
    "RetryNotice",
    "Transport",
    "batch_item_error",
    "parse_retry_after",
    "tls_advice",
]

_BUSY = frozenset({429, 502, 503, 504})

#: The most bytes of a JSON answer (metadata, a resolve, a batch of them, an error,
#: an admin listing): the server's own cap on a request body, with room for compile logs.
MAX_JSON_BYTES = 32 << 20
_JSON_LIMIT = Limit(MAX_JSON_BYTES, "a JSON answer may have")

#: What a caller may say of the body it expects: a fixed limit, or one decided from
#: the answer's headers (it may raise, to refuse the answer before its body is read).
ExpectedBody = Limit | Callable[[Mapping[str, str]], Limit]


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


class RetryNotice(NamedTuple):
    """What a :class:`Transport`'s ``on_retry`` hook is told before it waits to try again."""

    #: The server (the transport's URL).
    url: str
    method: str
    path: str
    #: The try about to be made, counted from 1 (2: the first retry).
    next_try: int
    #: The most tries the call may make (``RetryPolicy.attempts``).
    attempts: int
    #: How long the transport waits first, in seconds (a backoff, or the server's Retry-After).
    wait_s: float
    #: Why the last try failed: ``HTTP 503``, or the transport error's text.
    cause: str


#: Why a request of an offline transport was not sent (KCACHE_OFFLINE).
OFFLINE_CAUSE = "offline: KCACHE_OFFLINE is set, so no request was sent"


class Transport:
    """One server: its wire, its headers, and the retry and error policy of every request.

    ``client``, when given, is used as it is for every request (its timeouts, limits,
    proxies, event hooks and transport apply, except that redirects are never
    followed) and never closed here; kcache adds its ``Authorization`` and
    ``User-Agent`` headers (and ``headers``) to each request and sends absolute URLs.
    Otherwise every request goes through the lean pool
    (:func:`~kcache_client._wire.open_wire`, with ``timeout``); :meth:`close` closes it.
    ``wire`` replaces both (the tests give a wire of their own, to test the policy
    alone). ``requests`` counts the HTTP requests sent (retries included), for
    diagnostics.

    ``on_retry`` is told (a :class:`RetryNotice`, in the calling thread) before each
    wait for a retry of a call under the transport's own policy, ``retry``: a person at
    a terminal can be told that the command waits, and for what. ``give_up_after_outage``:
    once such a call has gone unanswered (ServerUnavailableError, its tries or its
    budget spent), later calls under that policy make one try each, since the server
    did not answer a moment ago (:attr:`gave_up` says so). A call given a policy of its
    own (the audit events, in the background) is retried by that policy alone, neither
    told nor cut short.
    """

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        retry: RetryPolicy | None = None,
        timeout: Timeouts | None = None,
        client: httpx.Client | None = None,
        user_agent: str = "kcache-client",
        headers: Mapping[str, str] | None = None,
        on_retry: Callable[[RetryNotice], None] | None = None,
        give_up_after_outage: bool = False,
        offline: bool = False,
        wire: Wire | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        #: ``KCACHE_OFFLINE``: nothing is sent; every request fails as an unreachable
        #: server's does, at once.
        self.offline = offline
        self.retry = retry or RetryPolicy()
        self.on_retry = on_retry
        self.give_up_after_outage = give_up_after_outage
        #: Whether a call under the transport's policy has gone unanswered, with
        #: ``give_up_after_outage``: later ones then make one try each.
        self.gave_up = False
        sent = {"User-Agent": user_agent}
        if token:
            sent["Authorization"] = f"Bearer {token}"
        sent.update(headers or {})
        self._wire = wire or open_wire(self.url, timeout or DEFAULT_TIMEOUT, sent, client)
        self._count_lock = threading.Lock()
        self.requests = 0

    def close(self) -> None:
        """Close the connection pools (not an injected client: its owner closes it)."""
        self._wire.close()

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
        timeouts of each wait for bytes. ``retry`` replaces the transport's policy for
        this call (without its ``on_retry`` and giving up). Raises ServerUnavailableError
        (ServerBusyError) once the tries or the budget are spent, ResponseRefusedError at
        once for an answer that breaks the protocol, the mapped error for any other
        error status.
        """
        if self.offline:
            raise ServerUnavailableError(self.url, OFFLINE_CAUSE)
        own = retry is None
        policy = self.retry if retry is None else retry
        attempts = 1 if own and self.gave_up else policy.attempts
        started = time.monotonic()
        per_try = policy.try_deadline(compiles=compiles)
        ends = started + policy.call_bound(compiles=compiles)
        retries_end = started + policy.budget_s
        url = self.url + path
        limit = _limit_of(expect, ok)
        last_status = 0
        last_retry_after: float | None = None
        cause = ""
        for attempt in range(attempts):
            with self._count_lock:
                self.requests += 1
            tried = time.monotonic()
            until = min(tried + per_try, ends)
            try:
                reply = self._wire.send(method, path, json, timeout, until, limit)
            except DeadlineExceeded:
                cause = (
                    f"DeadlineExceeded: no whole answer within {until - tried:.3g}s "
                    "(connect, headers and body)"
                )
                wait = policy.backoff(attempt)
                last_status = 0
            except TransportError as exc:
                # Connection refused/reset, DNS, timeouts, a server that died mid-reply.
                cause = _cause(exc, self.url)
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
            if attempt + 1 >= attempts or time.monotonic() + wait > retries_end:
                break
            if own and self.on_retry is not None:
                failed = f"HTTP {last_status}" if last_status else cause
                self.on_retry(
                    RetryNotice(self.url, method, path, attempt + 2, attempts, wait, failed)
                )
            time.sleep(wait)
        if own and self.give_up_after_outage:
            self.gave_up = True
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

    @contextmanager
    def stream(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        ok: tuple[int, ...] = (200,),
        headers_seen: Callable[[Mapping[str, str]], None] | None = None,
    ) -> Iterator[Iterator[bytes]]:
        """One request, not retried, whose answer's body is handed over as it arrives.

        The answer (status in ``ok``) is read as the caller iterates, the whole exchange
        within one try's deadline (``RetryPolicy.deadline_s``, as a single fetch's try:
        ``KCACHE_REQUEST_DEADLINE_S``), however slowly its bytes come, and nothing of it
        read ahead of the caller; counted in ``requests``. Another status
        raises its mapped error (its body read up to :data:`MAX_JSON_BYTES`); a
        connection that fails or the deadline passing, before or while the body is read,
        ServerUnavailableError (raised by the iteration itself when the body was being
        read, so the caller's handling of its own errors sees it). ``headers_seen`` is
        given the headers of an answer in ``ok`` before its body is read.
        """
        if self.offline:
            raise ServerUnavailableError(self.url, OFFLINE_CAUSE)
        with self._count_lock:
            self.requests += 1
        url = self.url + path
        tried = time.monotonic()
        until = tried + self.retry.try_deadline(compiles=False)
        try:
            with self._wire.stream(method, path, json, until) as response:
                if response.status_code not in ok:
                    text = b"".join(_bounded(response.iter_bytes(), MAX_JSON_BYTES)).decode(
                        "utf-8", "replace"
                    )
                    raise _error(response.status_code, url, text, response.headers, self.url)
                if headers_seen is not None:
                    headers_seen(response.headers)
                yield self._mapped(response.iter_bytes(), tried, until)
        except TransportError as exc:
            raise ServerUnavailableError(self.url, self._failure(exc, tried, until)) from None

    def _mapped(self, chunks: Iterator[bytes], tried: float, until: float) -> Iterator[bytes]:
        """``chunks``, a transport failure while they are read raised as ServerUnavailableError."""
        try:
            yield from chunks
        except TransportError as exc:
            raise ServerUnavailableError(self.url, self._failure(exc, tried, until)) from None

    def _failure(self, exc: TransportError, tried: float, until: float) -> str:
        """Why a try failed, as a ServerUnavailableError's cause (the deadline: as :meth:`request` says it)."""
        if isinstance(exc, DeadlineExceeded):
            return (
                f"DeadlineExceeded: no whole answer within {until - tried:.3g}s "
                "(connect, headers and body)"
            )
        return _cause(exc, self.url)


def _cause(exc: TransportError, url: str) -> str:
    """A transport error as a ServerUnavailableError's cause: its name, its text, what to change."""
    cause = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    advice = tls_advice(url, cause)
    return f"{cause}; {advice}" if advice else cause


def _bounded(chunks: Iterator[bytes], limit: int) -> Iterator[bytes]:
    """``chunks`` up to ``limit`` bytes in all (an error body is read no further)."""
    left = limit
    for chunk in chunks:
        if left <= 0:
            return
        yield chunk[:left]
        left -= len(chunk)


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
