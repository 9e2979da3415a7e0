"""A lean keep-alive HTTP/1.1 client for one origin, on the stdlib's ``http.client``.

Why: a rank fetching its kernels is CPU-bound on a small machine, and httpx spends
about three times the CPU of ``http.client`` on each request (and builds an SSL
context from certifi when its client is made, even for plain http; its first request
in a process imports httpcore, h11 and anyio: 20 ms of a node's cold prefetch in B12).
:class:`LeanClient` is the one client of everything kcache itself sends: any method,
no body, a JSON body or bytes, a whole answer (:meth:`LeanClient.request`) or one read
as it arrives (:meth:`LeanClient.stream`, a bundle), over a small idle-connection pool.

What it keeps the same as httpx, without importing it: the request as httpx would
write it (its target percent-encoded, credentials in the URL as Basic auth, the
environment's proxy: :mod:`kcache_client._lean_request`), TLS verification (the
context httpx's ``create_ssl_context()`` makes, from ``SSL_CERT_FILE``, else
``SSL_CERT_DIR``, else certifi's bundle: :func:`tls_context`, made on the first https
connection only), the timeouts (:class:`~kcache_client._waits.Waits` or an
``httpx.Timeout``: connect while connecting, write while sending, read while reading;
None is none), TCP_NODELAY (``http.client`` sets it on connect), redirects answered as
they are (never followed), and the failures: every transport failure is raised as the
:class:`~kcache_client._lean_errors.TransportError` of the name httpx would raise
(``ConnectError``, ``ConnectTimeout``, ``ReadTimeout``, ``ReadError``, ``WriteError``,
``RemoteProtocolError``), so a caller's retry loop treats both alike.

A forked child starts with no idle connection and a lock of its own: the parent's
connections stay the parent's (a child reading from one of them read the parent's answers,
and the parent the child's).

A keep-alive connection the server closed while it sat idle is dropped before it is
used again when its socket reads as closed (as httpcore does). One that fails anyway
(the request cannot be sent, or the answer ends or resets before it began) is sent
once more on a fresh connection, here, as urllib3 does, if it was a GET; another
method may have reached the server, so its failure goes to the caller's retry policy,
as httpx's would.

What it bounds, for a caller that does not trust the network: an ``until`` (a
``time.monotonic()`` instant) bounds the whole exchange, connect (a proxy's ``CONNECT``
included), send, status line, headers and body, since every socket operation waits at
most until then (each read of the body included, however slowly its bytes trickle in),
and so does a TLS handshake (done without blocking, each wait for the peer bounded by
what is left): past it, :class:`~kcache_client._lean_answer.DeadlineExceeded`. A
``limit`` bounds the body (:mod:`kcache_client._lean_answer` reads it).
"""

from __future__ import annotations

import contextlib
import functools
import http.client
import os
import select
import socket
import ssl
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple
from urllib.parse import urlsplit

from kcache_client._forked import reset_in_child
from kcache_client._lean_answer import (
    BodyLimit,
    BoundedResponse,
    DeadlineExceeded,
    LeanHeaders,
    LeanResponse,
    LeanStream,
    decode,
    read_body,
    transport_error,
    within,
)
from kcache_client._lean_errors import ConnectError, ConnectTimeout, RemoteProtocolError
from kcache_client._lean_request import Route, basic_auth, request_target, route_to
from kcache_client._waits import Timeouts

__all__ = ["MAX_IDLE", "LeanClient", "tls_context"]

