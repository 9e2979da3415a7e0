"""uvicorn's HTTP protocol, writing each response to the socket once instead of twice.

uvicorn writes a response's status line and headers when the app sends
``http.response.start`` and its body when it sends ``http.response.body``: two
``write`` calls, two system calls and two TCP segments for every small response.
On loopback and on a fast network each segment costs the receiving stack as much as
the sending one, and for the warm fetch (a few KB of cubin, answered in a few
microseconds of Python) the two writes were the largest cost of a request in a
profile (about 40 % of the server's samples).

:class:`CoalescingTransport` keeps what is written during one turn of the event loop
and hands it to the real transport as one write at the end of that turn (or before a
close), so a response sent in one go leaves in one segment. Nothing else changes: the
bytes and their order are the same, flow control still comes from the real transport,
and a response that streams (waits between its parts) is written part by part as
before. :class:`CoalescingHttpToolsProtocol` is uvicorn's own protocol on that
transport; ``kcache serve`` passes it as uvicorn's ``http`` protocol.

The protocol also answers the warm fetch itself. uvicorn turns every request into an
ASGI task with its own request cycle, scope and messages; for a fetch the
:class:`~kcache_server.fastpath.ArtifactFastPath` answers from memory that machinery
costs more than the answer (a bare ASGI app returning the same bytes reached 0.43 x
nginx here). When the app it serves has that fast path, a ``GET`` whose headers are
complete, with no request of the connection still in flight, is offered to the fast
path's :meth:`~kcache_server.fastpath.ArtifactFastPath.prepare` right in the parser's
callback; an answer is written at once (the same status, headers and bytes the ASGI
path sends, with uvicorn's ``server`` and ``date`` headers) and recorded by
:meth:`~kcache_server.fastpath.ArtifactFastPath.finish`. Anything else — no answer,
pipelined requests, an access log to write, a concurrency limit — takes uvicorn's path
unchanged.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from kcache_server.fastpath import ArtifactFastPath, header_lines

__all__ = ["CoalescingHttpToolsProtocol", "CoalescingTransport"]


class CoalescingTransport:
    """A transport that joins the writes of one event-loop turn into one; see the module docstring.

    Everything but writing and closing is the wrapped transport's own.
    """

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] = []
        #: Set while the protocol handles received data: it flushes when done, so
        #: what is written meanwhile needs no flush of its own scheduled.
        self.held = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Keep ``data`` to be written with the rest of this loop turn's writes."""
        if not data:
            return
        if not self._pending and not self.held:
            self._loop.call_soon(self.flush)
        self._pending.append(bytes(data))

    def writelines(self, lines: Any) -> None:
        """Keep each of ``lines`` (as :meth:`write` does)."""
        for data in lines:
            self.write(data)

    def flush(self) -> None:
        """Hand what was kept to the real transport, as one write (nothing once it is closing)."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        if self._transport.is_closing():
            return  # the real transport would drop it too (and warn)
        self._transport.write(pending[0] if len(pending) == 1 else b"".join(pending))

    def is_closing(self) -> bool:
        """The real transport's (asked after every response: not through ``__getattr__``)."""
        return self._transport.is_closing()

    def get_write_buffer_size(self) -> int:
        """Bytes not yet sent: those kept here and the real transport's buffer."""
        kept = sum(len(data) for data in self._pending)
        return kept + int(self._transport.get_write_buffer_size())

    def close(self) -> None:
        """Write what was kept, then close (the real transport sends its buffer first)."""
        self.flush()
        self._transport.close()

    def write_eof(self) -> None:
        """Write what was kept, then half-close."""
        self.flush()
        self._transport.write_eof()

    def abort(self) -> None:
        """Drop what was kept and abort the connection."""
        self._pending.clear()
        self._transport.abort()

    def __getattr__(self, name: str) -> Any:
        # is_closing, get_extra_info, pause_reading, resume_reading, set_protocol, ...
        return getattr(self._transport, name)


class _Answered:
    """The request cycle of a fetch the protocol answered itself: already complete."""

    response_complete = True


_ANSWERED = _Answered()


def _fast_path_of(app: Any) -> ArtifactFastPath | None:
    """The fetch fast path in uvicorn's app chain (under its own middleware), if any."""
    for _ in range(8):
        if isinstance(app, ArtifactFastPath):
            return app
        app = getattr(app, "app", None)
        if app is None:
            return None
    return None


class CoalescingHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol over a :class:`CoalescingTransport`, answering warm fetches."""

    #: The last default headers list seen and its lines (see :meth:`_default_lines`).
    _defaults: tuple[list[tuple[bytes, bytes]], bytes] = ([], b"")

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """uvicorn's, with the transport wrapped."""
        self._coalescing = CoalescingTransport(transport, self.loop)
        super().connection_made(self._coalescing)  # type: ignore[arg-type]
        direct = not self.access_log and self.limit_concurrency is None
        self._fast = _fast_path_of(self.app) if direct else None
        #: When the connection last became idle (its last response complete); None while busy.
        self._idle_since: float | None = None

    def connection_lost(self, exc: Exception | None) -> None:
        """uvicorn's, and the keep-alive timer goes."""
        super().connection_lost(exc)
        if self.timeout_keep_alive_task is not None:
            self.timeout_keep_alive_task.cancel()
            self.timeout_keep_alive_task = None

    def data_received(self, data: bytes) -> None:
        """uvicorn's, with what its callbacks write sent in one write when it returns."""
        coalescing = self._coalescing
        coalescing.held = True
        try:
            super().data_received(data)
        finally:
            coalescing.held = False
            coalescing.flush()

    # Keep-alive. uvicorn cancels its idle timer whenever data arrives and arms a new
    # one (a timer handle, a heap entry) after every response. Here one timer per
    # connection stays armed and looks, when it fires, at when the connection last
    # became idle: the same closing of connections idle for ``timeout_keep_alive``
    # seconds, without two timer operations per request.

    def _unset_keepalive_if_required(self) -> None:
        self._idle_since = None  # busy: data arrived, or the connection is going

    def on_response_complete(self) -> None:
        """uvicorn's (start a pipelined request, else the connection is idle from now)."""
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        self.flow.resume_reading()
        if self.pipeline:
            self._idle_since = None
            cycle, app = self.pipeline.pop()
            self._start_asgi_task(cycle, app)
            return
        self._idle_since = self.loop.time()
        if self.timeout_keep_alive_task is None:
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self._keep_alive_check
            )

    def _keep_alive_check(self) -> None:
        self.timeout_keep_alive_task = None
        if self._idle_since is None:
            return  # busy: the next response completed arms the timer again
        left = self._idle_since + self.timeout_keep_alive - self.loop.time()
        if left > 0:
            self.timeout_keep_alive_task = self.loop.call_later(left, self._keep_alive_check)
        else:
            self.timeout_keep_alive_handler()

    def on_headers_complete(self) -> None:
        """A warm fetch answered here (see the module docstring), else uvicorn's."""
        fast = self._fast
        if (
            fast is not None
            and (self.cycle is None or self.cycle.response_complete)
            and not self.pipeline
            and self.parser.get_method() == b"GET"
            and not self.parser.should_upgrade()
            and self._answer(fast)
        ):
            return
        super().on_headers_complete()

    def _answer(self, fast: ArtifactFastPath) -> bool:
        url = self.url
        if not url.startswith(b"/") or b"?" in url or b"%" in url:
            return False  # a query, an escape or an absolute form: uvicorn parses those
        started = time.perf_counter()
        answer = fast.prepare(url.decode("latin-1"), self.headers)
        if answer is None:
            return False
        keep_alive = self.parser.get_http_version() == "1.1" and self.parser.should_keep_alive()
        self.cycle = _ANSWERED  # type: ignore[assignment]  # the body callbacks see it complete
        self.transport.write(answer.http_response(self._default_lines(), keep_alive))
        fast.finish(answer, started)
        if keep_alive:
            self.on_response_complete()  # as uvicorn's cycle does: keep-alive timer, counts
        else:
            self.server_state.total_requests += 1
            self.transport.close()
        return True

    def _default_lines(self) -> bytes:
        """uvicorn's own headers (``date``, ``server``) as lines, encoded once per new list.

        uvicorn replaces the list (a new ``date``) once a second; in between every
        answer of the process reuses the encoded lines (the list is held with them, so
        ``is`` cannot be fooled by a reused id).
        """
        defaults = self.server_state.default_headers
        cached = CoalescingHttpToolsProtocol._defaults
        if cached[0] is not defaults:
            cached = CoalescingHttpToolsProtocol._defaults = (defaults, header_lines(defaults))
        return cached[1]
