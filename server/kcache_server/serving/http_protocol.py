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
:class:`~kcache_server.serving.artifact_fastpath.ArtifactFastPath` answers from memory that machinery
costs more than the answer (a bare ASGI app returning the same bytes reached 0.43 x
nginx here). When the app it serves has that fast path, a ``GET`` whose headers are
complete, with no request of the connection still in flight, is offered to the fast
path's :meth:`~kcache_server.serving.artifact_fastpath.ArtifactFastPath.prepare` right in the parser's
callback; an answer is written at once (the same status, headers and bytes the ASGI
path sends, with uvicorn's ``server`` and ``date`` headers) and recorded by
:meth:`~kcache_server.serving.artifact_fastpath.ArtifactFastPath.finish`.

A ``POST /v1/resolve`` is offered likewise to the
:class:`~kcache_server.serving.resolve_fastpath.ResolveFastPath`: when its headers may be a hit
(:meth:`~kcache_server.serving.resolve_fastpath.ResolveFastPath.admit`: a token the cache
allows, a JSON body of a declared length within the inline limit, no
``Expect: 100-continue``) the protocol reads the body itself and asks
:meth:`~kcache_server.serving.resolve_fastpath.ResolveFastPath.answer`; a hit is audited and
written here, anything else is handed to uvicorn's path whole (the same scope, cycle
and body bytes, as if it had never stopped here), marked so it is not offered twice.

A graceful shutdown while a resolve's body is read here lets it finish, as uvicorn's does
a request in flight: it is answered (or handed on) with ``connection: close``.

Anything else — no answer, pipelined requests, an access log to write, a concurrency
limit — takes uvicorn's path unchanged.

A request answered here has no request cycle: the protocol's ``cycle`` is set back to
None, the state uvicorn's protocol is in before a connection's first request and which
every one of its methods handles (``connection_lost`` included: a stand-in cycle there
lacked the ``message_event`` uvicorn sets, and the traceback cut its cleanup short on
every close of a connection whose last request was answered here). The parser's
callbacks for the rest of such a request (its body, its end) are the protocol's own
and skip uvicorn's, which would look for the cycle.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, TypeVar

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from kcache_server.auth import Principal
from kcache_server.serving.artifact_fastpath import ArtifactFastPath, header_lines
from kcache_server.serving.resolve_fastpath import DECLINED, ResolveFastPath
from kcache_server.serving.resolve_fastpath import ROUTE as RESOLVE_ROUTE

T = TypeVar("T")
_RESOLVE_URL = RESOLVE_ROUTE.encode()

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


def _in_chain(app: Any, kind: type[T]) -> T | None:
    """The middleware of ``kind`` in uvicorn's app chain (under its own middleware), if any."""
    for _ in range(8):
        if isinstance(app, kind):
            return app
        app = getattr(app, "app", None)
        if app is None:
            return None
    return None


class _Gathering:
    """A resolve whose body is being read by the protocol: who asks, since when, the bytes so far."""

    __slots__ = ("body", "principal", "started")

    def __init__(self, principal: Principal, started: float) -> None:
        self.principal = principal
        self.started = started
        self.body = bytearray()


class CoalescingHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol over a :class:`CoalescingTransport`, answering warm fetches."""

    #: The last default headers list seen and its lines (see :meth:`_default_lines`).
    _defaults: tuple[list[tuple[bytes, bytes]], bytes] = ([], b"")

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """uvicorn's, with the transport wrapped."""
        self._coalescing = CoalescingTransport(transport, self.loop)
        super().connection_made(self._coalescing)  # type: ignore[arg-type]
        # Not with an access log to write (asked of the setting: uvicorn's own flag is
        # whether its logger has handlers, which a test harness attaches regardless).
        direct = not self.config.access_log and self.limit_concurrency is None
        self._fast = _in_chain(self.app, ArtifactFastPath) if direct else None
        self._resolve = _in_chain(self.app, ResolveFastPath) if direct else None
        #: The resolve whose body is being read here, if any (see :meth:`on_body`).
        self._gathering: _Gathering | None = None
        #: When the connection last became idle (its last response complete); None while busy.
        self._idle_since: float | None = None
        #: The request being parsed was answered here: the parser's callbacks for its
        #: body and its end are not uvicorn's (there is no cycle for them).
        self._answered_here = False
        #: The server shut down while a resolve's body was read here (see :meth:`shutdown`).
        self._shut_down = False

    def connection_lost(self, exc: Exception | None) -> None:
        """uvicorn's, and the keep-alive timer goes (whatever uvicorn's cleanup did)."""
        try:
            super().connection_lost(exc)
        finally:
            # uvicorn cancels its timer only on a clean close (its own timer is re-armed
            # per response); this one stays armed per connection, so it goes on every
            # close, or the loop keeps the dead protocol until the timer fires.
            if self.timeout_keep_alive_task is not None:
                self.timeout_keep_alive_task.cancel()
                self.timeout_keep_alive_task = None

    def shutdown(self) -> None:
        """uvicorn's, except while a resolve's body is read here: it is answered, then closed.

        uvicorn lets a request in progress finish on a graceful shutdown (its cycle stops
        keeping the connection alive); a resolve gathered here has no cycle yet, and
        uvicorn's own ``shutdown`` would close the connection under it.
        """
        if self._gathering is not None:
            # Answered with ``connection: close``, here or on uvicorn's path.
            self._shut_down = True
            return
        super().shutdown()

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
        """A warm fetch answered here, a resolve's body read here (see the module docstring), else uvicorn's."""
        if (
            (self.cycle is None or self.cycle.response_complete)
            and not self.pipeline
            and not self.parser.should_upgrade()
        ):
            method = self.parser.get_method()
            if method == b"GET" and self._fast is not None and self._answer(self._fast):
                return
            if method == b"POST" and self._resolve is not None and self._gather(self._resolve):
                return
        super().on_headers_complete()

    def _gather(self, resolve: ResolveFastPath) -> bool:
        """Read this resolve's body here if it may be a hit (a known length, no 100-continue)."""
        if self.url != _RESOLVE_URL or self.expect_100_continue:
            return False
        started = time.perf_counter()
        admitted = resolve.admit(self.headers)
        if admitted is None or admitted[1] is None:
            return False  # uvicorn's path (the length is unknown when the body is chunked)
        self._gathering = _Gathering(admitted[0], started)
        return True

    def on_body(self, body: bytes) -> None:
        """A gathered resolve's bytes kept (within the length admitted), else uvicorn's.

        The body of a request answered here (a GET may have one) is dropped, as uvicorn
        drops the body of a request whose response is complete.
        """
        if self._gathering is not None:
            self._gathering.body += body
        elif not self._answered_here:
            super().on_body(body)

    def on_message_complete(self) -> None:
        """A gathered resolve answered if it is a hit, else handed to uvicorn's path whole."""
        gathering = self._gathering
        if gathering is None:
            if self._answered_here:
                self._answered_here = False  # the next request is uvicorn's unless answered
            else:
                super().on_message_complete()
            return
        self._gathering = None
        resolve = self._resolve
        assert resolve is not None  # only gathered with a resolve fast path
        raw = bytes(gathering.body)
        hit = resolve.answer(gathering.principal, raw)
        if hit is None:
            # The request as uvicorn would have had it: the same scope, cycle and body
            # (marked, so the resolve fast path's ASGI side does not try it again).
            self.scope[DECLINED] = True  # type: ignore[literal-required]
            super().on_headers_complete()
            if self._shut_down:
                self.cycle.keep_alive = False  # as uvicorn's shutdown sets it on a cycle in flight
            if raw:
                super().on_body(raw)
            super().on_message_complete()
            return
        resolve.record(hit)  # audited before answering, as the route does
        status, headers, body = resolve.response(hit)
        keep_alive = self._write_answer(status, header_lines(headers), body)
        resolve.count(gathering.started)
        self._answered(keep_alive)

    def _answer(self, fast: ArtifactFastPath) -> bool:
        url = self.url
        if not url.startswith(b"/") or b"?" in url or b"%" in url:
            return False  # a query, an escape or an absolute form: uvicorn parses those
        started = time.perf_counter()
        answer = fast.prepare(url.decode("latin-1"), self.headers)
        if answer is None:
            return False
        keep_alive = self._write_answer(*answer.http_parts())
        self._answered_here = True  # answered from its headers: its body and end come next
        fast.finish(answer, started)
        self._answered(keep_alive)
        return True

    def _write_answer(self, status: int, lines: bytes, body: bytes) -> bool:
        """Write a whole answer made here, after uvicorn's own headers; whether to keep alive.

        There is no request cycle from here on (see the module docstring): the next
        request, a shutdown and a close see none in flight, as before a first request.
        """
        keep_alive = (
            not self._shut_down
            and self.parser.get_http_version() == "1.1"
            and self.parser.should_keep_alive()
        )
        end = b"\r\n" if keep_alive else b"connection: close\r\n\r\n"
        self.cycle = None  # type: ignore[assignment]  # uvicorn's own "no request yet"
        self.transport.write(
            b"".join((STATUS_LINE[status], self._default_lines(), lines, end, body))
        )
        return keep_alive

    def _answered(self, keep_alive: bool) -> None:
        """A response written here is complete: as uvicorn's cycle ends (counts, keep-alive)."""
        if keep_alive:
            self.on_response_complete()
        else:
            self.server_state.total_requests += 1
            self.transport.close()

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
