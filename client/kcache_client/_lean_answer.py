"""An answer as the lean client reads it: bounded in time and in size, failures named as httpx's.

:class:`~kcache_client._lean_http.LeanClient` sends a request (the connection, the pool,
the route); this module reads what comes back. Every read of the answer, from its status
line to its last byte, goes through :class:`DeadlineReader`, which waits no longer than
the exchange's deadline (``until``, a ``time.monotonic()`` instant; past it,
:class:`DeadlineExceeded`), however slowly the bytes trickle in. A body is read against
the :class:`Limit` decided from its status and headers before a byte of it is read
(:func:`read_body`; a compressed body is decoded no further than it, :func:`decode`):
past it, :class:`AnswerRefused`. Headers over ``http.client``'s bounds (a 64 KiB line,
100 headers) are AnswerRefused too. Every other failure is raised as the
:class:`~kcache_client._lean_errors.TransportError` of the name httpx would raise
(:func:`transport_error`), so a caller's retry loop treats an answer alike whichever
client read it.
"""

from __future__ import annotations

import contextlib
import http.client
import io
import json as jsonlib
import socket
import time
import zlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

from kcache_client._lean_errors import (
    DecodingError,
    ReadError,
    ReadTimeout,
    RemoteProtocolError,
    TimeoutException,
    TransportError,
    WriteError,
    WriteTimeout,
)

__all__ = [
    "CHUNK",
    "AnswerRefused",
    "BodyLimit",
    "BoundedResponse",
    "DeadlineExceeded",
    "LeanHeaders",
    "LeanResponse",
    "LeanStream",
    "Limit",
    "decode",
    "read_body",
    "transport_error",
    "within",
]

#: The most bytes asked of the socket at once while reading a body.
CHUNK = 64 * 1024


class Limit(NamedTuple):
    """The most bytes a body may have, and why (said when a body has more)."""

    bytes: int
    why: str


#: The limit of an answer's body, decided from its status and headers (it may raise
#: to refuse the answer before its body is read).
BodyLimit = Callable[[int, Mapping[str, str]], Limit]


class DeadlineExceeded(TimeoutException):
    """The exchange was not over (connect, send, headers, the whole body) by its deadline."""

    def __init__(
        self, message: str = "the deadline passed before the answer was read whole"
    ) -> None:
        super().__init__(message)


