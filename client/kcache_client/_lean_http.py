"""A lean keep-alive HTTP/1.1 client for one origin, on the stdlib's ``http.client``.

Why: a rank fetching its kernels is CPU-bound on a small machine, and httpx spends
about three times the CPU of ``http.client`` on each request (and builds an SSL
context from certifi when its client is made, even for plain http). :class:`LeanClient`
does only what kcache's requests need: one origin, a small idle-connection pool,
whole bodies (a JSON body for a POST), and one answer read as it arrives
(:meth:`LeanClient.stream`, a bundle: httpx's first request in a process imported
httpcore, h11 and anyio, 20 ms of a node's cold prefetch in B12).

What it keeps the same as httpx: TLS verification (the context is
``httpx.create_ssl_context()``, made on the first https connection only, as httpx
would make it from ``SSL_CERT_FILE``/``SSL_CERT_DIR`` or certifi), the timeouts of
an ``httpx.Timeout`` (connect while connecting, write while sending, read while
reading; None is none), TCP_NODELAY (``http.client`` sets it on connect), and the
failures: every transport failure is raised as the ``httpx.TransportError`` httpx
would raise (``ConnectError``, ``ConnectTimeout``, ``ReadTimeout``, ``ReadError``,
``WriteError``, ``RemoteProtocolError``), so a caller's retry loop treats both alike.

A keep-alive connection the server closed while it sat idle is dropped before it is
used again when its socket reads as closed (as httpcore does). One that fails anyway
(the request cannot be sent, or the answer ends or resets before it began) is sent
once more on a fresh connection, here, as urllib3 does, if it was a GET; another
method may have reached the server, so its failure goes to the caller's retry policy,
as httpx's would.

What it bounds, for a caller that does not trust the network: an ``until`` (a
``time.monotonic()`` instant) bounds the whole exchange, connect, send, status line,
headers and body, since every socket operation waits at most until then (each read of
the body included, however slowly its bytes trickle in), and so does a TLS handshake
(done without blocking, each wait for the peer bounded by what is left): past it,
:class:`DeadlineExceeded`. A ``limit`` (decided from the status and headers, before a
byte of the body is read) bounds the body: a ``Content-Length`` over it, or one byte
more than it, or a compressed body that decodes to more, is :class:`AnswerRefused`
at once and the connection is dropped; so are headers over ``http.client``'s bounds
(a 64 KiB line, 100 headers). The body is read in pieces, never more than the limit.
"""

from __future__ import annotations

import contextlib
import functools
import http.client
import io
import json as jsonlib
import select
import socket
import ssl
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple
from urllib.parse import urlsplit

import httpx

__all__ = [
    "AnswerRefused",
    "BodyLimit",
    "DeadlineExceeded",
    "LeanClient",
    "LeanHeaders",
    "LeanResponse",
    "LeanStream",
    "Limit",
]

#: Idle connections kept for reuse; one per thread that fetches at the same time.
MAX_IDLE = 16
#: The most bytes asked of the socket at once while reading a body.
_CHUNK = 64 * 1024


class Limit(NamedTuple):
    """The most bytes a body may have, and why (said when a body has more)."""

    bytes: int
    why: str


#: The limit of an answer's body, decided from its status and headers (it may raise
#: to refuse the answer before its body is read).
BodyLimit = Callable[[int, Mapping[str, str]], Limit]


class DeadlineExceeded(httpx.TimeoutException):
    """The exchange was not over (connect, send, headers, the whole body) by its deadline."""

    def __init__(
        self, message: str = "the deadline passed before the answer was read whole"
    ) -> None:
        super().__init__(message)


class AnswerRefused(Exception):
    """An answer broke a bound set for it (its headers, its body); the connection was dropped.

    Not an ``httpx.TransportError``: the same server would answer the same, so it is
    not worth a retry. ``status`` is the answer's status when it had one.
    """

    def __init__(self, problem: str, status: int | None = None) -> None:
        super().__init__(problem)
        self.problem = problem
        self.status = status


#: A reused connection failing like this was closed by the server while it was idle.
_STALE = (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError)


