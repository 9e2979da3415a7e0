"""A lean keep-alive HTTP/1.1 client for one origin, on the stdlib's ``http.client``.

Why: a rank fetching its kernels is CPU-bound on a small machine, and httpx spends
about three times the CPU of ``http.client`` on each request (and builds an SSL
context from certifi when its client is made, even for plain http). :class:`LeanClient`
does only what kcache's requests need: one origin, a small idle-connection pool,
whole bodies (a JSON body for a POST).

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
"""

from __future__ import annotations

import contextlib
import http.client
import json as jsonlib
import select
import socket
import ssl
import threading
import zlib
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple
from urllib.parse import urlsplit

import httpx

__all__ = ["LeanClient", "LeanHeaders", "LeanResponse"]

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
    """A whole response: ``status_code``, ``headers``, ``content``, ``text``, ``json()``, ``url``."""

    __slots__ = ("content", "headers", "status_code", "url")

    def __init__(self, status_code: int, headers: LeanHeaders, content: bytes, url: str) -> None:
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
        self, path: str, headers: Mapping[str, str], *, timeout: float | None = None
    ) -> LeanResponse:
        """``GET path`` with ``headers``, read whole (:meth:`request`)."""
        return self.request("GET", path, headers, timeout=timeout)

    def request(
        self,
        method: str,
        path: str,
        headers: Mapping[str, str],
        body: bytes | None = None,
        *,
        timeout: float | None = None,
    ) -> LeanResponse:
        """``method path`` with ``headers`` and ``body``, the answer read whole.

        ``timeout`` (seconds) overrides the client's four timeouts. Raises the ``httpx.TransportError`` httpx would raise for a failure to connect,
        send or read, and RuntimeError once the client is closed. Only a GET is sent
        again by itself when a reused connection turns out closed: another method may
        have reached the server (its caller's retry policy decides).
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
        sent = _Request(method, target, url, headers, body, read_s, write_s)
        conn = self._reusable()
        if conn is not None:
            try:
                return self._exchange(conn, sent, stale_is_retry=method == "GET")
            except _Stale:
                pass  # the server closed it while it was idle: once more, on a fresh one
        return self._exchange(self._connect(connect_s), sent, stale_is_retry=False)

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

    def _connect(self, connect_s: float | None) -> http.client.HTTPConnection:
        conn: http.client.HTTPConnection
        if self._https:
            conn = http.client.HTTPSConnection(
                self._host, self._port, timeout=connect_s, context=self._tls()
            )
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
        sock = conn.sock
        assert sock is not None, "a connected connection"
        stage = "write"
        try:
            if sock.gettimeout() != sent.write_s:
                sock.settimeout(sent.write_s)
            conn.putrequest(sent.method, sent.target)
            for name, value in sent.headers.items():
                conn.putheader(name, value)
            if sent.body is not None:
                conn.putheader("Content-Length", str(len(sent.body)))
            conn.endheaders(sent.body)
            stage = "read"
            if sent.write_s != sent.read_s:
                sock.settimeout(sent.read_s)
            response = conn.getresponse()
            stage = "body"
            content = response.read()
            pairs = response.getheaders()
            status = response.status
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
        reply_headers = LeanHeaders(pairs)
        encoding = reply_headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("identity", ""):  # not asked for (Accept-Encoding: identity)
            content = _decode(content, encoding)
        return LeanResponse(status, reply_headers, content, sent.url)

    def _give_back(self, conn: http.client.HTTPConnection, keep: bool) -> None:
        if keep and conn.sock is not None:
            with self._lock:
                if not self._closed and len(self._idle) < self._max_idle:
                    self._idle.append(conn)
                    return
        conn.close()


class _Request(NamedTuple):
    """One request as the lean client sends it (``target``: the path on the wire)."""

    method: str
    target: str
    url: str
    headers: Mapping[str, str]
    body: bytes | None
    read_s: float | None
    write_s: float | None


def _readable(sock: socket.socket) -> bool:
    """Whether ``sock`` has something to read now (or is closed): never so for a live idle one."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))


class _Stale(Exception):
    """A reused connection turned out closed by the server before its answer began."""


def _transport_error(exc: BaseException, stage: str) -> BaseException:
    """The ``httpx.TransportError`` httpx raises for ``exc`` while at ``stage``; else ``exc``."""
    message = str(exc) or type(exc).__name__
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


def _decode(content: bytes, encoding: str) -> bytes:
    """A body the server compressed although identity was asked for, decoded as httpx would."""
    try:
        if encoding in ("gzip", "x-gzip"):
            return zlib.decompress(content, zlib.MAX_WBITS | 16)
        if encoding == "deflate":
            try:
                return zlib.decompress(content)
            except zlib.error:
                return zlib.decompress(content, -zlib.MAX_WBITS)
    except zlib.error as exc:
        raise httpx.DecodingError(f"the {encoding} body does not decode: {exc}") from exc
    raise httpx.DecodingError(f"the body's Content-Encoding {encoding!r} is not supported")
