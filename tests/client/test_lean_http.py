"""The lean wire of the client's Transport, against real servers on real sockets.

Every request kcache sends goes through ``http.client`` (``_lean_http.LeanClient``);
httpx only carries those of a transport given an ``httpx.Client`` of the caller's.
These tests prove which path a request took from the server's side: ``http.client``
asks for ``Accept-Encoding: identity``, httpx for ``gzip, deflate...``, and a counted
``httpx.Client`` subclass shows whether httpx was used at all. What goes on the wire,
failures and error statuses are compared with what an injected httpx client makes of
the same requests and answers.
"""

from __future__ import annotations

import contextlib
import json
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import httpx
import pytest
from client_harness import KcacheServer, Proxy, Scripted, Seen, json_response, kernels
from kcache_client import (
    AuthenticationError,
    KernelCache,
    RemoteCompileError,
    RemoteNotFoundError,
    RequestRejectedError,
    ResponseRefusedError,
    RetryPolicy,
    ServerBusyError,
    ServerResponseError,
    ServerUnavailableError,
)
from kcache_client._http import Transport
from kcache_client._settings import DEFAULT_TIMEOUT

from tests.support import FAST, QUIET, free_port

PROXY_VARIABLES = ("http_proxy", "https_proxy", "all_proxy", "no_proxy")


def took_lean_path(seen: Seen) -> bool:
    """Whether ``http.client`` sent this request (httpx asks for compressed answers)."""
    return seen.headers.get("accept-encoding") == "identity"