def _create_connection(
    address: tuple[str, int], timeout: float | None, source_address: Any = None
) -> socket.socket:
    """``socket.create_connection``, with an ASCII host name handed over as bytes.

    Given a str, ``getaddrinfo`` encodes the name with the ``idna`` codec, whose first
    use imports ``encodings.idna``, ``stringprep`` and ``unicodedata``: about 1 ms of
    CPU in every process's first fetch. For a name of ASCII labels (every IP address,
    every name in DNS's own letters) that codec gives the same bytes; any other
    name still goes through it.
    """
    host, port = address
    name: str | bytes = host.encode("ascii") if host.isascii() else host
    return socket.create_connection((name, port), timeout, source_address)  # type: ignore[arg-type]


class _BoundedHTTPSConnection(http.client.HTTPSConnection):
    """An ``HTTPSConnection`` whose TLS handshake ends by ``until`` as well.

    ``http.client`` handshakes on a blocking socket, each read waiting the connect
    timeout anew, so a peer that sends its handshake a byte at a time holds the caller
    as long as it likes. Here the handshake runs on the non-blocking socket, and every
    wait for the peer is bounded by the connect timeout and by what is left until
    ``until``.
    """

    until: float | None = None

    def connect(self) -> None:
        http.client.HTTPConnection.connect(self)  # TCP (TCP_NODELAY), no TLS yet
        sock = self._context.wrap_socket(  # type: ignore[attr-defined]
            self.sock, server_hostname=self.host, do_handshake_on_connect=False
        )
        self.sock = sock
        idle = self.timeout if isinstance(self.timeout, (int, float)) else None
        sock.setblocking(False)
        try:
            while True:
                try:
                    sock.do_handshake()
                    break
                except ssl.SSLWantReadError:
                    readers, writers = [sock], []
                except ssl.SSLWantWriteError:
                    readers, writers = [], [sock]
                left = None if self.until is None else self.until - time.monotonic()
                if left is not None and left <= 0:
                    raise DeadlineExceeded()
                wait = left if idle is None or (left is not None and left < idle) else idle
                if not any(select.select(readers, writers, [], wait)):
                    if wait == left:
                        raise DeadlineExceeded()
                    raise TimeoutError("the TLS handshake stalled")
        finally:
            sock.settimeout(idle)


class LeanHeaders(Mapping[str, str]):
    """Response headers with case-insensitive lookup; repeated headers joined by ``", "``.

    Values are decoded as httpx decodes them: UTF-8 where they are, else latin-1.
    """

    __slots__ = ("_by_name",)

    def __init__(self, pairs: list[tuple[str, str]]) -> None:
        by_name: dict[str, str] = {}
        for name, value in pairs:
            if not value.isascii():  # http.client read it as latin-1; httpx prefers UTF-8
                with contextlib.suppress(UnicodeError):
                    value = value.encode("latin-1").decode("utf-8")
            key = name.lower()
            by_name[key] = f"{by_name[key]}, {value}" if key in by_name else value
        self._by_name = by_name

    def __getitem__(self, name: str) -> str:
        return self._by_name[name.lower()]

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_name)

    def __len__(self) -> int:
        return len(self._by_name)

    def __repr__(self) -> str:
        return f"LeanHeaders({self._by_name!r})"


class LeanResponse:
    """A whole response: ``status_code``, ``headers``, ``content``, ``text``, ``json()``, ``url``.

    ``headers`` look up names case-insensitively (:class:`LeanHeaders`, or the
    ``httpx.Headers`` of an answer that came through httpx).
    """

    __slots__ = ("content", "headers", "status_code", "url")

    def __init__(
        self, status_code: int, headers: Mapping[str, str], content: bytes, url: str
    ) -> None:
        self.status_code = status_code
        self.headers = headers
        self.content = content
        self.url = url

    @property
    def text(self) -> str:
        """The body decoded by its ``Content-Type`` charset (UTF-8 if none), as httpx decodes it."""
        charset = "utf-8"
        for param in self.headers.get("content-type", "").split(";")[1:]:
            name, _, value = param.partition("=")
            if name.strip().lower() == "charset" and value.strip():
                charset = value.strip().strip('"')
        try:
            return self.content.decode(charset, errors="replace")
        except LookupError:  # a charset Python does not know
            return self.content.decode("utf-8", errors="replace")

    def json(self, **kwargs: Any) -> Any:
        """The body parsed as JSON (ValueError if it is not)."""
        return jsonlib.loads(self.content, **kwargs)

    def __repr__(self) -> str:
        return f"<LeanResponse [{self.status_code}] {self.url}>"


