"""An ``https://`` URL whose server speaks plain HTTP is told as such, on both transports.

Issue 31 item 3: the handshake's ``WRONG_VERSION_NUMBER`` was reported as an
unreachable server, with the advice to start it. A real plain-HTTP listener answers.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest
from kcache_client._http import Transport, tls_advice
from kcache_client._settings import RetryPolicy
from kcache_client.errors import ServerUnavailableError


@pytest.fixture
def plain_http() -> Iterator[int]:
    """A listener that answers anything, a TLS hello included, with an HTTP 400."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                conn.recv(4096)
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield int(listener.getsockname()[1])
    stop.set()
    listener.close()
    thread.join(5)


@pytest.mark.parametrize("lean", [True, False])
def test_https_to_a_plain_http_server_says_use_http(plain_http: int, lean: bool) -> None:
    import httpx

    url = f"https://127.0.0.1:{plain_http}"
    client = None if lean else httpx.Client()
    transport = Transport(url, None, retry=RetryPolicy(attempts=1), client=client)
    try:
        with pytest.raises(ServerUnavailableError) as failed:
            transport.request("GET", "/v1/toolchains")
    finally:
        transport.close()
        if client is not None:
            client.close()
    assert f"use http://127.0.0.1:{plain_http}" in failed.value.cause, failed.value.cause


def test_other_causes_get_no_tls_advice() -> None:
    assert tls_advice("http://h:1", "[SSL: WRONG_VERSION_NUMBER]") is None
    assert tls_advice("https://h:1", "ConnectError: [Errno 111] Connection refused") is None
    assert "SSL_CERT_FILE" in str(
        tls_advice("https://h:1", "ConnectError: [SSL: CERTIFICATE_VERIFY_FAILED] ...")
    )
