"""The two ways a request goes to the server and its answer comes back: :class:`Wire`.

A :class:`~kcache_client._http.Transport` sends every try through one wire, picked
once, when it is made (:func:`open_wire`); the retries, the request count and the
mapping of errors are the transport's, the same for both wires:

* :class:`HttpxWire`: every request through an ``httpx.Client``, an injected one as it
  is (its hooks, proxies and transport apply; redirects are never followed), or one of
  its own, made on first use only, so a transport that never needs it never builds one
  (nor its SSL context).
* :class:`LeanWire`: GETs and POSTs (a JSON body, encoded as httpx encodes it) through
  :class:`~kcache_client._lean_http.LeanClient`, a keep-alive ``http.client`` pool that
  costs a third of httpx's CPU per request (a warm fetch is one such GET). What it does
  not speak (another method, a GET with a body, a target httpx would percent-encode, a
  streamed answer) it hands to the :class:`HttpxWire` it was made with.

The lean wire is picked when it would do what httpx does (:func:`lean_path_serves`): no
injected client, an ``http``/``https`` URL without credentials, and no proxy from the
environment for it (``HTTP_PROXY``/``HTTPS_PROXY``/``ALL_PROXY`` unset, or ``NO_PROXY``
covering the host), judged once, as httpx reads its proxies once.

Both bound a try alike: every try ends by its ``until`` (connect, send, headers and the
whole body; past it, :class:`~kcache_client._lean_http.DeadlineExceeded`): the lean wire
bounds every socket read and its TLS handshake by it; the httpx wire caps httpx's
timeouts by it and waits for the exchange (in a thread of its own) no longer than it.
A streamed answer (a bundle) is bounded the same way: the lean wire reads it through the
same deadline-bounded socket reads; the httpx wire reads it in a thread of its own that
hands it over through a queue of a few pieces, each waited for no longer than ``until``.
Both read a body against the limit decided from its status and headers before it is
read (:class:`~kcache_client._lean_http.AnswerRefused` past it, the connection
dropped), refuse oversized headers, and raise the ``httpx.TransportError`` httpx
would for a connection that fails.
"""

from __future__ import annotations

import json as jsonlib
import queue
import re
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Protocol, TypeVar
from urllib.parse import urlsplit

import httpx

from kcache_client._lean_http import (
    AnswerRefused,
    BodyLimit,
    DeadlineExceeded,
    LeanClient,
    LeanResponse,
)

__all__ = ["HttpxWire", "LeanWire", "Reply", "StreamReply", "Wire", "lean_path_serves", "open_wire"]

_T = TypeVar("_T")

#: A request target ``http.client`` sends as it is (httpx would percent-encode the rest).
_PLAIN_TARGET = re.compile(r"[!-~]*")


class Reply(Protocol):
    """A whole answer, as a wire hands it back: a :class:`~kcache_client._lean_http.LeanResponse`."""

    @property
    def status_code(self) -> int:
        """The answer's status."""
        ...

    @property
    def headers(self) -> Mapping[str, str]:
        """Its headers, looked up case-insensitively."""
        ...

    @property
    def content(self) -> bytes:
        """Its whole body."""
        ...

    @property
    def text(self) -> str:
        """Its body decoded by the ``Content-Type`` charset (UTF-8 if none)."""
        ...

    @property
    def url(self) -> object:
        """The URL the request went to."""
        ...

    def json(self, **kwargs: Any) -> Any:
        """Its body parsed as JSON (ValueError if it is not)."""
        ...


class StreamReply(Protocol):
    """An answer whose body is read as it arrives: a
    :class:`~kcache_client._lean_http.LeanStream` or an ``httpx.Response``."""

    @property
    def status_code(self) -> int:
        """The answer's status."""
        ...

    @property
    def headers(self) -> Mapping[str, str]:
        """Its headers, looked up case-insensitively."""
        ...

    def iter_bytes(self, chunk_size: int | None = ...) -> Iterator[bytes]:
        """Its body, piece by piece, read as this is iterated."""
        ...