class LeanStream:
    """An answer whose body is read as the caller iterates :meth:`iter_bytes`.

    ``status_code``, ``headers`` (:class:`LeanHeaders`) and ``url`` as :class:`LeanResponse`'s.
    """

    def __init__(self, response: http.client.HTTPResponse, url: str) -> None:
        self._response = response
        self.status_code = response.status
        self.headers = LeanHeaders(response.getheaders())
        self.url = url
        #: The body was read to its end (the connection may then serve another request).
        self.finished = False

    def iter_bytes(self, chunk_size: int | None = None) -> Iterator[bytes]:
        """The body in pieces of at most ``chunk_size`` bytes (64 KiB by default), each read
        within the read timeout. A failure to read raises the ``httpx.TransportError``
        httpx would raise.
        """
        size = chunk_size or _CHUNK
        while True:
            try:
                piece = self._response.read(size)
            except BaseException as exc:
                mapped = _transport_error(exc, "body")
                if mapped is exc:
                    raise
                raise mapped from exc
            if not piece:
                self.finished = True
                return
            yield piece


class LeanClient:
    """GETs to one origin (``http`` or ``https``) over a small pool of keep-alive connections.

    Thread-safe: a thread takes an idle connection, or opens one, and gives it back
    once the answer has been read whole; a connection that failed, or whose answer
    said ``Connection: close``, is dropped. ``url`` may carry a path prefix, which
    every request path is appended to. ``connections_opened`` counts the connections
    made, for diagnostics.
    """

    def __init__(self, url: str, timeout: httpx.Timeout, *, max_idle: int = MAX_IDLE) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"the lean client speaks http(s) to a host, not {url!r}")
        self.url = url.rstrip("/")
        self._https = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port or (443 if self._https else 80)
        self._prefix = parts.path.rstrip("/")
        self._timeout = timeout
        self._max_idle = max_idle
        self._idle: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()
        self._ssl_context: ssl.SSLContext | None = None
        self._closed = False
        self.connections_opened = 0

    def get(
        self,
        path: str,
        headers: Mapping[str, str],
        *,
        timeout: float | None = None,
        until: float | None = None,
        limit: BodyLimit | None = None,
    ) -> LeanResponse:
        """``GET path`` with ``headers``, read whole (:meth:`request`)."""
        return self.request("GET", path, headers, timeout=timeout, until=until, limit=limit)

    def request(
        self,
        method: str,
        path: str,
        headers: Mapping[str, str],
        body: bytes | None = None,
        *,
        timeout: float | None = None,
        until: float | None = None,
        limit: BodyLimit | None = None,
    ) -> LeanResponse:
        """``method path`` with ``headers`` and ``body``, the answer read whole.

        ``timeout`` (seconds) overrides the client's four timeouts; ``until`` (a
        ``time.monotonic()`` instant) ends the whole exchange (:class:`DeadlineExceeded`);
        ``limit`` bounds the body (:class:`AnswerRefused`; None: unbounded). Raises the
        ``httpx.TransportError`` httpx would raise for a failure to connect, send or
        read, and RuntimeError once the client is closed. Only a GET is sent again by
        itself when a reused connection turns out closed: another method may have
        reached the server (its caller's retry policy decides).
        """
        connect_s: float | None
        read_s: float | None
        write_s: float | None
        if timeout is not None:
            connect_s = read_s = write_s = timeout
        else:
            t = self._timeout
            connect_s, read_s, write_s = t.connect, t.read, t.write
        target = self._prefix + path
        url = self.url + path
        sent = _Request(method, target, url, headers, body, read_s, write_s, until, limit)
        conn = self._reusable()
        if conn is not None:
            try:
                return self._exchange(conn, sent, stale_is_retry=method == "GET")
            except _Stale:
                pass  # the server closed it while it was idle: once more, on a fresh one
        return self._exchange(self._connect(connect_s, until), sent, stale_is_retry=False)

    @contextlib.contextmanager
    def stream(
        self,
        method: str,
        path: str,
        headers: Mapping[str, str],
        body: bytes | None = None,
        *,
        until: float | None = None,
    ) -> Iterator[LeanStream]:
        """``method path`` with ``headers`` and ``body``, its answer handed over once its
        headers are in, its body read as the caller iterates (:class:`LeanStream`).

        Bounded by the client's timeouts, each read by the read timeout, and by ``until``
        (a ``time.monotonic()`` instant), as :meth:`request` is: connect, send, headers and
        every read of the body end by it (:class:`DeadlineExceeded`), however slowly the
        bytes trickle in. The caller bounds how much it reads. Not sent again by itself:
        it may have reached the server. The connection is kept for another request only
        if the body was read to its end; an encoded body (never asked for:
        ``Accept-Encoding`` is the caller's) is refused as a protocol error. Raises the
        ``httpx.TransportError`` httpx would raise.
        """
        t = self._timeout
        sent = _Request(
            method,
            self._prefix + path,
            self.url + path,
            headers,
            body,
            t.read,
            t.write,
            until,
            None,
        )
        conn = self._reusable() or self._connect(t.connect, until)
        stage = "write"
        try:
            _write_request(conn, sent)
            stage = "read"
            response = _read_head(conn, sent)
            encoding = response.getheader("content-encoding", "identity").strip().lower()
            if encoding not in ("identity", ""):
                raise httpx.RemoteProtocolError(f"an answer encoded {encoding!r}, not asked for")
        except BaseException as exc:
            conn.close()
            mapped = _transport_error(exc, stage)
            if mapped is exc:
                raise
            raise mapped from exc
        answer = LeanStream(response, sent.url)
        try:
            yield answer
        finally:
            if answer.finished and not response.will_close:
                self._give_back(conn, True)
            else:
                conn.close()

    def close(self) -> None:
        """Close the idle connections; those in use are closed when their answer is read."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    # ------------------------------------------------------------------ internals
    def _reusable(self) -> http.client.HTTPConnection | None:
        """An idle connection the server has not closed meanwhile, or None.

        An idle connection's socket has nothing to read until the server closes it, so
        a readable one is dropped (as httpcore does), not found closed by a request.
        """
        while True:
            with self._lock:
                if self._closed:
                    raise RuntimeError("the lean HTTP client has been closed")
                if not self._idle:
                    return None
                conn = self._idle.pop()
            if conn.sock is not None and not _readable(conn.sock):
                return conn
            conn.close()

    def _connect(self, connect_s: float | None, until: float | None) -> http.client.HTTPConnection:
        connect_s = _within(connect_s, until)
        conn: http.client.HTTPConnection
        if self._https:
            conn = _BoundedHTTPSConnection(
                self._host, self._port, timeout=connect_s, context=self._tls()
            )
            conn.until = until
        else:
            conn = http.client.HTTPConnection(self._host, self._port, timeout=connect_s)
        conn._create_connection = _create_connection  # type: ignore[attr-defined]
        try:
            conn.connect()  # http.client sets TCP_NODELAY on the new socket
        except TimeoutError as exc:
            conn.close()
            raise httpx.ConnectTimeout(str(exc) or "timed out") from exc
        except OSError as exc:  # refused, unreachable, DNS, a TLS handshake refused
            conn.close()
            raise httpx.ConnectError(str(exc)) from exc
        except BaseException:  # the deadline passed during the TLS handshake
            conn.close()
            raise
        with self._lock:
            self.connections_opened += 1
        return conn

    def _tls(self) -> ssl.SSLContext:
        """httpx's own context (verification as httpx does it), made once, on first use."""
        with self._lock:
            if self._ssl_context is None:
                context = httpx.create_ssl_context()
                context.set_alpn_protocols(["http/1.1"])  # as httpcore offers it, without h2
                self._ssl_context = context
            return self._ssl_context

    def _exchange(
        self, conn: http.client.HTTPConnection, sent: _Request, *, stale_is_retry: bool
    ) -> LeanResponse:
        """Send ``sent`` on ``conn`` and read its answer whole; ``conn`` is given back or closed."""
        stage = "write"
        try:
            _write_request(conn, sent)
            stage = "read"
            response = _read_head(conn, sent)
            stage = "body"
            pairs = response.getheaders()
            status = response.status
            reply_headers = LeanHeaders(pairs)
            limit = sent.limit(status, reply_headers) if sent.limit is not None else None
            content = _read_body(response, limit, status)
            keep = not response.will_close
        except BaseException as exc:
            conn.close()
            if stale_is_retry and stage != "body" and isinstance(exc, _STALE):
                raise _Stale from exc
            mapped = _transport_error(exc, stage)
            if mapped is exc:
                raise
            raise mapped from exc
        self._give_back(conn, keep)
        encoding = reply_headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("identity", ""):  # not asked for (Accept-Encoding: identity)
            content = _decode(content, encoding, limit, status)
        return LeanResponse(status, reply_headers, content, sent.url)

    def _give_back(self, conn: http.client.HTTPConnection, keep: bool) -> None:
        if keep and conn.sock is not None:
            with self._lock:
                if not self._closed and len(self._idle) < self._max_idle:
                    self._idle.append(conn)
                    return
        conn.close()


