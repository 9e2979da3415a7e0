"""The bundle stream is bounded as a single fetch is (issue 48 item 3), on both transports.

A hostile server (a raw loopback socket: :class:`test_hostile_answers.Hostile`) answers
``POST /v1/bundle`` of a prefetch with endless ``{"missing": K}`` lines, a trickle of one
byte a second, or more than any answer may hold; through the lean ``http.client`` path
and through httpx (an injected client), each prefetch ends with a typed error, within
the request's deadline (``RetryPolicy.deadline_s``, the one a single fetch's try has; a
head trickled through httpx is bounded as ``kcache_client._httpx_wire`` states) and in
bounded memory, and leaves no pack in the node tier. Times are asserted only as "it
ended" (at least the deadline, under 10 x it, for a trickle), or as counts and bytes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kcache_client import RetryPolicy, ServerUnavailableError
from kcache_client.errors import ResponseRefusedError
from test_hostile_answers import (
    HUGE,
    HUNG_S,
    SLACK,
    TRANSPORTS,
    TRICKLES,
    Connection,
    Hostile,
    Measured,
    cache_for,
    head,
    hostile,
    measured,
)

from kcache.artifact import ArtifactMeta
from kcache.bundle_format import (
    MAX_LINE_BYTES,
    BundleError,
    BundleReader,
    entry_head,
    header_line,
    missing_line,
)
from kcache.job_manifest import JobManifest, ManifestKernel
from kcache.signing import SigningKey

__all__ = ["hostile"]  # the fixture, used by name below

KEYS = [hashlib.sha256(b"hostile bundle %d" % i).hexdigest() for i in range(3)]
MANIFEST = JobManifest.of(
    ManifestKernel(k, hashlib.sha256(k.encode()).hexdigest(), target="sm_80") for k in KEYS
)
#: A deadline short enough for a quick test, far below the read timeout (600 s), so that
#: only the deadline can end a trickle.
DEADLINE_S = 1.5
POLICY = RetryPolicy(attempts=3, base_s=0.01, cap_s=0.02, deadline_s=DEADLINE_S, budget_s=1.0)


def bundle_answer(body: Callable[[Connection], None]) -> Callable[[Connection, Any], None]:
    """A server whose ``POST /v1/bundle`` answer is 200, chunked, with ``body`` writing the
    chunks' payload through :func:`chunk`; anything else a 404."""

    def answer(conn: Connection, request: dict[str, Any]) -> None:
        if request["path"] != "/v1/bundle":
            payload = b'{"error":"not_found","detail":"no"}'
            conn.send(
                head("404 Not Found", f"Content-Length: {len(payload)}", "Connection: close")
                + payload
            )
            return
        conn.send(
            head(
                "200 OK", "Content-Type: application/x-kcache-bundle", "Transfer-Encoding: chunked"
            )
        )
        body(conn)

    return answer


def chunk(conn: Connection, data: bytes) -> None:
    conn.send(b"%x\r\n%s\r\n" % (len(data), data))


def prefetch_against(
    transport: str, server: Hostile, tmp_path: Path, **settings: Any
) -> tuple[BaseException, Measured]:
    cache, client = cache_for(transport, server.url, tmp_path / "tier", POLICY, **settings)
    try:
        return measured(lambda: cache.prefetch(MANIFEST))
    finally:
        cache.close()
        if client is not None:
            client.close()


def no_pack(root: Path) -> bool:
    return (
        not [p for p in root.rglob("*") if p.is_file() and p.suffix == ".kcb"]
        if root.exists()
        else True
    )


# ------------------------------------------------------------------------------ lines
@pytest.mark.parametrize("keys", ["asked", "others"])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_endless_missing_lines_are_refused_past_what_was_asked(
    hostile: Callable[..., Hostile], tmp_path: Path, transport: str, keys: str
) -> None:
    """The issue's 769 MB: missing lines without end, of the keys asked (again and again) or
    of keys nobody asked for. Each key asked is answered at most once: the first line past
    that is refused, the connection dropped."""

    def body(conn: Connection) -> None:
        chunk(conn, header_line())
        n = 0
        while True:
            key = KEYS[n % len(KEYS)] if keys == "asked" else hashlib.sha256(b"%d" % n).hexdigest()
            chunk(conn, missing_line(key, "not here") * 64)
            n += 1

    server = hostile(bundle_answer(body))
    error, cost = prefetch_against(transport, server, tmp_path)
    assert isinstance(error, ResponseRefusedError), repr(error)
    assert f"{server.url}/v1/bundle" in str(error) and "missing line" in str(error)
    assert server.count("/v1/bundle") == 1  # not retried
    assert server.sent < SLACK, server.sent
    assert cost.peak < 8 << 20, cost.peak
    assert cost.seconds < HUNG_S
    assert no_pack(tmp_path / "tier")


def test_the_reader_counts_lines_of_every_kind_against_what_was_asked() -> None:
    """BundleReader's ``max_items``: entries and missing lines together, the trailer aside."""
    signature = SigningKey.generate().sign(
        KEYS[0],
        meta := ArtifactMeta(
            digest=hashlib.sha256(b"x").hexdigest(),
            size=1,
            kind="cubin",
            target="sm_80",
            toolchain="t",
        ),
    )
    entry = entry_head(KEYS[0], meta, signature) + b"x\n"
    lines = [header_line(), entry, missing_line(KEYS[1], "gone"), missing_line(KEYS[2], "gone")]
    trailer = b'{"end":true,"entries":1,"missing":2}\n'
    whole = b"".join([*lines, trailer])
    assert len(list(BundleReader([whole], max_entry_bytes=16, where="b", max_items=3))) == 3
    with pytest.raises(BundleError, match="more than the 2 entries and missing lines"):
        list(BundleReader([whole], max_entry_bytes=16, where="b", max_items=2))

    def endless() -> Iterator[bytes]:
        yield header_line()
        n = 0
        while True:
            n += 1
            yield missing_line(hashlib.sha256(b"%d" % n).hexdigest(), "")

    reader = BundleReader(endless(), max_entry_bytes=16, where="b", max_items=5)
    with pytest.raises(BundleError, match="more than the 5"):
        for _ in reader:
            pass
    assert reader.missing == 5


