"""A client that goes away mid-body leaves nothing in the server's log and no harm done.

wrk ending a run, a rank killed while it posts: the server's read of the body ends in
starlette's ClientDisconnect, which used to reach the log as a traceback per request
(found by bench/b13_verification.py). The server stops the test on any traceback.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support import ServerThread


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    from kcache_server import Settings

    data: Path = tmp_path_factory.mktemp("disconnect")
    started = ServerThread(Settings(data_dir=data, compile_workers=1, audit={"flush_s": 0.05}))
    yield started
    started.stop()  # fails on a traceback in the log


@pytest.mark.parametrize("declared", [2_000, 200_000])  # read inline, and on a worker thread
@pytest.mark.parametrize("path", ["/v1/resolve", "/v1/resolve/batch", "/v1/events"])
def test_a_body_cut_short_by_the_client_logs_nothing(
    server: ServerThread, path: str, declared: int
) -> None:
    head = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {declared}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(head + b'{"recipe": {"source": "' + b"x" * 500)
    # The server is as it was: it answers the next request, and its log has no traceback.
    assert httpx.get(server.url + "/healthz").status_code == 200
    server.check_log()