def _write_request(conn: http.client.HTTPConnection, sent: _Request) -> None:
    """Send ``sent`` on ``conn``, within its write timeout (and deadline)."""
    sock = conn.sock
    assert sock is not None, "a connected connection"
    write_s = _within(sent.write_s, sent.until)
    if sock.gettimeout() != write_s:
        sock.settimeout(write_s)
    conn.putrequest(sent.method, sent.target)
    for name, value in sent.headers.items():
        conn.putheader(name, value)
    if sent.body is not None:
        conn.putheader("Content-Length", str(len(sent.body)))
    conn.endheaders(sent.body)


def _read_head(conn: http.client.HTTPConnection, sent: _Request) -> http.client.HTTPResponse:
    """The status line and headers of the answer to ``sent``.

    Every read of the answer, from its status line to its last byte, goes through a
    reader that waits no longer than the deadline (see :class:`_Deadline`).
    """
    conn.response_class = functools.partial(  # type: ignore[assignment]
        _BoundedResponse, read_s=sent.read_s, until=sent.until
    )
    return conn.getresponse()


class _Request(NamedTuple):
    """One request as the lean client sends it (``target``: the path on the wire)."""

    method: str
    target: str
    url: str
    headers: Mapping[str, str]
    body: bytes | None
    read_s: float | None
    write_s: float | None
    until: float | None
    limit: BodyLimit | None