@pytest.fixture(autouse=True)
def no_proxy_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Start each test without proxy variables (httpx and urllib would honour them)."""
    for name in PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)


@pytest.fixture
def built_clients(monkeypatch: pytest.MonkeyPatch) -> list[httpx.Client]:
    """Every ``httpx.Client`` made from here on (real clients, counted as they are made)."""
    made: list[httpx.Client] = []

    class Counted(httpx.Client):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(httpx, "Client", Counted)
    return made


def accepted_connections(server: Scripted) -> list[socket.socket]:
    """The connections ``server`` accepts from now on, kept so a test can cut one."""
    httpd = server._httpd
    accepted: list[socket.socket] = []
    accept = httpd.get_request

    def counting() -> tuple[socket.socket, Any]:
        sock, address = accept()
        accepted.append(sock)
        return sock, address

    httpd.get_request = counting  # type: ignore[method-assign]
    return accepted


class RawServer:
    """A TCP server that answers each request on a connection with ``answer(n)`` raw bytes.

    ``n`` counts requests over all connections. ``answer`` returning None closes the
    connection without a word; ``close_after`` closes it once the bytes are written.
    """

    def __init__(self, answer: Callable[[int], bytes | None], *, close_after: bool = False) -> None:
        self.answer = answer
        self.close_after = close_after
        self.requests = 0
        self.connections = 0
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with contextlib.suppress(ConnectionResetError), conn, conn.makefile("rb") as reader:
            while True:
                head = [reader.readline()]
                while head[-1] not in (b"\r\n", b"\n", b""):
                    head.append(reader.readline())
                if head[-1] == b"":
                    return  # the client closed the connection
                _read_body(reader, head)  # unread, a close would be a reset, not the cut answered
                with self._lock:
                    n = self.requests
                    self.requests += 1
                payload = self.answer(n)
                if payload is None:
                    return
                conn.sendall(payload)
                if self.close_after:
                    return

    def close(self) -> None:
        self._listener.close()


def _read_body(reader: BinaryIO, head: list[bytes]) -> None:
    """Read the body of the request whose header lines are ``head`` (its length, or its chunks).

    A server that closes with a request's bytes still unread makes the kernel reset the
    connection, and the client may then see the reset before the answer it was sent.
    """
    fields = dict(
        (name.strip().lower(), value.strip().lower())
        for name, _, value in (line.decode("latin-1").partition(":") for line in head[1:-1])
    )
    if fields.get("transfer-encoding") == "chunked":
        while True:
            size = int(reader.readline().split(b";")[0], 16)
            reader.read(size + 2)  # the chunk and its CRLF
            if size == 0:
                return
    reader.read(int(fields.get("content-length", "0")))


def chunked(*parts: bytes, headers: str = "") -> bytes:
    """A 200 answer whose body is sent in ``parts`` with chunked framing."""
    body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"
    return (
        f"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n"
        f"Transfer-Encoding: chunked\r\n{headers}\r\n"
    ).encode() + body


# ------------------------------------------------------------------------------ the path taken
def test_a_fetch_only_cache_takes_the_lean_path_and_never_builds_an_httpx_client(
    kserver: KcacheServer, tmp_path: Path, built_clients: list[httpx.Client]
) -> None:
    (recipe,) = kernels(1, "lean", target="sm_80")
    with KernelCache(kserver.url, cache_dir=tmp_path / "seed", settings=QUIET) as seed:
        assert seed.get(recipe).origin == "compiled"  # the server holds it now
    proxy = Proxy(kserver.url)  # counts what reaches the server (with a client of its own)
    made_before = len(built_clients)
    try:
        with KernelCache(proxy.url, cache_dir=tmp_path / "rank", settings=QUIET) as cache:
            art = cache.get(recipe)
            assert art.origin == "server" and art.path.read_bytes() == art.data
        artifact_gets = [s for s in proxy.seen if s.path.endswith("/artifact")]
        assert len(artifact_gets) == 1 and took_lean_path(artifact_gets[0])
        assert all(s.method == "GET" and took_lean_path(s) for s in proxy.seen)
        assert len(built_clients) == made_before  # neither at construction nor on the fetch
    finally:
        proxy.close()


def test_posts_take_the_lean_path_with_the_bytes_httpx_would_send(
    built_clients: list[httpx.Client],
) -> None:
    """A JSON body (non-ASCII text included), an empty POST; no httpx client is made."""
    server = Scripted(lambda s: json_response(200, {"path": s.path}))
    body = {"events": [{"kernel": "scale_\u00e9", "n": 1.5, "ok": True, "none": None}]}
    try:
        seen: dict[str, list[tuple[str, bytes, str | None, str | None]]] = {}
        for name, transport in _both_paths(server.url, retry=FAST):
            before = len(server.seen)
            assert transport.request("POST", "/v1/events", json=body).json() == {
                "path": "/v1/events"
            }
            transport.request("POST", "/v1/cache/clear")  # no json: no body
            sent = server.seen[before:]
            assert all(took_lean_path(s) == (name == "lean") for s in sent)
            seen[name] = [
                (s.method, s.body, s.headers.get("content-type"), s.headers.get("content-length"))
                for s in sent
            ]
        assert seen["lean"] == seen["httpx"]
        assert (
            seen["lean"][0][1]
            == json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
        )
        assert seen["lean"][1][1:] == (b"", None, "0")
        assert len(built_clients) == 1  # only _both_paths' own injected client
        with pytest.raises(ValueError):  # NaN is not JSON: refused before anything is sent
            Transport(server.url, retry=FAST).request("POST", "/v1/events", json=float("nan"))
    finally:
        server.close()


#: Targets httpx would percent-encode or normalise, and one it sends as it is.
ODD_TARGETS = [
    "/v1/pins?key=k",
    "/v1/foreign/a b/caf\u00e9",
    "/v1/x/%41%zz/{y}|`^",
    "/v1/a/./b/../c",
    '/v1/q?a=1 2&b=<">&c=\u00e9/?#fragment',
]


def test_every_method_and_target_takes_the_lean_path_as_httpx_would_send_it(
    built_clients: list[httpx.Client],
) -> None:
    """Methods other than GET and POST, a GET with a body, targets httpx would encode:
    the same request line and body as through httpx, and no httpx client is ever made."""
    server = Scripted(lambda s: json_response(200, {"path": s.path}))
    try:
        sent: dict[str, list[tuple[str, str, bytes, str | None, str | None]]] = {}
        for name, transport in _both_paths(server.url, retry=FAST):
            before = len(server.seen)
            for path in ODD_TARGETS:
                transport.request("DELETE", path)
            transport.request("PUT", "/v1/pins/k", json={"pinned": True})
            transport.request("PUT", "/v1/pins/k")
            transport.request("GET", "/v1/toolchains", json={"with": "a body"})
            seen = server.seen[before:]
            assert all(took_lean_path(s) == (name == "lean") for s in seen)
            sent[name] = [
                (
                    s.method,
                    s.path,
                    s.body,
                    s.headers.get("content-type"),
                    s.headers.get("content-length"),
                )
                for s in seen
            ]
        assert sent["lean"] == sent["httpx"]
        assert sent["lean"][1][1] == "/v1/foreign/a%20b/caf%C3%A9"
        assert sent["lean"][3][1] == "/v1/a/c"
        assert len(built_clients) == 1  # only _both_paths' own injected client
    finally:
        server.close()


def test_credentials_in_the_url_are_sent_as_basic_auth_as_httpx_sends_them() -> None:
    server = Scripted(lambda s: json_response(200, {"ok": True}))
    try:
        url = server.url.replace("://", "://us%40r:p%3Ass@")
        sent = {}
        for name, transport in _both_paths(url, retry=FAST):
            transport.request("GET", "/v1/toolchains")
            sent[name] = server.seen[-1].headers.get("authorization")
        assert sent == {"lean": "Basic dXNAcjpwOnNz", "httpx": "Basic dXNAcjpwOnNz"}  # us@r:p:ss
    finally:
        server.close()


def test_threads_share_one_lean_pool_and_closing_the_transport_closes_it() -> None:
    server = Scripted(lambda s: json_response(200, {"path": s.path}))
    accepted = accepted_connections(server)
    try:
        transport = Transport(server.url, retry=FAST)
        barrier = threading.Barrier(6)

        def delete() -> None:
            barrier.wait()
            transport.request("DELETE", "/v1/pins?key=k")

        threads = [threading.Thread(target=delete) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        deletes = [s for s in server.seen if s.method == "DELETE"]
        assert len(deletes) == 6 and all(took_lean_path(s) for s in deletes)
        assert 1 <= len(accepted) <= 6
        transport.close()
        with pytest.raises(RuntimeError):
            transport.request("GET", "/v1/toolchains")
    finally:
        server.close()


def test_an_injected_client_is_used_for_every_request() -> None:
    server = Scripted(lambda s: json_response(200, {"ok": True}))
    sent: list[httpx.Request] = []
    client = httpx.Client(event_hooks={"request": [sent.append]})
    try:
        transport = Transport(server.url, retry=FAST, client=client)
        transport.request("GET", "/v1/recipes/k/artifact")
        transport.request("POST", "/v1/resolve", json={})
        assert [(r.method, r.url.path) for r in sent] == [
            ("GET", "/v1/recipes/k/artifact"),
            ("POST", "/v1/resolve"),
        ]
        assert not any(took_lean_path(s) for s in server.seen)
        transport.close()
        assert not client.is_closed  # its owner closes it
    finally:
        client.close()
        server.close()


def test_an_environment_proxy_gets_the_lean_requests_in_absolute_form_and_no_proxy_lifts_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    target = Scripted(lambda s: json_response(200, {"from": "target"}))
    proxy = Scripted(lambda s: json_response(200, {"from": "proxy"}))
    try:
        # Without a scheme, as httpx reads it: http://; with credentials, sent to the proxy.
        monkeypatch.setenv("HTTP_PROXY", "us%40r:p%3Ass@" + proxy.url.removeprefix("http://"))
        proxied = Transport(target.url, "s3cret", retry=FAST)
        assert proxied.request("GET", "/v1/toolchains").json() == {"from": "proxy"}
        proxied.request("POST", "/v1/events", json={"events": []})
        get, post = proxy.seen
        assert get.path == f"{target.url}/v1/toolchains"  # absolute form: a proxy request
        assert post.path == f"{target.url}/v1/events" and post.json() == {"events": []}
        assert get.headers["host"] == target.url.removeprefix("http://")
        assert get.headers["proxy-authorization"] == "Basic dXNAcjpwOnNz"  # us@r:p:ss
        assert get.headers["authorization"] == "Bearer s3cret"
        assert took_lean_path(get) and target.seen == []
        proxied.close()

        monkeypatch.setenv("NO_PROXY", "127.0.0.1")
        direct = Transport(target.url, retry=FAST)
        assert direct.request("GET", "/v1/toolchains").json() == {"from": "target"}
        assert len(proxy.seen) == 2 and took_lean_path(target.seen[0])
        direct.close()

        monkeypatch.delenv("NO_PROXY")
        monkeypatch.setenv("HTTP_PROXY", "socks5://127.0.0.1:1")
        with pytest.raises(ServerUnavailableError, match="not one kcache speaks to"):
            Transport(target.url, retry=FAST).request("GET", "/v1/toolchains")
    finally:
        target.close()
        proxy.close()


def test_the_way_out_is_picked_once_when_the_transport_is_made(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A proxy variable set after a transport was made does not send its requests to the proxy."""
    target = Scripted(lambda s: json_response(200, {"from": "target"}))
    proxy = Scripted(lambda s: json_response(200, {"from": "proxy"}))
    try:
        direct = Transport(target.url, retry=FAST)
        monkeypatch.setenv("HTTP_PROXY", proxy.url)
        proxied = Transport(target.url, retry=FAST)
        assert direct.request("GET", "/v1/toolchains").json() == {"from": "target"}
        assert proxied.request("GET", "/v1/toolchains").json() == {"from": "proxy"}
        assert [s.path for s in target.seen] == ["/v1/toolchains"]
        assert [s.path for s in proxy.seen] == [f"{target.url}/v1/toolchains"]
        direct.close()
        proxied.close()
    finally:
        target.close()
        proxy.close()