#: Idle connections kept for reuse; one per thread that fetches at the same time.
MAX_IDLE = 16


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
        http.client.HTTPConnection.connect(self)  # TCP (TCP_NODELAY), a proxy's tunnel, no TLS yet
        server = self._tunnel_host or self.host  # type: ignore[attr-defined]
        sock = self._context.wrap_socket(  # type: ignore[attr-defined]
            self.sock, server_hostname=server, do_handshake_on_connect=False
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


class LeanClient:
    """Requests to one origin (``http`` or ``https``) over a small pool of keep-alive connections.

    Thread-safe: a thread takes an idle connection, or opens one, and gives it back
    once the answer has been read whole; a connection that failed, or whose answer
    said ``Connection: close``, is dropped. ``url`` may carry a path prefix, which
    every request path is appended to, and credentials (sent as Basic auth, in place
    of any ``Authorization`` header, as httpx sends them). The way to the origin, direct
    or through the environment's proxy, is judged once, here. ``connections_opened``
    counts the connections made, for diagnostics.
    """

    def __init__(self, url: str, timeout: Timeouts, *, max_idle: int = MAX_IDLE) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"the lean client speaks http(s) to a host, not {url!r}")
        self.url = url.rstrip("/")
        self._https = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port or (443 if self._https else 80)
        # What follows the authority (a path prefix, even a query), as httpx joins it.
        self._prefix = self.url.split("://", 1)[1][len(parts.netloc) :]
        self._route: Route | None = None
        self._unroutable = ""
        try:
            self._route = route_to(parts)
        except ValueError as exc:  # each request fails to connect, as httpx's would
            self._unroutable = str(exc)
        self._auth = None if parts.username is None else basic_auth(parts.username, parts.password)
        self._timeout = timeout
        self._max_idle = max_idle
        self._idle: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()
        reset_in_child(self)
        self._ssl_context: ssl.SSLContext | None = None
        self._closed = False
        self.connections_opened = 0

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

        ``path`` may carry a query; it is percent-encoded as httpx would. ``timeout``
        (seconds) overrides the client's four timeouts; ``until`` (a ``time.monotonic()``
        instant) ends the whole exchange (DeadlineExceeded); ``limit`` bounds the body
        (AnswerRefused; None: unbounded). Raises the
        :class:`~kcache_client._lean_errors.TransportError` httpx would raise for a failure
        to connect, send or read, and RuntimeError once the client is closed. Only a GET
        is sent again by itself when a reused connection turns out closed: another method
        may have reached the server (its caller's retry policy decides).
        """
        connect_s: float | None
        read_s: float | None
        write_s: float | None
        if timeout is not None:
            connect_s = read_s = write_s = timeout
        else:
            t = self._timeout
            connect_s, read_s, write_s = t.connect, t.read, t.write
        sent = self._request(method, path, headers, body, read_s, write_s, until, limit)
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
        every read of the body end by it (DeadlineExceeded), however slowly the bytes
        trickle in. The caller bounds how much it reads. Not sent again by itself: it may
        have reached the server. The connection is kept for another request only if the
        body was read to its end; an encoded body (never asked for: ``Accept-Encoding``
        is the caller's) is refused as a protocol error. Raises the
        :class:`~kcache_client._lean_errors.TransportError` httpx would raise.
        """
        t = self._timeout
        sent = self._request(method, path, headers, body, t.read, t.write, until, None)
        conn = self._reusable() or self._connect(t.connect, until)
        stage = "write"
        try:
            _write_request(conn, sent)
            stage = "read"
            response = _read_head(conn, sent)
            encoding = response.getheader("content-encoding", "identity").strip().lower()
            if encoding not in ("identity", ""):
                raise RemoteProtocolError(f"an answer encoded {encoding!r}, not asked for")
        except BaseException as exc:
            conn.close()
            mapped = transport_error(exc, stage)
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

    def _after_fork_in_child(self) -> None:
        """In a forked child: let go of the parent's idle connections (closing only the
        child's copies of their sockets: the parent's stay open), with a lock of its own."""
        self._lock = threading.Lock()  # the parent's may have been held by another thread
        idle, self._idle = self._idle, []
        for conn in idle:
            with contextlib.suppress(OSError):
                conn.close()

    def close(self) -> None:
        """Close the idle connections; those in use are closed when their answer is read."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    # ------------------------------------------------------------------ internals
    def _request(
        self,
        method: str,
        path: str,
        headers: Mapping[str, str],
        body: bytes | None,
        read_s: float | None,
        write_s: float | None,
        until: float | None,
        limit: BodyLimit | None,
    ) -> _Request:
        """The request as it goes on the wire: its target encoded, the route's and URL's headers added."""
        target = request_target(self._prefix + path)
        route = self._route
        if route is not None and route.proxy:
            target = route.absolute + target  # absolute form, to an http:// server's proxy
            if route.absolute and route.proxy_headers:
                headers = {**headers, **dict(route.proxy_headers)}
        if self._auth is not None:
            kept = {k: v for k, v in headers.items() if k.lower() != "authorization"}
            headers = {**kept, "Authorization": self._auth}
        url = self.url + path
        return _Request(method, target, url, headers, body, read_s, write_s, until, limit)

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
        """A new connection to the origin (through its proxy, and its tunnel for https)."""
        route = self._route
        if route is None:
            raise ConnectError(self._unroutable)
        connect_s = within(connect_s, until)
        conn: http.client.HTTPConnection
        if self._https:
            conn = _BoundedHTTPSConnection(
                route.host, route.port, timeout=connect_s, context=self._tls()
            )
            if route.proxy:
                conn.set_tunnel(self._host, self._port, dict(route.proxy_headers))
            conn.until = until
        else:
            conn = http.client.HTTPConnection(route.host, route.port, timeout=connect_s)
        conn._create_connection = _create_connection  # type: ignore[attr-defined]
        # A proxy's answer to CONNECT is read within the connect timeout and the deadline.
        conn.response_class = functools.partial(  # type: ignore[assignment]
            BoundedResponse, read_s=connect_s, until=until
        )
        try:
            conn.connect()  # http.client sets TCP_NODELAY on the new socket
        except TimeoutError as exc:
            conn.close()
            raise ConnectTimeout(str(exc) or "timed out") from exc
        except OSError as exc:  # refused, unreachable, DNS, a TLS handshake or tunnel refused
            conn.close()
            raise ConnectError(str(exc)) from exc
        except BaseException:  # the deadline passed during the TLS handshake
            conn.close()
            raise
        with self._lock:
            self.connections_opened += 1
        return conn

    def _tls(self) -> ssl.SSLContext:
        """The TLS context (:func:`tls_context`), made once, on first use."""
        with self._lock:
            if self._ssl_context is None:
                self._ssl_context = tls_context()
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
            status = response.status
            reply_headers = LeanHeaders(response.getheaders())
            limit = sent.limit(status, reply_headers) if sent.limit is not None else None
            content = read_body(response, limit, status)
            keep = not response.will_close
        except BaseException as exc:
            conn.close()
            if stale_is_retry and stage != "body" and isinstance(exc, _STALE):
                raise _Stale from exc
            mapped = transport_error(exc, stage)
            if mapped is exc:
                raise
            raise mapped from exc
        self._give_back(conn, keep)
        encoding = reply_headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("identity", ""):  # not asked for (Accept-Encoding: identity)
            content = decode(content, encoding, limit, status)
        return LeanResponse(status, reply_headers, content, sent.url)

    def _give_back(self, conn: http.client.HTTPConnection, keep: bool) -> None:
        if keep and conn.sock is not None:
            with self._lock:
                if not self._closed and len(self._idle) < self._max_idle:
                    self._idle.append(conn)
                    return
        conn.close()


def tls_context() -> ssl.SSLContext:
    """A context that verifies servers as httpx's ``create_ssl_context()`` does (httpx 0.29).

    The CAs of ``SSL_CERT_FILE`` when it is set, else those of ``SSL_CERT_DIR`` when it
    is set, else certifi's bundle (certifi comes with httpx); hostnames checked, as
    ``ssl.create_default_context`` does. ALPN offers HTTP/1.1, as httpcore does without h2.
    """
    if os.environ.get("SSL_CERT_FILE"):
        context = ssl.create_default_context(cafile=os.environ["SSL_CERT_FILE"])
    elif os.environ.get("SSL_CERT_DIR"):
        context = ssl.create_default_context(capath=os.environ["SSL_CERT_DIR"])
    else:
        import certifi  # loaded for the first https connection only

        context = ssl.create_default_context(cafile=certifi.where())
    context.set_alpn_protocols(["http/1.1"])
    return context


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


def _write_request(conn: http.client.HTTPConnection, sent: _Request) -> None:
    """Send ``sent`` on ``conn``, within its write timeout (and deadline)."""
    sock = conn.sock
    assert sock is not None, "a connected connection"
    write_s = within(sent.write_s, sent.until)
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
    reader that waits no longer than the deadline (see ``DeadlineReader``).
    """
    conn.response_class = functools.partial(  # type: ignore[assignment]
        BoundedResponse, read_s=sent.read_s, until=sent.until
    )
    return conn.getresponse()


def _readable(sock: socket.socket) -> bool:
    """Whether ``sock`` has something to read now (or is closed): never so for a live idle one."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))


class _Stale(Exception):
    """A reused connection turned out closed by the server before its answer began."""