def _within(timeout: float | None, until: float | None) -> float | None:
    """``timeout``, shortened to what is left until ``until``; DeadlineExceeded once it passed."""
    if until is None:
        return timeout
    left = until - time.monotonic()
    if left <= 0:
        raise DeadlineExceeded()
    return left if timeout is None or timeout > left else timeout


class _Deadline(io.RawIOBase):
    """A socket's reader (its ``makefile`` raw stream) whose every read ends by ``until``.

    Before each read the socket's timeout is set to the read timeout or to what is left
    of the deadline, whichever is shorter: an answer that trickles in a byte at a time
    still ends at the deadline, however ``http.client`` splits its reads.
    """

    def __init__(
        self, raw: io.RawIOBase, sock: socket.socket, read_s: float | None, until: float | None
    ) -> None:
        super().__init__()
        self._raw = raw
        self._sock = sock
        self._read_s = read_s
        self._until = until

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int | None:
        timeout = _within(self._read_s, self._until)
        capped = self._until is not None and timeout != self._read_s
        if self._sock.gettimeout() != timeout:
            self._sock.settimeout(timeout)
        try:
            return self._raw.readinto(buffer)
        except TimeoutError:
            if capped:
                raise DeadlineExceeded() from None
            raise

    def close(self) -> None:
        if not self.closed:
            self._raw.close()  # the socket's reference count, as http.client expects
        super().close()


class _BoundedResponse(http.client.HTTPResponse):
    """An ``HTTPResponse`` that reads through :class:`_Deadline`."""

    def __init__(
        self,
        sock: socket.socket,
        debuglevel: int = 0,
        method: str | None = None,
        url: str | None = None,
        *,
        read_s: float | None,
        until: float | None,
    ) -> None:
        super().__init__(sock, debuglevel, method, url)
        raw = self.fp.detach()  # nothing read yet: the buffer is empty
        self.fp = io.BufferedReader(_Deadline(raw, sock, read_s, until))