# ------------------------------------------------------------------------------ time
@pytest.mark.parametrize(("transport", "where"), TRICKLES)
def test_a_trickled_bundle_ends_at_the_requests_deadline(
    hostile: Callable[..., Hostile], tmp_path: Path, transport: str, where: str
) -> None:
    """One byte a second, of the status line and headers or of the body: only the
    deadline ends it (the read timeout is 600 s), as it ends a single fetch's try (a head
    through an injected httpx client: test_an_injected_httpx_clients_head_...)."""

    def answer(conn: Connection, request: dict[str, Any]) -> None:
        entry = header_line() + missing_line(KEYS[0], "x")
        whole = (
            head(
                "200 OK",
                "Content-Type: application/x-kcache-bundle",
                f"Content-Length: {len(entry) + 4096}",
            )
            + entry
            + b" " * 4096
        )
        start = 0 if where == "headers" else whole.index(entry) + 3
        conn.send(whole[:start])
        for i in range(start, len(whole)):
            conn.send(whole[i : i + 1])
            if server.stop.wait(1.0):
                return

    server = hostile(answer)
    error, cost = prefetch_against(transport, server, tmp_path)
    assert isinstance(error, ServerUnavailableError), repr(error)
    assert error.cause.startswith(("DeadlineExceeded", "ReadTimeout")), error.cause
    assert server.url in str(error)
    # Ended by the deadline (not before it), not by the trickle (~4,200 s of it); the
    # upper bound is 10 x the deadline, for a loaded machine.
    assert cost.seconds >= DEADLINE_S - 0.1, cost.seconds
    assert cost.seconds < 10 * DEADLINE_S, cost.seconds
    assert server.count("/v1/bundle") == 1  # a bundle is never retried
    assert no_pack(tmp_path / "tier")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_steady_stream_that_never_ends_ends_at_the_deadline(
    hostile: Callable[..., Hostile], tmp_path: Path, transport: str
) -> None:
    """An answer that keeps coming, fast, but never completes a line's worth of trouble:
    one entry's bytes sent slower than the deadline allows (a chunk every 50 ms)."""
    size = 1 << 20
    meta = ArtifactMeta(digest="a" * 64, size=size, kind="cubin", target="sm_80", toolchain="t")
    signature = SigningKey.generate().sign(KEYS[0], meta)

    def body(conn: Connection) -> None:
        chunk(conn, header_line() + entry_head(KEYS[0], meta, signature))
        while not server.stop.wait(0.05):
            chunk(conn, b"z" * 256)

    server = hostile(bundle_answer(body))
    error, cost = prefetch_against(transport, server, tmp_path)
    assert isinstance(error, ServerUnavailableError), repr(error)
    assert error.cause.startswith(("DeadlineExceeded", "ReadTimeout")), error.cause
    assert DEADLINE_S - 0.1 <= cost.seconds < 10 * DEADLINE_S, cost.seconds
    assert cost.peak < 8 << 20, cost.peak
    assert no_pack(tmp_path / "tier")


# ------------------------------------------------------------------------------ size
@pytest.mark.parametrize("what", ["entry-over-max", "endless-line", "bytes-after-trailer"])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_an_oversize_bundle_is_refused_in_bounded_memory(
    hostile: Callable[..., Hostile], tmp_path: Path, transport: str, what: str
) -> None:
    """An entry whose header names more than max_artifact_bytes (refused before its bytes),
    a line without end (refused past MAX_LINE_BYTES), and a whole answer followed by more."""
    big = ArtifactMeta(digest="a" * 64, size=HUGE, kind="cubin", target="sm_80", toolchain="t")
    signature = SigningKey.generate().sign(KEYS[0], big)

    def body(conn: Connection) -> None:
        if what == "entry-over-max":
            chunk(conn, header_line() + entry_head(KEYS[0], big, signature))
            filler = b"y" * 65536
        elif what == "endless-line":
            chunk(conn, header_line() + b'{"missing": "')
            filler = b"k" * 65536
        else:
            lines = [header_line(), *(missing_line(k, "gone") for k in KEYS)]
            chunk(conn, b"".join(lines) + b'{"end":true,"entries":0,"missing":3}\n')
            filler = b"\n" * 65536
        while True:
            chunk(conn, filler)

    server = hostile(bundle_answer(body))
    error, cost = prefetch_against(transport, server, tmp_path, max_artifact_bytes=1 << 20)
    assert isinstance(error, BundleError), repr(error)
    assert f"{server.url}/v1/bundle" in str(error)
    expected = {
        "entry-over-max": f"more than the {1 << 20} accepted",
        "endless-line": f"a line longer than {MAX_LINE_BYTES} bytes",
        "bytes-after-trailer": "bytes after the trailer",
    }[what]
    assert expected in str(error), str(error)
    assert server.count("/v1/bundle") == 1
    assert server.sent < MAX_LINE_BYTES + SLACK, server.sent
    assert cost.peak < 3 * MAX_LINE_BYTES + (8 << 20), cost.peak
    assert cost.seconds < HUNG_S
    assert no_pack(tmp_path / "tier")