class AnswerRefused(Exception):
    """An answer broke a bound set for it (its headers, its body); the connection was dropped.

    Not a :class:`~kcache_client._lean_errors.TransportError`: the same server would answer the same, so it is
    not worth a retry. ``status`` is the answer's status when it had one.
    """

    def __init__(self, problem: str, status: int | None = None) -> None:
        super().__init__(problem)
        self.problem = problem
        self.status = status


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
        within the read timeout. A failure to read raises the
        :class:`~kcache_client._lean_errors.TransportError` httpx would raise.
        """
        size = chunk_size or CHUNK
        while True:
            try:
                piece = self._response.read(size)
            except BaseException as exc:
                mapped = transport_error(exc, "body")
                if mapped is exc:
                    raise
                raise mapped from exc
            if not piece:
                self.finished = True
                return
            yield piece


def within(timeout: float | None, until: float | None) -> float | None:
    """``timeout``, shortened to what is left until ``until``; DeadlineExceeded once it passed."""
    if until is None:
        return timeout
    left = until - time.monotonic()
    if left <= 0:
        raise DeadlineExceeded()
    return left if timeout is None or timeout > left else timeout


class DeadlineReader(io.RawIOBase):
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
        timeout = within(self._read_s, self._until)
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


class RawHeaders:
    """An answer's header lines as ``http.client`` hands them out (``get``, ``get_all``,
    ``items``: what ``HTTPResponse`` and its callers ask of its message), without the
    ``email`` package's parser, which cost 80 us an answer (a fetch's whole client side is
    about 1 ms on the benchmark machine). Names keep their case; lookups ignore it."""

    __slots__ = ("_pairs",)

    def __init__(self, pairs: list[tuple[str, str]]) -> None:
        self._pairs = pairs

    def get(self, name: str, default: str | None = None) -> str | None:
        """The first value of ``name``, else ``default``."""
        wanted = name.lower()
        for key, value in self._pairs:
            if key.lower() == wanted:
                return value
        return default

    def get_all(self, name: str, failobj: Any = None) -> list[str] | Any:
        """Every value of ``name``, in order, else ``failobj``."""
        wanted = name.lower()
        found = [value for key, value in self._pairs if key.lower() == wanted]
        return found or failobj

    def items(self) -> list[tuple[str, str]]:
        """The (name, value) pairs, in order."""
        return list(self._pairs)


def read_header_lines(fp: io.BufferedIOBase) -> list[tuple[str, str]]:
    """The header lines up to the blank line, within ``http.client``'s bounds (a line of at
    most ``_MAXLINE`` bytes, at most ``_MAXHEADERS`` lines: ``LineTooLong`` and
    ``HTTPException`` as it raises them), decoded as it decodes them (latin-1, a value's
    leading blanks and its line end dropped; a folded line continues the one before). A
    line that is not ``name: value`` is :class:`AnswerRefused` (the same server would
    send it again)."""
    pairs: list[tuple[str, str]] = []
    while True:
        line = fp.readline(http.client._MAXLINE + 1)  # type: ignore[attr-defined]
        if len(line) > http.client._MAXLINE:  # type: ignore[attr-defined]
            raise http.client.LineTooLong("header line")
        if line in (b"\r\n", b"\n", b""):
            return pairs
        if len(pairs) >= http.client._MAXHEADERS:  # type: ignore[attr-defined]
            raise http.client.HTTPException(
                f"got more than {http.client._MAXHEADERS} headers"  # type: ignore[attr-defined]
            )
        text = line.decode("latin-1").rstrip("\r\n")
        if text[:1] in (" ", "\t") and pairs:  # obsolete folding: the value goes on
            name, value = pairs[-1]
            pairs[-1] = (name, f"{value} {text.strip()}")
            continue
        name, colon, value = text.partition(":")
        if not colon or not name or name != name.strip():
            raise AnswerRefused(f"a header line is not 'name: value': {text[:80]!r}")
        pairs.append((name, value.lstrip(" \t")))


class BoundedResponse(http.client.HTTPResponse):
    """An ``HTTPResponse`` that reads through :class:`DeadlineReader`, its headers with
    :func:`read_header_lines`."""

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
        self.fp = io.BufferedReader(DeadlineReader(raw, sock, read_s, until))

    def begin(self) -> None:
        """``HTTPResponse.begin``, the same steps (status line, interim answers skipped,
        version, chunked, whether the connection closes, the length), its headers read by
        :func:`read_header_lines` instead of the ``email`` parser."""
        if self.headers is not None:
            return
        while True:
            version, status, reason = self._read_status()
            if status != http.client.CONTINUE:
                break
            read_header_lines(self.fp)  # an interim answer's headers, skipped
        self.code = self.status = status
        self.reason = reason.strip()
        if version in ("HTTP/1.0", "HTTP/0.9"):
            self.version = 10
        elif version.startswith("HTTP/1."):
            self.version = 11
        else:
            raise http.client.UnknownProtocol(version)
        headers = RawHeaders(read_header_lines(self.fp))
        self.headers = self.msg = headers
        encoding = headers.get("transfer-encoding")
        self.chunked = bool(encoding) and encoding.lower() == "chunked"
        if self.chunked:
            self.chunk_left = None
        self.will_close = self._check_close()
        self.length = None
        length = headers.get("content-length")
        if length and not self.chunked:
            try:
                self.length = int(length)
            except ValueError:
                self.length = None
            else:
                if self.length < 0:
                    self.length = None
        if status in (http.client.NO_CONTENT, http.client.NOT_MODIFIED) or 100 <= status < 200:
            self.length = 0
        if self._method == "HEAD":
            self.length = 0
        if not self.will_close and not self.chunked and self.length is None:
            self.will_close = True


def read_body(response: http.client.HTTPResponse, limit: Limit | None, status: int) -> bytes:
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
        piece = response.read(min(CHUNK, limit.bytes + 1 - got))
        if not piece:
            break
        got += len(piece)
        if got > limit.bytes:
            raise AnswerRefused(
                f"its body is longer than the {limit.bytes} bytes {limit.why}", status
            )
        pieces.append(piece)
    return pieces[0] if len(pieces) == 1 else b"".join(pieces)


def transport_error(exc: BaseException, stage: str) -> BaseException:
    """The :class:`~kcache_client._lean_errors.TransportError` of the name httpx raises for
    ``exc`` while at ``stage``; else ``exc``.

    Headers over ``http.client``'s bounds are AnswerRefused (httpx raises a protocol
    error for them, which the caller could only retry to the same effect).
    """
    if isinstance(exc, TransportError | AnswerRefused):
        return exc
    message = str(exc) or type(exc).__name__
    if stage == "read" and isinstance(exc, http.client.LineTooLong):
        return AnswerRefused(f"its status line or headers are too long ({exc})")
    if stage == "read" and isinstance(exc, http.client.HTTPException) and "headers" in message:
        return AnswerRefused(f"it has too many headers ({exc})")
    if isinstance(exc, http.client.RemoteDisconnected):
        return RemoteProtocolError("Server disconnected without sending a response.")
    if isinstance(exc, http.client.IncompleteRead):
        return RemoteProtocolError(
            "peer closed connection without sending complete message body "
            f"(received {len(exc.partial)} bytes, expected {exc.expected})"
        )
    if isinstance(exc, http.client.HTTPException):  # a malformed status line, headers or chunk
        return RemoteProtocolError(message)
    if isinstance(exc, TimeoutError):
        return WriteTimeout(message) if stage == "write" else ReadTimeout(message)
    if isinstance(exc, OSError):
        return WriteError(message) if stage == "write" else ReadError(message)
    return exc  # not a transport failure (a KeyboardInterrupt, a bug): as it is


def decode(content: bytes, encoding: str, limit: Limit | None, status: int) -> bytes:
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
        raise DecodingError(f"the {encoding} body does not decode: {exc}") from exc
    raise DecodingError(f"the body's Content-Encoding {encoding!r} is not supported")


def _inflate(content: bytes, wbits: int, limit: Limit | None, status: int) -> bytes:
    """``content`` inflated in pieces of at most 64 KiB, refused once it passes ``limit``."""
    inflater = zlib.decompressobj(wbits)
    pieces: list[bytes] = []
    got = 0
    pending = content
    while pending and not inflater.eof:
        piece = inflater.decompress(pending, CHUNK)
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