def _read_body(response: http.client.HTTPResponse, limit: Limit | None, status: int) -> bytes:
    """The body, no more of it than ``limit`` allows: AnswerRefused as soon as it has more.

    A ``Content-Length`` over the limit is refused unread; one within it is read at
    once (the deadline still bounds every read). A body of unknown length (chunked,
    or until the connection closes) is read in pieces of at most 64 KiB.
    """
    if limit is None:
        return response.read()
    declared = response.length  # None when chunked or read to the connection's end
    if declared is not None and declared > limit.bytes:
        raise AnswerRefused(
            f"its Content-Length is {declared} bytes, more than the {limit.bytes} bytes {limit.why}",
            status,
        )
    if declared is not None:
        return response.read()  # exactly what it announced, read at once (IncompleteRead if less)
    pieces: list[bytes] = []
    got = 0
    while True:
        # One byte past the limit is enough to know a body is longer than it.
        piece = response.read(min(_CHUNK, limit.bytes + 1 - got))
        if not piece:
            break
        got += len(piece)
        if got > limit.bytes:
            raise AnswerRefused(
                f"its body is longer than the {limit.bytes} bytes {limit.why}", status
            )
        pieces.append(piece)
    return pieces[0] if len(pieces) == 1 else b"".join(pieces)


def _readable(sock: socket.socket) -> bool:
    """Whether ``sock`` has something to read now (or is closed): never so for a live idle one."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))


class _Stale(Exception):
    """A reused connection turned out closed by the server before its answer began."""


def _transport_error(exc: BaseException, stage: str) -> BaseException:
    """The ``httpx.TransportError`` httpx raises for ``exc`` while at ``stage``; else ``exc``.

    Headers over ``http.client``'s bounds are AnswerRefused (httpx raises a protocol
    error for them, which the caller could only retry to the same effect).
    """
    if isinstance(exc, httpx.TransportError | AnswerRefused):
        return exc
    message = str(exc) or type(exc).__name__
    if stage == "read" and isinstance(exc, http.client.LineTooLong):
        return AnswerRefused(f"its status line or headers are too long ({exc})")
    if stage == "read" and isinstance(exc, http.client.HTTPException) and "headers" in message:
        return AnswerRefused(f"it has too many headers ({exc})")
    if isinstance(exc, http.client.RemoteDisconnected):
        return httpx.RemoteProtocolError("Server disconnected without sending a response.")
    if isinstance(exc, http.client.IncompleteRead):
        return httpx.RemoteProtocolError(
            "peer closed connection without sending complete message body "
            f"(received {len(exc.partial)} bytes, expected {exc.expected})"
        )
    if isinstance(exc, http.client.HTTPException):  # a malformed status line, headers or chunk
        return httpx.RemoteProtocolError(message)
    if isinstance(exc, TimeoutError):
        return httpx.WriteTimeout(message) if stage == "write" else httpx.ReadTimeout(message)
    if isinstance(exc, OSError):
        return httpx.WriteError(message) if stage == "write" else httpx.ReadError(message)
    return exc  # not a transport failure (a KeyboardInterrupt, a bug): as it is


def _decode(content: bytes, encoding: str, limit: Limit | None, status: int) -> bytes:
    """A body the server compressed although identity was asked for, decoded as httpx would.

    Decoded to at most one byte past ``limit``: more is AnswerRefused (a small body may
    decode to gigabytes).
    """
    try:
        if encoding in ("gzip", "x-gzip"):
            return _inflate(content, zlib.MAX_WBITS | 16, limit, status)
        if encoding == "deflate":
            try:
                return _inflate(content, zlib.MAX_WBITS, limit, status)
            except zlib.error:
                return _inflate(content, -zlib.MAX_WBITS, limit, status)
    except zlib.error as exc:
        raise httpx.DecodingError(f"the {encoding} body does not decode: {exc}") from exc
    raise httpx.DecodingError(f"the body's Content-Encoding {encoding!r} is not supported")


def _inflate(content: bytes, wbits: int, limit: Limit | None, status: int) -> bytes:
    """``content`` inflated in pieces of at most 64 KiB, refused once it passes ``limit``."""
    inflater = zlib.decompressobj(wbits)
    pieces: list[bytes] = []
    got = 0
    pending = content
    while pending and not inflater.eof:
        piece = inflater.decompress(pending, _CHUNK)
        pending = inflater.unconsumed_tail
        got += len(piece)
        if limit is not None and got > limit.bytes:
            raise AnswerRefused(
                f"its body decodes to more than the {limit.bytes} bytes {limit.why}", status
            )
        pieces.append(piece)
    if not inflater.eof:
        raise zlib.error("incomplete or truncated stream")
    return b"".join(pieces)
