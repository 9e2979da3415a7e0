"""The server's HTTP protocol writes each response once: CoalescingTransport on real sockets.

The transport under test wraps a real asyncio transport of a real socket pair; the
real transport is subclassed only to count its ``write`` calls. ``kcache serve`` and
every ServerThread of the suite run on this protocol, so the API tests exercise it
end to end; these tests pin what it promises: same bytes, same order, one write per
loop turn, a close that sends what was kept, an abort that drops it.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from kcache_server.serving.http_protocol import CoalescingHttpToolsProtocol, CoalescingTransport

from tests.support import VECTOR_ADD, ServerProcess, ServerThread, upgrade, wait_until


class Counted:
    """A real transport whose writes are counted (everything else is the transport's)."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))
        self.transport.write(data)

    def __getattr__(self, name: str) -> object:
        return getattr(self.transport, name)


def run_pair(
    body: Callable[[CoalescingTransport, Counted, socket.socket], Awaitable[None]],
) -> None:
    """``body(coalescing, counted, peer)`` on a real connected socket pair."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        ours, peer = socket.socketpair()
        peer.setblocking(False)
        transport, _ = await loop.connect_accepted_socket(asyncio.Protocol, ours)
        counted = Counted(transport)
        try:
            await body(CoalescingTransport(counted, loop), counted, peer)  # type: ignore[arg-type]
        finally:
            transport.abort()
            peer.close()

    asyncio.run(main())


async def read_all(peer: socket.socket, until_eof: bool = False, size: int = 0) -> bytes:
    loop = asyncio.get_running_loop()
    data = b""
    while True:
        chunk = await asyncio.wait_for(loop.sock_recv(peer, 65536), 5)
        data += chunk
        if (not chunk and until_eof) or (size and len(data) >= size):
            return data


def test_writes_of_one_turn_leave_as_one_write_in_order() -> None:
    async def body(t: CoalescingTransport, counted: Counted, peer: socket.socket) -> None:
        t.write(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n")
        t.write(bytearray(b"he"))
        t.writelines([memoryview(b"llo")])
        assert counted.writes == []  # nothing yet: the turn is not over
        assert t.get_write_buffer_size() == 43
        await asyncio.sleep(0)
        assert counted.writes == [b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello"]
        assert await read_all(peer, size=43) == counted.writes[0]

    run_pair(body)


def test_writes_of_later_turns_are_written_in_turn() -> None:
    async def body(t: CoalescingTransport, counted: Counted, peer: socket.socket) -> None:
        t.write(b"first ")
        await asyncio.sleep(0)
        t.write(b"second")
        t.write(b"")  # nothing to keep
        await asyncio.sleep(0)
        assert counted.writes == [b"first ", b"second"]
        assert await read_all(peer, size=12) == b"first second"

    run_pair(body)


def test_close_sends_what_was_kept_and_abort_drops_it() -> None:
    async def closing(t: CoalescingTransport, counted: Counted, peer: socket.socket) -> None:
        t.write(b"last words")
        t.close()
        assert await read_all(peer, until_eof=True) == b"last words"
        assert t.is_closing()

    async def aborting(t: CoalescingTransport, counted: Counted, peer: socket.socket) -> None:
        t.write(b"never sent")
        t.abort()
        await asyncio.sleep(0)
        assert counted.writes == []
        assert await read_all(peer, until_eof=True) == b""

    run_pair(closing)
    run_pair(aborting)


def test_kcache_serve_answers_on_it(tmp_path: Path) -> None:
    """The real command (whose uvicorn runs this protocol): a compile, a fetch, a 304, a 404."""
    db_url = f"sqlite:///{tmp_path / 'kcache.db'}"
    upgrade(db_url)
    with (
        ServerProcess(tmp_path / "data", db_url=db_url) as server,
        httpx.Client(base_url=server.url) as c,
    ):
        body = {"recipe": {"source": VECTOR_ADD, "target": "sm_90"}, "compile": True}
        key = c.post("/v1/resolve", json=body, timeout=120).raise_for_status().json()["recipe_key"]
        first = c.get(f"/v1/recipes/{key}/artifact")
        assert first.status_code == 200 and first.content.startswith(b"\x7fELF")
        assert int(first.headers["content-length"]) == len(first.content)
        again = c.get(
            f"/v1/recipes/{key}/artifact", headers={"If-None-Match": first.headers["etag"]}
        )
        assert again.status_code == 304 and again.content == b""
        assert c.get(f"/v1/recipes/{'0' * 64}/artifact").status_code == 404


class _SlowApp:
    """A bare ASGI app: ``/slow`` answers after 1.5 s, anything else at once."""

    async def __call__(self, scope: dict[str, object], receive: object, send: object) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] == "/slow":
            await asyncio.sleep(1.5)
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]}
        )  # type: ignore[operator]
        await send({"type": "http.response.body", "body": b"ok"})  # type: ignore[operator]


def _keep_alive_server(timeout: float) -> tuple[uvicorn.Server, threading.Thread, int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(
        _SlowApp(),
        http=CoalescingHttpToolsProtocol,
        timeout_keep_alive=timeout,  # type: ignore[arg-type]
        lifespan="off",
        log_level="warning",
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_until(lambda: server.started, "the keep-alive test server")
    return server, thread, int(sock.getsockname()[1])


def _exchange(conn: socket.socket, path: str) -> bytes:
    conn.sendall(f"GET {path} HTTP/1.1\r\nHost: t\r\n\r\n".encode())
    data = b""
    while not data.endswith(b"\r\n\r\nok"):
        chunk = conn.recv(4096)
        if not chunk:
            return data
        data += chunk
    return data


def test_keep_alive_closes_idle_connections_only() -> None:
    """One timer per connection: idle past the timeout closes, activity or a slow answer does not."""
    server, thread, port = _keep_alive_server(timeout=1)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
            for _ in range(4):  # requests 0.4 s apart over 1.6 s: never idle for the timeout
                assert _exchange(conn, "/").startswith(b"HTTP/1.1 200")
                time.sleep(0.4)
            # A response taking longer than the timeout: the connection is busy, not idle.
            assert _exchange(conn, "/slow").startswith(b"HTTP/1.1 200")
            assert _exchange(conn, "/").startswith(b"HTTP/1.1 200")
            idle_from = time.monotonic()
            assert conn.recv(1) == b""  # closed by the server once idle for the timeout
            assert time.monotonic() - idle_from >= 0.9
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def _response(conn: socket.socket) -> bytes:
    """One whole response with a ``content-length`` (headers and body) from ``conn``."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        assert chunk, f"closed before the headers: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        body += conn.recv(65536)
    return head


def test_closing_after_an_answer_of_the_protocol_cleans_up_without_a_traceback(
    make_settings: Callable[..., Any], serve: Callable[[Any], ServerThread]
) -> None:
    """uvicorn's connection_lost runs whole (no stand-in cycle it trips on), the timer goes.

    The connection's last request is a warm fetch the protocol answered itself: before,
    uvicorn's cleanup raised on the stand-in cycle (a traceback in the log on every such
    close) and the keep-alive timer cancel after it never ran. ``stop()`` fails on a
    traceback logged while the server ran.
    """
    server = serve(make_settings(auth_cache_s=60.0))  # the fast path answers cached callers only
    with server.client() as c:
        body = {"recipe": {"source": VECTOR_ADD, "target": "sm_90"}, "compile": True}
        key = c.post("/v1/resolve", json=body).raise_for_status().json()["recipe_key"]
    connections = server.server.server_state.connections
    wait_until(lambda: not connections, "the resolve's connection to be closed")
    request = f"GET /v1/recipes/{key}/artifact HTTP/1.1\r\nHost: t\r\n\r\n".encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as conn:
        conn.sendall(request)  # the route: the caches fill
        assert _response(conn).startswith(b"HTTP/1.1 200")
        conn.sendall(request)  # answered by the protocol from memory
        assert _response(conn).startswith(b"HTTP/1.1 200")
        (protocol,) = connections
        assert isinstance(protocol, CoalescingHttpToolsProtocol)
        assert protocol.cycle is None  # the protocol's answer has no request cycle
        assert protocol.timeout_keep_alive_task is not None  # idle: the timer is armed
    # uvicorn's last step of connection_lost drops the parser; the timer is cancelled after.
    wait_until(lambda: protocol.parser is None, "connection_lost to run to its end")
    wait_until(lambda: protocol.timeout_keep_alive_task is None, "the keep-alive timer to go")
    assert not connections
    server.stop()  # raises on any traceback logged while it ran
