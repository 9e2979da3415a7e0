"""The server's HTTP protocol writes each response once: CoalescingTransport on real sockets.

The transport under test wraps a real asyncio transport of a real socket pair; the
real transport is subclassed only to count its ``write`` calls. ``kcache serve`` and
every ServerThread of the suite run on this protocol, so the API tests exercise it
end to end; these tests pin what it promises: same bytes, same order, one write per
loop turn, a close that sends what was kept, an abort that drops it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import socket
import subprocess
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from kcache_server.serving.http_protocol import CoalescingHttpToolsProtocol, CoalescingTransport

from tests.support import VECTOR_ADD, ServerProcess, ServerThread, unique, upgrade, wait_until


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
    """The head of one whole response with a ``content-length`` (headers and body) from ``conn``."""
    return _heads(conn, 1)[0]


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


# ------------------------------------------------------------------------------ closing
def _fetch_request(key: str, version: str = "1.1", close: bool = False) -> bytes:
    connection = "Connection: close\r\n" if close else ""
    return f"GET /v1/recipes/{key}/artifact HTTP/{version}\r\nHost: t\r\n{connection}\r\n".encode()


def _resolve_request(body: bytes) -> bytes:
    head = (
        "POST /v1/resolve HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def _warmed(server: ServerThread) -> tuple[bytes, str]:
    """A compiling resolve's body and its key, resolved and fetched once, so that both fast
    paths' caches hold it."""
    resolve = json.dumps(
        {"recipe": {"source": VECTOR_ADD, "target": "sm_90"}, "compile": True}
    ).encode()
    with server.client() as c:
        key = c.post("/v1/resolve", content=resolve).raise_for_status().json()["recipe_key"]
        assert c.get(f"/v1/recipes/{key}/artifact").status_code == 200  # the caches fill
    return resolve, key


