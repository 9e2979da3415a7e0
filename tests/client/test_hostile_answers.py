"""A rank trusts the network no further than it must (issue 30), on both transports.

Each test scripts one hostile answer on a raw loopback socket (so nothing but the
bytes the test writes reaches the client) and runs the client against it through the
lean ``http.client`` path and through httpx (an injected client). What is checked:
the call ends in bounded time (at least its deadlines and under 10 x them, or under
:data:`HUNG_S` for a refusal, so that a loaded machine passes too), in bounded memory
(the bytes the server managed to send, and the client's peak of Python allocations),
with the right error naming the URL, and with nothing in the node tier.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import os
import socket
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from client_harness import Scripted, Seen, json_response
from kcache_client import (
    ClientSettings,
    KernelCache,
    RetryPolicy,
    ServerUnavailableError,
)
from kcache_client._http import MAX_JSON_BYTES, Transport
from kcache_client._remote import Remote
from kcache_client._stats import CacheStats
from kcache_client.errors import ResponseRefusedError

from kcache import Recipe
from kcache.artifact import ArtifactMeta
from kcache.artifact_header import encode_meta
from kcache.signing import SigningKey
from tests.support import FAST

TOOLCHAIN = "nvrtc-12.8"
RECIPE = Recipe(
    source='extern "C" __global__ void hostile(float* x) { x[0] = 1.0f; }\n',
    target="sm_80",
    toolchain=TOOLCHAIN,
)
KEY = RECIPE.key()
ARTIFACT = f"/v1/recipes/{KEY}/artifact"
#: What the metadata promises: the issue's 3,440 bytes.
PROMISED = b"\x7fELF" + b"c" * 3436
META = ArtifactMeta(
    digest=hashlib.sha256(PROMISED).hexdigest(),
    size=len(PROMISED),
    kind="cubin",
    target="sm_80",
    toolchain=TOOLCHAIN,
)
HUGE = 512 << 20
#: A bound on a refusal's time that only says the call did not hang on the answer (an
#: endless one never ends): each is refused in well under a second when quiet, and a
#: loaded machine (with tracemalloc on) may be many times slower.
HUNG_S = 60.0
#: Bytes a refused answer may still have pushed into the two sockets' kernel buffers.
SLACK = 16 << 20
TRANSPORTS = ["lean", "httpx"]


# ------------------------------------------------------------------------------ the server
class Hostile:
    """A TCP server that reads each request's head and body, then runs ``answer`` on it.

    ``answer(conn, request)`` writes through ``conn.send`` (which counts the bytes the
    kernel accepted and raises once the client has gone); the connection is closed when
    it returns. ``requests`` are the request heads seen (first line and lower-cased
    header names and values).
    """

    def __init__(self, answer: Callable[[Connection, dict[str, Any]], None]) -> None:
        self.answer = answer
        self.requests: list[dict[str, Any]] = []
        self.sent = 0
        self.stop = threading.Event()
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(sock,), daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        with sock, sock.makefile("rb") as reader:
            line = reader.readline().decode("latin-1").strip()
            if not line:
                return
            headers: dict[str, str] = {}
            while True:
                raw = reader.readline()
                if raw in (b"\r\n", b"\n", b""):
                    break
                name, _, value = raw.decode("latin-1").partition(":")
                headers[name.strip().lower()] = value.strip()
            length = int(headers.get("content-length") or 0)
            body = reader.read(length) if length else b""
            method, path, _ = line.split(" ", 2)
            request = {"method": method, "path": path, "headers": headers, "body": body}
            with self._lock:
                self.requests.append(request)
            with contextlib.suppress(OSError):  # the client hung up: a refusal, seen from here
                self.answer(Connection(self, sock), request)

    def count(self, prefix: str = "") -> int:
        with self._lock:
            return sum(1 for r in self.requests if r["path"].startswith(prefix))

    def close(self) -> None:
        self.stop.set()
        self._listener.close()


class Connection:
    """One accepted connection of a :class:`Hostile` server."""

    def __init__(self, server: Hostile, sock: socket.socket) -> None:
        self.server = server
        self.sock = sock

    def send(self, data: bytes) -> None:
        if self.server.stop.is_set():
            raise OSError("the test is over")
        self.sock.sendall(data)
        with self.server._lock:
            self.server.sent += len(data)


def head(status: str = "200 OK", *lines: str) -> bytes:
    return ("\r\n".join([f"HTTP/1.1 {status}", *lines, "", ""])).encode("latin-1")


def meta_lines(meta: ArtifactMeta = META) -> list[str]:
    encoded = encode_meta(meta)
    assert encoded is not None
    return [
        "Content-Type: application/octet-stream",
        f"X-KCache-Meta: {encoded}",
        f"X-KCache-Digest: {meta.digest}",
    ]


def endless(piece: bytes = b"x" * 65536) -> Iterator[bytes]:
    while True:
        yield piece


def sized(total: int, piece: int = 65536) -> Iterator[bytes]:
    block = b"y" * piece
    while total > 0:
        yield block[: min(piece, total)]
        total -= piece


def toolchains_or(artifact: Callable[[Connection, dict[str, Any]], None]) -> Callable[..., None]:
    """An answer that serves ``/v1/toolchains`` honestly and hands everything else to ``artifact``."""

    def answer(conn: Connection, request: dict[str, Any]) -> None:
        if request["path"] == "/v1/toolchains":
            body = b'{"default":"%s","toolchains":["%s"]}' % (
                TOOLCHAIN.encode(),
                TOOLCHAIN.encode(),
            )
            conn.send(
                head(
                    "200 OK",
                    "Content-Type: application/json",
                    f"Content-Length: {len(body)}",
                    "Connection: close",
                )
                + body
            )
            return
        artifact(conn, request)

    return answer


# ------------------------------------------------------------------------------ helpers
@pytest.fixture
def hostile() -> Iterator[Callable[[Callable[..., None]], Hostile]]:
    made: list[Hostile] = []

    def make(answer: Callable[..., None]) -> Hostile:
        server = Hostile(answer)
        made.append(server)
        return server

    yield make
    for server in made:
        server.close()


def cache_for(
    transport: str, url: str, tier: Path, retry: RetryPolicy = FAST, **settings: Any
) -> tuple[KernelCache, httpx.Client | None]:
    """A KernelCache on ``url`` through the lean path or an injected httpx client."""
    configured = ClientSettings.from_env(
        send_events=False, retry=retry, local_compile=False, **settings
    )
    client = httpx.Client(timeout=configured.timeout) if transport == "httpx" else None
    return KernelCache(url, cache_dir=tier, settings=configured, http_client=client), client


def tier_is_empty(root: Path) -> bool:
    blobs = [p for p in (root / "blobs").rglob("*") if p.is_file()] if root.exists() else []
    aliases = list((root / "index" / "recipes").rglob("*.json")) if root.exists() else []
    return not blobs and not aliases


class Measured:
    """How long a call took and the peak of Python allocations during it (all threads)."""

    seconds: float = 0.0
    peak: int = 0


def measured(call: Callable[[], Any]) -> tuple[BaseException, Measured]:
    """Run ``call``, which must raise; the exception and what it cost."""
    out = Measured()
    tracemalloc.start()
    started = time.monotonic()
    try:
        call()
    except BaseException as exc:  # what the test asserts on
        error = exc
    else:
        raise AssertionError("the call should have raised")
    finally:
        out.seconds = time.monotonic() - started
        out.peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return error, out


def fetch_against(
    transport: str, server: Hostile, tmp_path: Path, retry: RetryPolicy = FAST, **settings: Any
) -> tuple[BaseException, Measured]:
    cache, client = cache_for(transport, server.url, tmp_path / "tier", retry, **settings)
    try:
        return measured(lambda: cache.get(RECIPE))
    finally:
        cache.close()
        if client is not None:
            client.close()


# ------------------------------------------------------------------------------ bodies
@pytest.mark.parametrize("framing", ["content-length", "until-close", "endless-chunked"])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_body_longer_than_its_metadata_promises_is_refused_at_once(
    hostile: Callable[..., Hostile], tmp_path: Path, transport: str, framing: str
) -> None:
    """The issue's 512 MiB body behind a real X-KCache-Meta of 3,440 bytes, and an endless one."""

    def answer(conn: Connection, request: dict[str, Any]) -> None:
        lines = meta_lines()
        if framing == "content-length":
            conn.send(head("200 OK", *lines, f"Content-Length: {HUGE}"))
            pieces: Iterator[bytes] = sized(HUGE)
        elif framing == "until-close":
            conn.send(head("200 OK", *lines, "Connection: close"))
            pieces = sized(HUGE)
        else:
            conn.send(head("200 OK", *lines, "Transfer-Encoding: chunked"))
            pieces = (b"%x\r\n%s\r\n" % (len(p), p) for p in endless())
        for piece in pieces:
            conn.send(piece)

    server = hostile(answer)
    error, cost = fetch_against(transport, server, tmp_path)
    assert isinstance(error, ResponseRefusedError), error
    assert f"{server.url}{ARTIFACT}" in str(error) and "\n" not in str(error)
    assert "3440 bytes" in str(error) and "X-KCache-Meta" in str(error)
    assert server.count() == 1  # not retried, and no refetch by digest
    assert server.sent < SLACK, server.sent
    assert cost.peak < 8 << 20, cost.peak
    assert cost.seconds < HUNG_S
    assert tier_is_empty(tmp_path / "tier")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_an_endless_json_answer_is_cut_at_the_json_cap(
    hostile: Callable[..., Hostile], tmp_path: Path, transport: str
) -> None:
    def answer(conn: Connection, request: dict[str, Any]) -> None:
        conn.send(head("200 OK", "Content-Type: application/json", "Transfer-Encoding: chunked"))
        conn.send(b"1\r\n[\r\n")
        for piece in endless(b"0," * 32768):
            conn.send(b"%x\r\n%s\r\n" % (len(piece), piece))

    server = hostile(answer)
    cache, client = cache_for(transport, server.url, tmp_path / "tier")
    try:
        error, cost = measured(cache.toolchains)
    finally:
        cache.close()
        if client is not None:
            client.close()
    assert isinstance(error, ResponseRefusedError), error
    assert f"{server.url}/v1/toolchains" in str(error)
    assert f"longer than the {MAX_JSON_BYTES} bytes a JSON answer may have" in str(error)
    assert server.count() == 1
    assert server.sent < MAX_JSON_BYTES + SLACK, server.sent
    assert cost.peak < MAX_JSON_BYTES + (8 << 20), cost.peak
    assert cost.seconds < HUNG_S


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_metadata_naming_more_than_max_artifact_bytes_is_refused_before_the_body(
    hostile: Callable[..., Hostile],
    tmp_path: Path,
    transport: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    big = ArtifactMeta(
        digest="a" * 64, size=HUGE, kind="cubin", target="sm_80", toolchain=TOOLCHAIN
    )

    def answer(conn: Connection, request: dict[str, Any]) -> None:
        conn.send(head("200 OK", *meta_lines(big), f"Content-Length: {HUGE}"))
        for piece in sized(HUGE):
            conn.send(piece)

    server = hostile(answer)
    monkeypatch.setenv("KCACHE_CLIENT_MAX_ARTIFACT_BYTES", "1MiB")
    error, cost = fetch_against(transport, server, tmp_path)
    assert isinstance(error, ResponseRefusedError), error
    assert f"names {HUGE} bytes, more than the {1 << 20} this client accepts" in str(error)
    assert server.sent < SLACK and cost.seconds < HUNG_S
    assert tier_is_empty(tmp_path / "tier")
    monkeypatch.delenv("KCACHE_CLIENT_MAX_ARTIFACT_BYTES")
    # Given to the Remote itself; and a resolve's metadata is refused before its download.
    remote = Remote(Transport(server.url, retry=FAST), CacheStats(), max_artifact_bytes=4096)
    with pytest.raises(ResponseRefusedError, match="more than the 4096 this client accepts"):
        remote.fetch(RECIPE, KEY)
    with pytest.raises(ResponseRefusedError, match="more than the 4096 this client accepts"):
        remote.download(big)
    assert server.count("/v1/blobs/") == 0


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_blob_longer_than_its_resolve_promised_is_refused(
    hostile: Callable[..., Hostile], transport: str
) -> None:
    def answer(conn: Connection, request: dict[str, Any]) -> None:
        conn.send(head("200 OK", "Content-Type: application/octet-stream", "Connection: close"))
        for piece in sized(HUGE):
            conn.send(piece)

    server = hostile(answer)
    client = httpx.Client() if transport == "httpx" else None
    remote = Remote(Transport(server.url, retry=FAST, client=client), CacheStats())
    try:
        error, cost = measured(lambda: remote.download(META))
    finally:
        if client is not None:
            client.close()
    assert isinstance(error, ResponseRefusedError), error
    assert f"{server.url}/v1/blobs/{META.digest}" in str(error) and "3440 bytes" in str(error)
    assert server.count() == 1 and server.sent < SLACK and cost.peak < 8 << 20


def test_a_compressed_body_is_decoded_no_further_than_its_limit(
    hostile: Callable[..., Hostile],
) -> None:
    bomb = gzip.compress(b"0" * (MAX_JSON_BYTES + (8 << 20)), compresslevel=9)  # ~40 KB

    def answer(conn: Connection, request: dict[str, Any]) -> None:
        conn.send(
            head(
                "200 OK",
                "Content-Type: application/json",
                "Content-Encoding: gzip",
                f"Content-Length: {len(bomb)}",
            )
            + bomb
        )

    server = hostile(answer)
    error, cost = measured(lambda: Transport(server.url, retry=FAST).request("GET", "/v1/x"))
    assert isinstance(error, ResponseRefusedError), error
    assert "decodes to more than" in str(error)
    assert cost.peak < MAX_JSON_BYTES + (8 << 20), cost.peak


# ------------------------------------------------------------------------------ time
#: Where a trickle is, on which transport: httpx reads a head whole before it hands anything
#: back, so a trickled head is bounded there as test_an_injected_httpx_clients_head_... says.
TRICKLES = [("lean", "body"), ("lean", "headers"), ("httpx", "body")]


@pytest.mark.parametrize(("transport", "where"), TRICKLES)
def test_a_trickle_ends_at_the_deadline_and_the_call_within_its_budget(
    hostile: Callable[..., Hostile], tmp_path: Path, transport: str, where: str
) -> None:
    """One byte a second, far under the 600 s read timeout: only the deadlines can end it."""

    def answer(conn: Connection, request: dict[str, Any]) -> None:
        whole = head("200 OK", *meta_lines(), f"Content-Length: {len(PROMISED)}") + PROMISED
        start = whole.index(PROMISED) if where == "body" else 0
        conn.send(whole[:start])
        for i in range(start, len(whole)):
            conn.send(whole[i : i + 1])
            if server.stop.wait(1.0):
                return

    server = hostile(answer)
    policy = RetryPolicy(attempts=5, base_s=0.01, cap_s=0.02, deadline_s=1.0, budget_s=2.5)
    error, cost = fetch_against(transport, server, tmp_path, retry=policy)
    assert isinstance(error, ServerUnavailableError), error
    # On httpx a read wait is capped at what is left of the try, so a byte a second may
    # end it as a ReadTimeout at the deadline, not a DeadlineExceeded (kcache_client._httpx_wire).
    ended = ("DeadlineExceeded: no whole answer within", "ReadTimeout")
    assert error.cause.startswith(ended if transport == "httpx" else ended[0]), error.cause
    assert server.url in str(error)
    # Ended by the deadlines, not by the trickle (3,440 s of it): at least the tries'
    # deadlines, and far below the trickle (10 x the budget: a loaded machine is slow).
    assert cost.seconds >= 2.0, cost.seconds
    assert cost.seconds < 10 * policy.budget_s, cost.seconds
    assert server.count() >= 2  # retried within the budget, not beyond it
    assert tier_is_empty(tmp_path / "tier")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_lone_slow_try_keeps_its_deadline_past_a_shorter_budget(
    hostile: Callable[..., Hostile], transport: str
) -> None:
    """The budget forbids retries; it does not cut the one try short of its deadline."""

    def answer(conn: Connection, request: dict[str, Any]) -> None:
        server.stop.wait(60)  # released when the test's servers close

    server = hostile(answer)
    policy = RetryPolicy(attempts=5, base_s=0.01, cap_s=0.02, deadline_s=1.5, budget_s=0.2)
    client = httpx.Client(timeout=600.0) if transport == "httpx" else None
    try:
        transport_ = Transport(server.url, retry=policy, client=client)
        error, cost = measured(lambda: transport_.request("GET", "/v1/toolchains"))
    finally:
        if client is not None:
            client.close()
    assert isinstance(error, ServerUnavailableError), error
    # The try ran to its deadline: on httpx the read timeout (capped at the deadline) and
    # the deadline end together, and either may be the one reported.
    assert error.cause.startswith(("DeadlineExceeded", "ReadTimeout")), error.cause
    # Not cut short at the budget's 0.2 s; the upper bound (10 x the deadline) only says
    # it did not wait for the server, which holds the request 60 s.
    assert cost.seconds >= 1.4, cost.seconds
    assert cost.seconds < 15.0, cost.seconds
    assert server.count() == 1  # the budget forbade a retry


@pytest.mark.parametrize("call", ["request", "stream"])
@pytest.mark.parametrize("pace", ["each-piece-within-the-cap", "a-piece-past-the-cap"])
def test_an_injected_httpx_clients_head_is_bounded_per_wait_then_by_the_deadline(
    hostile: Callable[..., Hostile], call: str, pace: str
) -> None:
    """The bound kcache_client._httpx_wire states for a head (no thread watches httpx): each
    wait for its bytes is capped at what was left of the try when it began, and the
    deadline is checked once the head is whole. A head in pieces each within the cap (six,
    0.4 s apart, past a 1 s deadline) ends the try when it is in, with DeadlineExceeded; a
    piece slower than the cap ends it at the deadline, a ReadTimeout."""
    gaps = [0.4] * 5 if pace == "each-piece-within-the-cap" else [30.0]

    def answer(conn: Connection, request: dict[str, Any]) -> None:
        whole = head("200 OK", "Content-Type: application/json", "Content-Length: 2") + b"{}"
        step = -(-len(whole) // (len(gaps) + 1))
        pieces = [whole[i : i + step] for i in range(0, len(whole), step)]
        conn.send(pieces[0])
        for gap, piece in zip(gaps, pieces[1:], strict=False):
            if server.stop.wait(gap):
                return
            conn.send(piece)

    server = hostile(answer)
    policy = RetryPolicy(attempts=1, deadline_s=1.0, budget_s=0.0)
    client = httpx.Client(timeout=600.0)

    def run() -> None:
        transport_ = Transport(server.url, retry=policy, client=client)
        if call == "request":
            transport_.request("GET", "/v1/toolchains")
        else:
            with transport_.stream("POST", "/v1/bundle", json={}) as chunks:
                b"".join(chunks)

    try:
        error, cost = measured(run)
    finally:
        client.close()
    assert isinstance(error, ServerUnavailableError), error
    if pace == "each-piece-within-the-cap":
        assert error.cause.startswith("DeadlineExceeded"), error.cause
        # Not before the head was whole (2 s of it), and at once then (a loaded machine is slow).
        assert 1.9 <= cost.seconds < 2.0 + 5.0, cost.seconds
    else:
        assert error.cause.startswith("ReadTimeout"), error.cause
        assert 0.9 <= cost.seconds < 10.0, cost.seconds  # the deadline, not the 30 s gap
    assert server.count() == 1


# ------------------------------------------------------------------------------ errors
@pytest.mark.parametrize(("status", "method"), [(302, "GET"), (307, "POST")])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_redirect_is_not_followed_and_the_token_never_reaches_the_other_host(
    hostile: Callable[..., Hostile], transport: str, status: int, method: str
) -> None:
    elsewhere = Scripted(lambda seen: json_response(200, {"stolen": True}))
    target = f"{elsewhere.url}/collect"

    def answer(conn: Connection, request: dict[str, Any]) -> None:
        body = b"moved"
        conn.send(
            head(f"{status} Found", f"Location: {target}", f"Content-Length: {len(body)}") + body
        )

    server = hostile(answer)
    # An injected client that would follow redirects: kcache still does not.
    client = httpx.Client(follow_redirects=True) if transport == "httpx" else None
    try:
        remote = Transport(server.url, "s3cret", retry=FAST, client=client)
        path = "/v1/resolve" if method == "POST" else ARTIFACT
        error, cost = measured(
            lambda: remote.request(method, path, json={} if method == "POST" else None)
        )
    finally:
        if client is not None:
            client.close()
        elsewhere.close()
    assert isinstance(error, ResponseRefusedError), error
    assert error.status == status
    message = str(error)
    assert message.startswith(f"answer from {server.url}{path} refused: HTTP {status} redirect")
    assert f"to {target}, not followed" in message and "\n" not in message
    assert elsewhere.seen == []  # nothing, so no token, went to the other host
    assert server.count() == 1  # not retried
    assert server.requests[0]["headers"]["authorization"] == "Bearer s3cret"
    assert cost.seconds < HUNG_S


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_one_mebibyte_meta_header_is_refused_as_such_without_retries(
    hostile: Callable[..., Hostile], tmp_path: Path, transport: str
) -> None:
    def answer(conn: Connection, request: dict[str, Any]) -> None:
        conn.send(head("200 OK", "X-KCache-Meta: " + "A" * (1 << 20), "Content-Length: 2") + b"ok")

    server = hostile(answer)
    error, cost = fetch_against(transport, server, tmp_path)
    assert isinstance(error, ResponseRefusedError), error
    assert f"answer from {server.url}{ARTIFACT} refused" in str(error)
    assert "headers are too long" in str(error) and "\n" not in str(error)
    assert not isinstance(error, ServerUnavailableError)  # it was reached; it answered wrongly
    assert server.count() == 1
    assert cost.seconds < HUNG_S
    assert tier_is_empty(tmp_path / "tier")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_an_answer_that_is_not_json_is_a_malformed_answer_naming_the_url(
    tmp_path: Path, transport: str
) -> None:
    server = Scripted(lambda seen: (200, {"Content-Type": "text/html"}, b"<html>a portal</html>"))
    cache, client = cache_for(transport, server.url, tmp_path / "tier")
    try:
        with pytest.raises(ResponseRefusedError) as info:
            cache.toolchains()
    finally:
        cache.close()
        if client is not None:
            client.close()
        server.close()
    message = str(info.value)
    assert message.startswith(f"answer from {server.url}/v1/toolchains refused: HTTP 200")
    assert "not JSON" in message and "\n" not in message
    assert len(server.seen) == 1


def test_the_error_body_of_a_status_is_bounded_too(hostile: Callable[..., Hostile]) -> None:
    def answer(conn: Connection, request: dict[str, Any]) -> None:
        conn.send(head("500 Internal Server Error", "Connection: close"))
        for piece in endless():
            conn.send(piece)

    server = hostile(answer)
    error, _ = measured(lambda: Transport(server.url, retry=FAST).request("GET", "/v1/x"))
    assert isinstance(error, ResponseRefusedError), error
    assert "HTTP 500" in str(error)
    assert server.sent < MAX_JSON_BYTES + SLACK


def test_a_well_behaved_artifact_still_arrives_whole_on_both_paths(tmp_path: Path) -> None:
    """The bounds cost an honest answer nothing: same bytes, one request, published."""

    def route(seen: Seen) -> tuple[int, dict[str, str], bytes]:
        encoded = encode_meta(META)
        assert encoded is not None
        # Signed by the run's key, which every client of the suite trusts (tests/conftest.py).
        key = SigningKey.load(Path(os.environ["KCACHE_SIGNING_KEY_FILE"]))
        signature = key.sign(KEY, META).header_value()
        headers = {"X-KCache-Meta": encoded, "X-KCache-Digest": META.digest}
        return 200, {**headers, "X-KCache-Signature": signature}, PROMISED

    server = Scripted(route)
    try:
        for transport in TRANSPORTS:
            cache, client = cache_for(transport, server.url, tmp_path / transport)
            try:
                art = cache.get(RECIPE)
                assert art.data == PROMISED and art.path.read_bytes() == PROMISED
                assert art.origin == "server"
            finally:
                cache.close()
                if client is not None:
                    client.close()
        assert len(server.seen) == 2
    finally:
        server.close()