class Wire(Protocol):
    """One way to one server: sends a request and reads its answer, nothing more.

    Made with the server's URL, the ``httpx.Timeout`` of every wait for bytes and the
    headers of every request. It does not retry (beyond sending a GET again on a fresh
    connection when a kept one turns out closed before its answer began), count or map
    statuses: its caller (:class:`~kcache_client._http.Transport`) does.
    """

    def send(
        self,
        method: str,
        path: str,
        json: Any,
        timeout: float | None,
        until: float,
        limit: BodyLimit,
    ) -> Reply:
        """One try of ``method path`` (``json``, when not None, its body), its answer read whole.

        ``timeout`` (seconds) replaces each wait for bytes of the wire's timeouts;
        ``until`` (a ``time.monotonic()`` instant) ends the whole exchange, connect to
        last byte (DeadlineExceeded); ``limit`` decides from the status and headers how
        long the body may be (AnswerRefused past it, or raised by ``limit`` itself).
        A failure to connect, send or read raises the ``httpx.TransportError`` httpx
        would; a redirect is answered as it is, never followed.
        """
        ...

    def stream(
        self, method: str, path: str, json: Any, until: float
    ) -> AbstractContextManager[StreamReply]:
        """``method path`` whose answer is handed over once its headers are in, its body unread.

        The body is read as the caller iterates ``iter_bytes()``; the whole exchange,
        connect to the last byte read, ends by ``until`` (DeadlineExceeded), however
        slowly the bytes come, and at most a few pieces of the body are held ahead of
        the caller (no limit on its length: the caller bounds what it reads). The
        connection is released when the context ends. Raises ``httpx.TransportError``
        for a failure to connect, send or read; a redirect is not followed.
        """
        ...

    def close(self) -> None:
        """Close the connections this wire opened (never an injected client: its owner closes it).

        Later requests raise RuntimeError.
        """
        ...


def lean_path_serves(url: str) -> bool:
    """Whether requests to ``url`` may skip httpx: it would connect to the host itself.

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


def open_wire(
    url: str, timeout: httpx.Timeout, headers: Mapping[str, str], client: httpx.Client | None
) -> Wire:
    """The wire of a transport to ``url``, picked once: lean where :func:`lean_path_serves`.

    ``client``, when given, carries every request (:class:`HttpxWire`): its hooks,
    proxies and transport must apply.
    """
    through_httpx = HttpxWire(url, timeout, headers, client)
    if client is None and lean_path_serves(url):
        return LeanWire(url, timeout, headers, through_httpx)
    return through_httpx


class HttpxWire:
    """Every request through httpx; see the module docstring.

    ``client``, when given, is used as it is (except that redirects are never
    followed) and never closed here; otherwise the wire's own client, with
    ``timeout``, is made on first use (once, whichever thread asks) and closed by
    :meth:`close`.
    """

    def __init__(
        self,
        url: str,
        timeout: httpx.Timeout,
        headers: Mapping[str, str],
        client: httpx.Client | None = None,
    ) -> None:
        self.url = url
        self._timeout = timeout
        self._headers = dict(headers)
        self._owned = client is None
        self._client = client
        self._lock = threading.Lock()
        self._closed = False

    def send(
        self,
        method: str,
        path: str,
        json: Any,
        timeout: float | None,
        until: float,
        limit: BodyLimit,
    ) -> Reply:
        """See :meth:`Wire.send`: the exchange runs in a thread of its own, waited for until ``until``."""
        client = self._httpx()
        request = client.build_request(
            method,
            self.url + path,
            json=json,
            headers=self._headers,
            timeout=_capped(client.timeout if timeout is None else httpx.Timeout(timeout), until),
        )
        return _before(until, lambda abandoned: _exchange(client, request, limit, abandoned))

    @contextmanager
    def stream(self, method: str, path: str, json: Any, until: float) -> Iterator[StreamReply]:
        """See :meth:`Wire.stream`: httpx reads in a thread of its own (:class:`_Relay`), its
        timeouts capped by ``until``; the caller waits for each piece no longer than ``until``."""
        client = self._httpx()
        request = client.build_request(
            method,
            self.url + path,
            json=json,
            headers=self._headers,
            timeout=_capped(client.timeout, until),
        )
        relay = _Relay(until)
        threading.Thread(
            target=relay.run, args=(client, request), name="kcache-http-stream", daemon=True
        ).start()
        try:
            yield relay.head()
        finally:
            relay.abandon()

    def close(self) -> None:
        """See :meth:`Wire.close`."""
        if not self._owned:
            return
        with self._lock:
            self._closed = True
            client = self._client
        if client is not None:
            client.close()

    def _httpx(self) -> httpx.Client:
        """The injected client, or our own, made on first use (once, whichever thread asks)."""
        client = self._client
        if client is None:
            with self._lock:
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


class LeanWire:
    """GETs and POSTs through a :class:`~kcache_client._lean_http.LeanClient`; see the module docstring.

    What it speaks is fixed when it is made: a GET without a body, or a POST, to a
    target ``http.client`` sends as it is. Everything else goes to ``other``, the
    :class:`HttpxWire` of the same server it was made with (and closes with it).
    """

    def __init__(
        self, url: str, timeout: httpx.Timeout, headers: Mapping[str, str], other: HttpxWire
    ) -> None:
        self._client = LeanClient(url, timeout)
        self._other = other
        # Made once: a warm fetch allocates nothing of its own here.
        self._headers = dict(headers)
        self._json_headers = {**self._headers, "Content-Type": "application/json"}

    def send(
        self,
        method: str,
        path: str,
        json: Any,
        timeout: float | None,
        until: float,
        limit: BodyLimit,
    ) -> Reply:
        """See :meth:`Wire.send`; a request this wire does not speak goes to its httpx wire."""
        if _PLAIN_TARGET.fullmatch(path) is not None:
            if method == "GET" and json is None:
                return self._client.request(
                    "GET", path, self._headers, None, timeout=timeout, until=until, limit=limit
                )
            if method == "POST":
                if json is None:  # as httpx sends it: no body, no content type
                    headers, body = self._headers, b""
                else:
                    headers, body = self._json_headers, _json_body(json)
                return self._client.request(
                    "POST", path, headers, body, timeout=timeout, until=until, limit=limit
                )
        return self._other.send(method, path, json, timeout, until, limit)

    def stream(
        self, method: str, path: str, json: Any, until: float
    ) -> AbstractContextManager[StreamReply]:
        """See :meth:`Wire.stream`: a POST with a JSON body or a GET through the lean client
        (a bundle), anything else through its httpx wire."""
        if _PLAIN_TARGET.fullmatch(path) is not None:
            if method == "POST" and json is not None:
                return self._client.stream(
                    "POST", path, self._json_headers, _json_body(json), until=until
                )
            if method == "GET" and json is None:
                return self._client.stream("GET", path, self._headers, until=until)
        return self._other.stream(method, path, json, until)

    def close(self) -> None:
        """See :meth:`Wire.close`: the lean pool and the httpx wire both."""
        self._client.close()
        self._other.close()


def _json_body(value: Any) -> bytes:
    """``value`` as httpx sends a ``json=`` body: compact UTF-8, NaN refused (ValueError)."""
    return jsonlib.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


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


#: Pieces of a streamed body an httpx wire's reader holds ahead of its caller (64 KiB each).
_AHEAD = 4
_PIECE = 64 * 1024


class _RelayedAnswer:
    """A streamed answer read by a :class:`_Relay`: status, headers, and its body's pieces."""

    def __init__(self, relay: _Relay, status_code: int, headers: httpx.Headers) -> None:
        self._relay = relay
        self.status_code = status_code
        self.headers = headers

    def iter_bytes(self, chunk_size: int | None = None) -> Iterator[bytes]:
        """The body's pieces (of at most 64 KiB; ``chunk_size`` is not honoured), each
        waited for no longer than the deadline."""
        while True:
            kind, value = self._relay.take()
            if kind == "end":
                return
            yield value