def _heads(conn: socket.socket, n: int) -> list[bytes]:
    """The heads of the next ``n`` whole responses (each with a ``content-length``) on ``conn``."""
    data, heads = b"", []
    while len(heads) < n:
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(65536)
            assert chunk, f"closed before the headers: {data!r}"
            data += chunk
        head, _, data = data.partition(b"\r\n\r\n")
        length = next(
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        while len(data) < length:
            chunk = conn.recv(65536)
            assert chunk, "closed within the body"
            data += chunk
        heads.append(head)
        data = data[length:]
    assert not data, f"more than {n} responses: {data!r}"
    return heads


def _closed_by_the_server(conn: socket.socket) -> bool:
    try:
        return conn.recv(1) == b""
    except ConnectionResetError:
        return True


def _close_paths(
    port: int, key: str, resolve_body: bytes, answered: Callable[[socket.socket, int], None]
) -> list[socket.socket]:
    """A connection ended each way there is after answers the protocol writes itself.

    ``answered(conn, n)`` is called once ``conn`` got ``n`` such answers (a check, where
    the caller can see inside the server). Returned, still open: a connection left idle
    after an answer, for the keep-alive timeout or the server's shutdown to close.
    """
    fetch = _fetch_request(key)

    def connect() -> socket.socket:
        return socket.create_connection(("127.0.0.1", port), timeout=30)

    def ok(conn: socket.socket) -> bytes:
        head = _response(conn)
        assert head.startswith(b"HTTP/1.1 200 OK"), head
        return head

    idle = connect()  # opened first: its keep-alive timeout runs during the rest
    idle.sendall(fetch)
    ok(idle)
    answered(idle, 1)
    with connect() as conn:  # the client closes (FIN) after a fetch
        conn.sendall(fetch)
        ok(conn)
        answered(conn, 1)
    conn = connect()  # the client resets the connection (RST) after a fetch
    conn.sendall(fetch)
    ok(conn)
    answered(conn, 1)
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    conn.close()
    with connect() as conn:  # the server closes: the fetch said Connection: close
        conn.sendall(_fetch_request(key, close=True))
        assert ok(conn).lower().endswith(b"\r\nconnection: close")
        answered(conn, 1)
        assert _closed_by_the_server(conn)
    with connect() as conn:  # the server closes: an HTTP/1.0 fetch
        conn.sendall(_fetch_request(key, version="1.0"))
        ok(conn)
        answered(conn, 1)
        assert _closed_by_the_server(conn)
    with connect() as conn:  # two fetches pipelined in one segment, then the client closes
        conn.sendall(fetch + fetch)
        assert [head[:15] for head in _heads(conn, 2)] == [b"HTTP/1.1 200 OK"] * 2
        answered(conn, 2)
    with connect() as conn:  # a resolve hit the protocol answered, then the client closes
        conn.sendall(_resolve_request(resolve_body))
        ok(conn)
        answered(conn, 1)
    with connect() as conn:  # a fetch, then a resolve whose body the client never finishes
        conn.sendall(fetch)
        ok(conn)
        answered(conn, 1)
        conn.sendall(_resolve_request(resolve_body)[:-5])
        time.sleep(0.2)  # read by the server (its body is gathered by the protocol)
    return [idle]


def test_every_close_after_answers_of_the_protocol_is_clean(
    make_settings: Callable[..., Any],
    serve: Callable[[Any], ServerThread],
    monkeypatch: Any,
) -> None:
    """No traceback, no error or warning logged, uvicorn's cleanup run whole, the timer gone.

    Whichever way a connection whose requests the protocol answered itself ends: the client
    closes or resets it, the server closes it (``Connection: close``, HTTP/1.0, the
    keep-alive timeout, its shutdown), after pipelined answers, after a resolve hit, or
    with a resolve's body half read.
    """
    written: list[tuple[Any, Any]] = []  # (protocol, client address) of each answer written here
    write_answer = CoalescingHttpToolsProtocol._write_answer

    def spy(self: CoalescingHttpToolsProtocol, *args: Any) -> bool:
        written.append((self, self.client))
        return write_answer(self, *args)

    monkeypatch.setattr(CoalescingHttpToolsProtocol, "_write_answer", spy)
    server = serve(make_settings(auth_cache_s=600.0))  # the fast paths answer cached callers only
    resolve, key = _warmed(server)
    assert not written  # the route answered those
    server.server.config.timeout_keep_alive = 1  # read by each new connection's protocol

    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    for name in ("", "uvicorn"):  # asyncio's and kcache's loggers propagate to the root
        logging.getLogger(name).addHandler(handler)
    try:

        def answered(conn: socket.socket, n: int) -> None:
            mine = [p for p, client in written if client == conn.getsockname()]
            assert len(mine) == n, f"{n} answers of the protocol expected, {len(mine)} written"

        (idle,) = _close_paths(server.port, key, resolve, answered)
        with idle:
            assert _closed_by_the_server(idle)  # the keep-alive timeout (1 s) closed it
        protocols = {p for p, _ in written}
        connections = server.server.server_state.connections
        wait_until(lambda: not connections & protocols, "the connections to be closed")
        # Each one's connection_lost ran to its end (uvicorn's last step drops the parser),
        # and the keep-alive timer was cancelled after it.
        wait_until(lambda: all(p.parser is None for p in protocols), "connection_lost to end")
        assert all(p.timeout_keep_alive_task is None for p in protocols)

        # One connection left idle after an answer when the server shuts down: it closes it.
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as conn:
            conn.sendall(_fetch_request(key))
            assert _response(conn).startswith(b"HTTP/1.1 200 OK")
            answered(conn, 1)
            server.server.config.timeout_keep_alive = 60
            server.stop()  # raises on any traceback logged while it ran
            assert _closed_by_the_server(conn)
        last = written[-1][0]  # that connection's protocol
        assert last.parser is None and last.timeout_keep_alive_task is None
    finally:
        for name in ("", "uvicorn"):
            logging.getLogger(name).removeHandler(handler)
    mine = [r for r in records if r.threadName == server.thread.name]
    assert not mine, [f"{r.levelname} {r.name}: {r.getMessage()}" for r in mine]


def test_kcache_serve_closes_connections_without_an_error_in_its_log(tmp_path: Path) -> None:
    """The real command, each way a connection ends after the protocol's answers: a clean log.

    ``stop()`` (SIGTERM, with a connection still open) fails on a traceback in the log;
    beyond that no line of it is an error or a warning.
    """
    db_url = f"sqlite:///{tmp_path / 'kcache.db'}"
    upgrade(db_url)
    env = {**os.environ, "KCACHE_AUTH_CACHE_S": "600"}  # the fast paths answer cached callers
    resolve = json.dumps(
        {"recipe": {"source": VECTOR_ADD, "target": "sm_90"}, "compile": True}
    ).encode()
    with ServerProcess(tmp_path / "data", db_url=db_url, env=env) as server:
        with httpx.Client(base_url=server.url) as c:
            r = c.post("/v1/resolve", content=resolve, timeout=120).raise_for_status()
            key = r.json()["recipe_key"]
            assert c.get(f"/v1/recipes/{key}/artifact").status_code == 200  # the caches fill
        (idle,) = _close_paths(server.port, key, resolve, lambda conn, n: None)
        with idle:
            idle_from = time.monotonic()
            assert _closed_by_the_server(idle)  # uvicorn's keep-alive timeout (5 s)
            assert time.monotonic() - idle_from < 30
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as conn:
            conn.sendall(_fetch_request(key))
            assert _response(conn).startswith(b"HTTP/1.1 200 OK")
            server.stop()  # with this connection open and idle; raises on a traceback logged
            assert _closed_by_the_server(conn)
    log = server.log.read_text(errors="replace")
    bad = [line for line in log.splitlines() if line.startswith(("ERROR", "WARNING", "CRITICAL"))]
    assert not bad, log[-3000:]


@pytest.mark.parametrize("hit", [True, False], ids=["hit", "handed-to-uvicorn"])
def test_shutdown_while_the_protocol_reads_a_resolve_body_answers_it_then_closes(
    make_settings: Callable[..., Any], serve: Callable[[Any], ServerThread], hit: bool
) -> None:
    """A graceful shutdown lets a request in progress finish, as uvicorn's own cycle does.

    The protocol reads a resolve's body itself (no uvicorn cycle yet): shut down then, the
    connection is not closed under the request; its answer comes (the protocol's for a hit,
    the route's for a miss, which the protocol hands to uvicorn), with ``connection: close``.
    """
    server = serve(make_settings(auth_cache_s=600.0))  # the fast paths answer cached callers only
    resolve, _ = _warmed(server)
    if not hit:  # a recipe never compiled, not to be compiled: a miss the route answers
        source = f"// {unique()}\n{VECTOR_ADD}"
        resolve = json.dumps({"recipe": {"source": source, "target": "sm_90"}}).encode()
    request = _resolve_request(resolve)
    connections = server.server.server_state.connections
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as conn:
        conn.sendall(request[:-5])  # the headers and most of the body
        wait_until(
            lambda: any(getattr(p, "_gathering", None) is not None for p in connections),
            "the protocol to read the body",
        )
        (protocol,) = [p for p in connections if p.client == conn.getsockname()]
        server.server.should_exit = True  # uvicorn asks each connection to shut down
        time.sleep(0.5)
        conn.sendall(request[-5:])
        (head,) = _heads(conn, 1)
        assert head.startswith(b"HTTP/1.1 200 OK"), head  # a miss is a 200 too (its body says)
        assert head.lower().endswith(b"\r\nconnection: close")
        assert _closed_by_the_server(conn)
    assert (protocol.cycle is None) == hit  # answered by the protocol, or by uvicorn's cycle
    server.stop()


@pytest.mark.slow
def test_uvicorns_own_protocol_tests_pass_on_kcaches_protocol() -> None:
    """uvicorn's tests/protocols/test_http.py (its sdist of the installed version) with kcache's
    protocol in place of uvicorn's: every test that applies passes (scripts/uvicorn-protocol-suite
    names the few that cannot apply, and why). A minute of downloading and of uvicorn's own
    suite: a --slow run's; the tests above cover the protocol by default."""
    script = Path(__file__).resolve().parents[2] / "scripts" / "uvicorn-protocol-suite"
    run = subprocess.run(
        [str(script), "-q"], capture_output=True, text=True, timeout=600, check=False
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    summary = run.stdout.strip().splitlines()[-1]
    passed = re.search(r"(\d+) passed", summary)
    assert passed is not None and int(passed.group(1)) >= 90, summary
    assert not re.search(r"failed|error|skipped", summary), summary