# ------------------------------------------------------------------------------ connections
def test_keep_alive_reuses_one_connection_over_many_gets() -> None:
    server = Scripted(lambda s: json_response(200, {"path": s.path}))
    accepted = accepted_connections(server)
    try:
        transport = Transport(server.url, retry=FAST)
        for i in range(40):
            assert transport.request("GET", f"/v1/blobs/{i}").json() == {"path": f"/v1/blobs/{i}"}
        assert len(accepted) == 1
        assert server.count("GET") == 40 and transport.requests == 40
        assert all(took_lean_path(s) for s in server.seen)
    finally:
        server.close()


FIRST_GET = """
import sys
from kcache_client._http import Transport
body = Transport(sys.argv[1]).request("GET", "/v1/blobs/1").json()
print(body["path"], "encodings.idna" in sys.modules)
"""


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_a_first_get_by_an_ascii_host_name_does_not_load_the_idna_codec(host: str) -> None:
    """The codec's import was about 1 ms of every rank's first fetch; names still resolve."""
    server = Scripted(lambda s: json_response(200, {"path": s.path}))
    try:
        url = server.url.replace("127.0.0.1", host)
        out = subprocess.run(
            [sys.executable, "-c", FIRST_GET, url], capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == ["/v1/blobs/1", "False"]
    finally:
        server.close()


def test_a_keep_alive_connection_the_server_closed_while_idle_is_replaced_quietly() -> None:
    server = Scripted(lambda s: json_response(200, {"path": s.path}))
    accepted = accepted_connections(server)
    try:
        transport = Transport(server.url, retry=RetryPolicy(attempts=1))  # no retry loop to hide in
        transport.request("GET", "/first")
        for _ in range(2):  # the same thing twice: the replacement is pooled in turn
            accepted[-1].shutdown(socket.SHUT_RDWR)  # the server ends the idle connection
            transport.request("GET", "/again")
        assert len(accepted) == 3
        assert transport.requests == 3  # each GET counted once
        assert [s.path for s in server.seen] == ["/first", "/again", "/again"]
    finally:
        server.close()


def test_a_reused_connection_closed_unanswered_sends_a_get_again_but_not_a_post() -> None:
    """The server closes a kept connection as the request arrives (after the idle check).

    A GET cannot have done anything: it goes again on a fresh connection, unseen by the
    retry policy. A POST may have: its failure goes to the policy (here: no retries).
    """
    ok = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
    for method, again in (("GET", True), ("POST", False)):
        server = RawServer(lambda n: None if n == 1 else ok)  # the 2nd request: closed unanswered
        try:
            transport = Transport(server.url, retry=RetryPolicy(attempts=1))
            assert transport.request(method, "/v1/first").json() == {}
            if again:
                assert transport.request(method, "/v1/second").json() == {}
                assert (server.requests, server.connections) == (3, 2)
            else:
                with pytest.raises(ServerUnavailableError) as info:
                    transport.request(method, "/v1/second")
                assert info.value.cause.startswith("RemoteProtocolError")
                assert (server.requests, server.connections) == (2, 1)
            assert transport.requests == 2
        finally:
            server.close()


def test_a_response_with_connection_close_is_not_reused() -> None:
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok"
    server = RawServer(lambda n: answer, close_after=True)
    try:
        transport = Transport(server.url, retry=RetryPolicy(attempts=1))
        for _ in range(3):
            assert transport.request("GET", "/x").content == b"ok"
        assert server.connections == 3 and server.requests == 3
    finally:
        server.close()


def test_chunked_answers_are_read_whole_and_the_connection_kept() -> None:
    parts = [b"a" * 10, b"b" * 70_000, b"", b"c" * 3]
    server = RawServer(lambda n: chunked(*[p for p in parts if p], headers="X-Part: 1\r\n"))
    try:
        transport = Transport(server.url, retry=FAST)
        for _ in range(3):
            reply = transport.request("GET", "/v1/blobs/x")
            assert reply.content == b"".join(parts)
            assert reply.headers.get("x-part") == "1" and reply.headers.get("X-PART") == "1"
        assert server.connections == 1
    finally:
        server.close()


def test_threads_fetching_through_one_transport_each_get_their_own_bodies() -> None:
    def route(seen: Seen) -> tuple[int, dict[str, str], bytes]:
        n = int(seen.path.rsplit("/", 1)[1])
        return 200, {"X-Path": seen.path}, seen.path.encode() * (1 + n * 997 % 20_000)

    server = Scripted(route)
    accepted = accepted_connections(server)
    transport = Transport(server.url, retry=FAST)
    wrong: list[str] = []
    barrier = threading.Barrier(8)

    def fetch(thread: int) -> None:
        barrier.wait()
        for i in range(30):
            n = thread * 1000 + i
            path = f"/v1/blobs/{n}"
            reply = transport.request("GET", path)
            if reply.content != path.encode() * (1 + n * 997 % 20_000) or (
                reply.headers.get("x-path") != path
            ):
                wrong.append(path)

    try:
        threads = [threading.Thread(target=fetch, args=(t,)) for t in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert wrong == []
        assert server.count("GET") == 240 and transport.requests == 240
        assert 1 <= len(accepted) <= 8  # pooled: at most one connection per thread
        assert all(took_lean_path(s) for s in server.seen)
    finally:
        transport.close()
        server.close()


# ------------------------------------------------------------------------------ failures
def _both_paths(url: str, **kwargs: Any) -> Iterator[tuple[str, Transport]]:
    """The same request through the lean path and through httpx (an injected client)."""
    yield "lean", Transport(url, **kwargs)
    client = httpx.Client(timeout=kwargs.get("timeout") or DEFAULT_TIMEOUT)
    try:
        yield "httpx", Transport(url, client=client, **kwargs)
    finally:
        client.close()


def _failure(transport: Transport, path: str = "/v1/recipes/k/artifact") -> Exception:
    with pytest.raises(Exception) as info:
        transport.request("GET", path)
    return info.value


def test_connection_refused_is_server_unavailable_after_the_retries_on_both_paths() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    causes = {}
    for name, transport in _both_paths(url, retry=FAST):
        error = _failure(transport)
        assert isinstance(error, ServerUnavailableError) and error.url == url
        assert transport.requests == FAST.attempts
        causes[name] = error.cause
    assert causes["lean"] == causes["httpx"] and causes["lean"].startswith("ConnectError")


def test_a_server_dying_mid_body_is_server_unavailable_after_the_retries_on_both_paths() -> None:
    truncated = b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n" + b"x" * 10
    for kind, answer in (
        ("length", truncated),
        ("chunked", chunked(b"y" * 50)[:-12]),  # the last chunk and its end never come
        ("nothing", None),  # the connection closed before a status line
    ):
        server = RawServer(lambda n, a=answer: a, close_after=True)  # type: ignore[misc]
        try:
            causes = {}
            for name, transport in _both_paths(server.url, retry=FAST):
                error = _failure(transport)
                assert isinstance(error, ServerUnavailableError), (kind, name)
                assert transport.requests == FAST.attempts, (kind, name)
                causes[name] = error.cause.split(":")[0]
            assert causes == {"lean": "RemoteProtocolError", "httpx": "RemoteProtocolError"}, kind
        finally:
            server.close()


def test_a_server_that_never_answers_is_a_read_timeout_on_both_paths() -> None:
    release = threading.Event()
    server = RawServer(lambda n: b"" if release.wait(10) else None)
    try:
        once = RetryPolicy(attempts=1)
        for name, transport in _both_paths(
            server.url, retry=once, timeout=httpx.Timeout(0.3, connect=5.0)
        ):
            error = _failure(transport)
            assert isinstance(error, ServerUnavailableError), name
            assert error.cause.startswith("ReadTimeout"), (name, error.cause)
    finally:
        release.set()
        server.close()


ERROR_ANSWERS: dict[str, tuple[int, dict[str, str], bytes]] = {
    "404": json_response(404, {"error": "not_found", "detail": "no such recipe"}),
    "401": json_response(401, {"error": "unauthorized", "detail": ""}),
    "403": json_response(403, {"error": "forbidden", "detail": "scope read only"}),
    "422 compile": json_response(
        422, {"error": "compile_error", "detail": "1 error", "log": "k.cu(1): x", "recipe_key": "k"}
    ),
    "413": json_response(413, {"error": "too_large", "detail": {"limit": 1}}),
    "500 text": (
        500,
        {"Content-Type": "text/plain; charset=latin-1"},
        "caf\xe9 down".encode("latin-1"),
    ),
    "503 retry-after": json_response(503, {"error": "busy"}, **{"Retry-After": "0"}),
    "429 no retry-after": json_response(429, {"error": "slow_down"}),
}
ERROR_TYPES = {
    "404": RemoteNotFoundError,
    "401": AuthenticationError,
    "403": AuthenticationError,
    "422 compile": RemoteCompileError,
    "413": RequestRejectedError,
    "500 text": ServerResponseError,
    "503 retry-after": ServerBusyError,
    "429 no retry-after": ServerBusyError,
}


@pytest.mark.parametrize("case", list(ERROR_ANSWERS))
def test_error_statuses_map_to_the_same_typed_errors_on_both_paths(case: str) -> None:
    server = Scripted(lambda s: ERROR_ANSWERS[case])
    try:
        seen: dict[str, tuple[type, str, dict[str, Any], int]] = {}
        for name, transport in _both_paths(server.url, retry=FAST):
            before = len(server.seen)
            error = _failure(transport)
            fields = {k: v for k, v in vars(error).items() if not k.startswith("_")}
            seen[name] = (type(error), str(error), fields, transport.requests)
            assert all(took_lean_path(s) == (name == "lean") for s in server.seen[before:])
        assert seen["lean"] == seen["httpx"]
        assert seen["lean"][0] is ERROR_TYPES[case]
        retried = issubclass(seen["lean"][0], ServerBusyError)
        assert seen["lean"][3] == (FAST.attempts if retried else 1)
    finally:
        server.close()


def test_the_404_of_a_fetch_is_a_miss_and_carries_its_url() -> None:
    server = Scripted(lambda s: json_response(404, {"error": "not_found", "detail": "gone"}))
    try:
        error = _failure(Transport(server.url + "/", retry=FAST), "/v1/blobs/abc")
        assert isinstance(error, RemoteNotFoundError)
        assert (error.url, error.status, error.code, error.detail) == (
            f"{server.url}/v1/blobs/abc",
            404,
            "not_found",
            "gone",
        )
    finally:
        server.close()


# ------------------------------------------------------------------------------ https
@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A throwaway CA and a certificate for 127.0.0.1 it signed (made by the openssl CLI)."""
    d = tmp_path_factory.mktemp("tls")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]

    def openssl(*args: str) -> None:
        try:
            subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)
        except (FileNotFoundError, subprocess.CalledProcessError) as exc:
            pytest.skip(f"openssl cannot make test certificates here: {exc}")

    openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
            "-subj", "/CN=kcache test CA",
            "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign")  # fmt: skip
    openssl("req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1")
    (d / "ext.cnf").write_text(
        "subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\n"
        "extendedKeyUsage=serverAuth\nauthorityKeyIdentifier=keyid,issuer\n"
    )
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", "server.pem", "-days", "2", "-extfile", "ext.cnf")  # fmt: skip
    return {"ca": d / "ca.pem", "cert": d / "server.pem", "key": d / "server.key"}


class TlsScripted(Scripted):
    """A :class:`Scripted` server that speaks TLS with ``cert``."""

    def __init__(
        self, route: Callable[[Seen], tuple[int, dict[str, str], bytes]], cert: Path, key: Path
    ) -> None:
        super().__init__(route)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
        httpd = self._httpd
        plain_accept = httpd.get_request

        def accept() -> tuple[socket.socket, Any]:
            sock, address = plain_accept()
            return context.wrap_socket(sock, server_side=True), address

        httpd.get_request = accept  # type: ignore[method-assign]
        self.url = f"https://127.0.0.1:{self.port}"


def test_https_gets_take_the_lean_path_and_verify_certificates_as_httpx_does(
    tls_files: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    server = TlsScripted(
        lambda s: json_response(200, {"tls": True}), tls_files["cert"], tls_files["key"]
    )
    try:
        # Unknown CA (httpx's default trust is certifi's): both paths refuse it alike.
        causes = {}
        for name, transport in _both_paths(server.url, retry=RetryPolicy(attempts=1)):
            error = _failure(transport, "/v1/toolchains")
            assert isinstance(error, ServerUnavailableError), name
            causes[name] = error.cause
        assert (
            causes["lean"].startswith("ConnectError")
            and "CERTIFICATE_VERIFY_FAILED" in causes["lean"]
        )
        assert (
            causes["httpx"].startswith("ConnectError")
            and "CERTIFICATE_VERIFY_FAILED" in causes["httpx"]
        )
        # Trusting the CA the way httpx is told to (SSL_CERT_FILE): the lean GET succeeds.
        monkeypatch.setenv("SSL_CERT_FILE", str(tls_files["ca"]))
        transport = Transport(server.url, retry=RetryPolicy(attempts=1))
        for _ in range(3):
            assert transport.request("GET", "/v1/toolchains").json() == {"tls": True}
        assert all(took_lean_path(s) for s in server.seen)
        transport.close()
    finally:
        server.close()


class TunnelProxy:
    """An HTTP proxy that answers ``CONNECT host:port`` and then relays bytes both ways.

    ``heads`` are the CONNECT requests' head lines (first line, then headers) it saw.
    """

    def __init__(self) -> None:
        self.heads: list[list[str]] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._tunnel, args=(conn,), daemon=True).start()

    def _tunnel(self, conn: socket.socket) -> None:
        with conn, conn.makefile("rb") as reader:
            head = [reader.readline().decode("latin-1").strip()]
            while head[-1]:
                head.append(reader.readline().decode("latin-1").strip())
            self.heads.append(head[:-1])
            host, _, port = head[0].split(" ")[1].rpartition(":")
            with socket.create_connection((host, int(port))) as upstream:
                conn.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
                threading.Thread(target=_relay, args=(upstream, conn), daemon=True).start()
                _relay(conn, upstream)

    def close(self) -> None:
        self._listener.close()


def _relay(source: socket.socket, sink: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := source.recv(65536):
            sink.sendall(data)
    with contextlib.suppress(OSError):
        sink.shutdown(socket.SHUT_WR)


def test_https_through_an_environment_proxy_goes_in_a_connect_tunnel_verified_end_to_end(
    tls_files: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    server = TlsScripted(
        lambda s: json_response(200, {"tls": True}), tls_files["cert"], tls_files["key"]
    )
    proxy = TunnelProxy()
    try:
        monkeypatch.setenv("SSL_CERT_FILE", str(tls_files["ca"]))
        monkeypatch.setenv("HTTPS_PROXY", proxy.url.replace("://", "://kc:pw@"))
        transport = Transport(server.url, "s3cret", retry=RetryPolicy(attempts=1))
        for _ in range(3):  # one tunnel, kept alive
            assert transport.request("GET", "/v1/toolchains").json() == {"tls": True}
        transport.close()
        host = server.url.removeprefix("https://")
        assert [h[0] for h in proxy.heads] == [f"CONNECT {host} HTTP/1.0"]
        assert "Proxy-Authorization: Basic a2M6cHc=" in proxy.heads[0]  # kc:pw
        assert [s.path for s in server.seen] == ["/v1/toolchains"] * 3  # origin form, inside
        assert all(took_lean_path(s) for s in server.seen)
        assert server.seen[0].headers["authorization"] == "Bearer s3cret"
        assert "proxy-authorization" not in server.seen[0].headers  # the proxy's, not the server's
        # The certificate is the server's, checked through the tunnel: an untrusted one fails.
        monkeypatch.delenv("SSL_CERT_FILE")
        error = _failure(Transport(server.url, retry=RetryPolicy(attempts=1)), "/v1/toolchains")
        assert isinstance(error, ServerUnavailableError)
        assert "CERTIFICATE_VERIFY_FAILED" in error.cause, error.cause
    finally:
        proxy.close()
        server.close()


def test_a_tls_handshake_trickled_a_byte_at_a_time_ends_by_the_deadline() -> None:
    """Each byte arrives well within the connect timeout, so only the deadline can end it."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    stop = threading.Event()

    def trickle() -> None:
        conn, _ = listener.accept()
        with conn:
            # A handshake record header promising 16 KiB, then its body a byte at a time.
            for byte in b"\x16\x03\x03\x40\x00" + b"\x00" * 1000:
                if stop.wait(0.3):
                    return
                try:
                    conn.sendall(bytes([byte]))
                except OSError:
                    return

    feeder = threading.Thread(target=trickle, daemon=True)
    feeder.start()
    policy = RetryPolicy(attempts=1, deadline_s=2.0, budget_s=0.0)
    transport = Transport(f"https://127.0.0.1:{port}", retry=policy, timeout=httpx.Timeout(5.0))
    started = time.monotonic()
    try:
        error = _failure(transport, "/v1/toolchains")
    finally:
        stop.set()
        transport.close()
        listener.close()
    took = time.monotonic() - started
    assert isinstance(error, ServerUnavailableError), error
    assert "DeadlineExceeded" in error.cause, error.cause
    assert took < 30, f"held {took:.0f}s by a 2 s deadline"  # the trickle would take 300 s


def test_the_same_json_body_comes_back_from_either_path() -> None:
    body = {"default": "cuda-12", "toolchains": ["cuda-12"], "text": "é ✓"}
    server = Scripted(lambda s: json_response(200, body))
    try:
        answers = [
            t.request("GET", "/v1/toolchains") for _, t in _both_paths(server.url, retry=FAST)
        ]
        assert [a.json() for a in answers] == [body, body]
        assert answers[0].text == answers[1].text == json.dumps(body)
        assert answers[0].content == answers[1].content
        assert str(answers[0].url) == str(answers[1].url) == f"{server.url}/v1/toolchains"
        assert answers[0].headers.get("content-type") == answers[1].headers.get("Content-Type")
    finally:
        server.close()


# ------------------------------------------------------------------------------ streamed answers
def _streamed(transport: Transport, path: str = "/v1/bundle") -> bytes:
    with transport.stream("POST", path, json={"recipe_keys": []}) as chunks:
        return b"".join(chunks)


def test_a_streamed_post_takes_the_lean_path_and_is_read_as_it_arrives(
    built_clients: list[httpx.Client],
) -> None:
    parts = [b"a" * 10, b"b" * 200_000, b"c" * 3]
    answers = {
        "chunked": chunked(*parts),
        "length": b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s"
        % (sum(map(len, parts)), b"".join(parts)),
    }
    for kind, answer in answers.items():
        server = RawServer(lambda n, a=answer: a)  # type: ignore[misc]
        try:
            transport = Transport(server.url, retry=FAST)
            with transport.stream("POST", "/v1/bundle", json={"recipe_keys": ["k"]}) as chunks:
                pieces = list(chunks)
            assert b"".join(pieces) == b"".join(parts) and len(pieces) > 1, kind
            assert _streamed(transport) == b"".join(parts), kind  # a second one, same socket
            assert server.connections == 1 and transport.requests == 2, kind
        finally:
            server.close()
    assert built_clients == []  # httpx (and its httpcore, h11, anyio) never loaded for it


def test_a_stream_left_unread_closes_its_connection_and_the_next_opens_one() -> None:
    server = RawServer(lambda n: chunked(b"x" * 100_000, b"y" * 100_000))
    try:
        transport = Transport(server.url, retry=FAST)
        with transport.stream("POST", "/v1/bundle", json={}) as chunks:
            next(chunks)  # the caller stops half way (a refused entry)
        assert _streamed(transport) == b"x" * 100_000 + b"y" * 100_000
        assert server.connections == 2
    finally:
        server.close()


def test_a_streamed_answer_cut_encoded_or_refused_is_the_typed_error_on_both_paths() -> None:
    cases: dict[str, tuple[bytes | None, type[Exception], str]] = {
        "cut in the body": (
            chunked(b"y" * 50)[:-12],
            ServerUnavailableError,
            "RemoteProtocolError",
        ),
        "encoded": (
            b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: 2\r\n\r\nok",
            ServerUnavailableError,
            "RemoteProtocolError",
        ),
        "a 401": (
            b"HTTP/1.1 401 Unauthorized\r\nContent-Type: application/json\r\n"
            b'Content-Length: 25\r\n\r\n{"error": "unauthorized"}',
            AuthenticationError,
            "",
        ),
    }
    for case, (answer, kind, cause) in cases.items():
        server = RawServer(lambda n, a=answer: a, close_after=True)  # type: ignore[misc]
        try:
            transport = Transport(server.url, retry=FAST)
            with pytest.raises(kind) as info:
                _streamed(transport)
            if cause:
                assert getattr(info.value, "cause", "").startswith(cause), (case, info.value)
            assert transport.requests == 1, case  # a stream is never sent twice
        finally:
            server.close()
    # httpx says the same of the encoded answer only when it cannot decode it; the cut and
    # the 401 read the same through an injected httpx client.
    for case in ("cut in the body", "a 401"):
        answer, kind, _ = cases[case]
        server = RawServer(lambda n, a=answer: a, close_after=True)  # type: ignore[misc]
        client = httpx.Client(timeout=DEFAULT_TIMEOUT)
        try:
            with pytest.raises(kind):
                _streamed(Transport(server.url, client=client, retry=FAST))
        finally:
            client.close()
            server.close()


def test_a_stream_that_stops_sending_is_a_read_timeout() -> None:
    release = threading.Event()
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n"
    server = RawServer(lambda n: head if not release.is_set() else None)
    try:
        transport = Transport(server.url, retry=FAST, timeout=httpx.Timeout(0.3, connect=5.0))
        with pytest.raises(ServerUnavailableError) as info:
            _streamed(transport)
        assert info.value.cause.startswith("ReadTimeout"), info.value.cause
    finally:
        release.set()
        server.close()


# ------------------------------------------------------------------------------ headers read
def _answer_with(head: str) -> bytes:
    return f"HTTP/1.1 200 OK\r\n{head}Content-Length: 2\r\n\r\nok".encode("latin-1")


def test_headers_are_read_as_http_client_reads_them_without_its_email_parser() -> None:
    head = (
        "X-One: first\r\n"
        "x-one: second\r\n"  # repeated: joined, as httpx joins them
        "X-Folded: begun\r\n"
        "\t and continued\r\n"  # obsolete folding: the value goes on
        "X-Blank:   \t leading blanks dropped, trailing kept  \r\n"
        "X-Latin: caf\xe9\r\n"  # not UTF-8: read as latin-1
        "X-Utf8: caf\xc3\xa9\r\n"  # UTF-8: decoded as httpx decodes it
    )
    server = RawServer(lambda n: _answer_with(head))
    try:
        reply = Transport(server.url, retry=FAST).request("GET", "/x")
        assert reply.content == b"ok"
        assert reply.headers["X-ONE"] == "first, second"
        assert reply.headers["x-folded"] == "begun and continued"
        assert reply.headers["x-blank"] == "leading blanks dropped, trailing kept  "
        assert reply.headers["x-latin"] == "caf\xe9" and reply.headers["x-utf8"] == "caf\xe9"
        assert server.connections == 1
    finally:
        server.close()


@pytest.mark.parametrize(
    ("head", "said"),
    [
        ("X-No-Colon\r\n", "not 'name: value'"),
        (": no name\r\n", "not 'name: value'"),
        ("X-Space : before the colon\r\n", "not 'name: value'"),
        ("X-Long: " + "a" * 70_000 + "\r\n", "too long"),
        ("".join(f"X-{i}: v\r\n" for i in range(101)), "too many headers"),
    ],
)
def test_headers_past_the_bounds_or_malformed_are_refused_without_a_retry(
    head: str, said: str
) -> None:
    server = RawServer(lambda n: _answer_with(head))
    try:
        with pytest.raises(ResponseRefusedError, match=said):
            Transport(server.url, retry=FAST).request("GET", "/x")
        assert server.requests == 1  # the same server would answer the same: not asked again
    finally:
        server.close()