class _Relay:
    """One streamed exchange through httpx, read in a thread of its own (:meth:`run`).

    httpx bounds each wait for bytes, not the exchange (a trickle resets its timeouts),
    so the reading runs beside the caller, as :func:`_before` runs a whole exchange: it
    hands the headers, then each piece of the body, through a queue of :data:`_AHEAD`
    pieces (memory stays bounded, whatever the server sends), and the caller waits for
    each no longer than ``until`` (DeadlineExceeded). Once the caller is gone
    (:meth:`abandon`), the reader stops at its next piece and closes the answer; its own
    timeouts (capped by the deadline) end any wait of its.
    """

    def __init__(self, until: float) -> None:
        self._until = until
        self._queue: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=_AHEAD)
        self._abandoned = threading.Event()

    def run(self, client: httpx.Client, request: httpx.Request) -> None:
        """The reader (a thread of its own): the answer's head, its pieces, its end or error."""
        try:
            response = client.send(request, stream=True, follow_redirects=False)
        except BaseException as exc:  # handed to the caller, who raises it
            self._put("error", exc)
            return
        try:
            if not self._put("head", response):
                return
            for piece in response.iter_bytes(_PIECE):
                if not self._put("data", piece):
                    return
            self._put("end", None)
        except BaseException as exc:
            self._put("error", exc)
        finally:
            response.close()

    def _put(self, kind: str, value: Any) -> bool:
        """Hand ``value`` over, waiting for room while the caller is there; False once it left."""
        while not self._abandoned.is_set():
            try:
                self._queue.put((kind, value), timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def take(self) -> tuple[str, Any]:
        """The next item, waited for until the deadline (DeadlineExceeded); an error raised."""
        left = self._until - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded()
        try:
            kind, value = self._queue.get(timeout=left)
        except queue.Empty:
            raise DeadlineExceeded() from None
        if kind == "error":
            raise value
        return kind, value

    def head(self) -> _RelayedAnswer:
        """The answer once its status and headers are in."""
        _, response = self.take()
        return _RelayedAnswer(self, response.status_code, response.headers)

    def abandon(self) -> None:
        """The caller is done: the reader stops at its next piece, and the queue is dropped."""
        self._abandoned.set()
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                return
