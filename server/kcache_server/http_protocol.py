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
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

__all__ = ["CoalescingHttpToolsProtocol", "CoalescingTransport"]


class CoalescingTransport:
    """A transport that joins the writes of one event-loop turn into one; see the module docstring.

    Everything but writing and closing is the wrapped transport's own.
    """

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] = []

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Keep ``data`` to be written with the rest of this loop turn's writes."""
        if not data:
            return
        if not self._pending:
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


class CoalescingHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol over a :class:`CoalescingTransport`."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """uvicorn's, with the transport wrapped."""
        wrapped = CoalescingTransport(transport, self.loop)
        super().connection_made(wrapped)  # type: ignore[arg-type]
