"""The wire through a caller's own ``httpx.Client``: :class:`HttpxWire`.

A caller that hands kcache an ``httpx.Client`` (``KernelCache(http_client=...)``,
``Transport(client=...)``) wants its hooks, proxies, limits and transport to apply, so
every request of that transport goes through it, as it is, except that redirects are
never followed; it is never closed here (its owner closes it). Nothing else uses httpx:
:class:`~kcache_client._wire.LeanWire` carries every other request, and this module (with
httpx's client machinery) is imported only when a client is injected.

httpx has no deadline over a whole exchange: its timeouts bound each wait for bytes, and
a trickle of bytes resets them. The bound here, with no thread of its own, is this. Each
of httpx's timeouts (connect, write, read, the wait for a pooled connection) is capped
at what was left of the try when it began (``until`` minus then: at most the try's
deadline); the deadline is checked before the request goes, once the answer's status
line and headers are in, and after each piece of its body (whole or streamed), and a
piece comes within one capped read wait. So once its head is in, a try ends by
``until`` plus one capped wait (at most twice the try's deadline in all), and an answer
whose head has come within the deadline and whose body trickles ends by ``until`` plus
one wait. The head itself, which httpx reads whole before handing anything back, is
bounded per wait only: a server that sends it a piece at a time, each within the capped
wait, holds the try until the head is whole (at most httpcore's 100 KiB of head), and the
try then ends at once with DeadlineExceeded. (The lean wire bounds every read by the
deadline itself: its head cannot outlast it.)

A body is read against the limit decided from its status and headers before it is read
(:class:`~kcache_client._lean_answer.AnswerRefused` past it, the answer closed), and
oversized headers (h11's bound) are refused as such. Every failure httpx raises for a
request (its ``RequestError``) is raised as the kcache exception of the same name
(:func:`~kcache_client._lean_errors.from_httpx`), as the lean wire raises it: the
transport catches one family whichever wire failed.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import httpx

from kcache_client._lean_answer import (
    AnswerRefused,
    BodyLimit,
    DeadlineExceeded,
    LeanResponse,
)
from kcache_client._lean_errors import from_httpx

__all__ = ["HttpxWire"]


class HttpxWire:
    """Every request through the injected ``client``; see the module docstring."""

    def __init__(self, url: str, headers: Mapping[str, str], client: httpx.Client) -> None:
        self.url = url
        self._headers = dict(headers)
        self._client = client

    def send(
        self,
        method: str,
        path: str,
        json: Any,
        timeout: float | None,
        until: float,
        limit: BodyLimit,
    ) -> LeanResponse:
        """See :meth:`~kcache_client._wire.Wire.send`; bounded as the module docstring says."""
        base = self._client.timeout if timeout is None else httpx.Timeout(timeout)
        response = self._send(method, path, json, base, until)
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
            for piece in _by_deadline(response.iter_bytes(), until):
                got += len(piece)
                if got > bound.bytes:
                    raise AnswerRefused(
                        f"its body is longer than the {bound.bytes} bytes {bound.why}", status
                    )
                pieces.append(piece)
            return LeanResponse(status, response.headers, b"".join(pieces), str(response.url))
        finally:
            response.close()

    @contextmanager
    def stream(self, method: str, path: str, json: Any, until: float) -> Iterator[_Streamed]:
        """See :meth:`~kcache_client._wire.Wire.stream`; bounded as the module docstring says:
        nothing is read ahead of the caller."""
        response = self._send(method, path, json, self._client.timeout, until)
        try:
            yield _Streamed(response, until)
        finally:
            response.close()

    def close(self) -> None:
        """Nothing to close: the client is its owner's."""

    def _send(
        self, method: str, path: str, json: Any, timeout: httpx.Timeout, until: float
    ) -> httpx.Response:
        """The answer to one request, its head read (by ``until``: DeadlineExceeded), its body not."""
        request = self._client.build_request(
            method,
            self.url + path,
            json=json,
            headers=self._headers,
            timeout=_capped(timeout, until),
        )
        try:
            response = self._client.send(request, stream=True, follow_redirects=False)
        except httpx.RequestError as exc:
            if isinstance(exc, httpx.RemoteProtocolError) and "Receive buffer too long" in str(
                exc
            ):  # h11's bound on the status line and headers
                raise AnswerRefused(f"its status line or headers are too long ({exc})") from exc
            raise from_httpx(exc) from exc
        if time.monotonic() > until:
            response.close()
            raise DeadlineExceeded()
        return response


class _Streamed:
    """A streamed answer through httpx: status, headers, and its body read as it is iterated."""

    def __init__(self, response: httpx.Response, until: float) -> None:
        self._response = response
        self._until = until
        self.status_code = response.status_code
        self.headers = response.headers

    def iter_bytes(self, chunk_size: int | None = None) -> Iterator[bytes]:
        """The body in the pieces httpx reads, each handed over as it arrives (``chunk_size``
        is not honoured: httpx would hold the pieces until it has that many bytes), the
        deadline checked after each (DeadlineExceeded)."""
        return _by_deadline(self._response.iter_bytes(), self._until)


def _by_deadline(pieces: Iterator[bytes], until: float) -> Iterator[bytes]:
    """``pieces``, DeadlineExceeded raised by the first to come after ``until``, a failure
    to read them raised as kcache's exception of its name."""
    try:
        for piece in pieces:
            if time.monotonic() > until:
                raise DeadlineExceeded()
            yield piece
    except httpx.RequestError as exc:
        raise from_httpx(exc) from exc


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
