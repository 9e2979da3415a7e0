"""A bucket that is stopped or gone: ``/readyz`` says so in seconds, fetches fail fast with 503.

Before: with moto's S3 server stopped (SIGSTOP: connections open, nothing answers)
a fetch of a blob the replica held no copy of took 30 s to fail, and ``/readyz`` said
``store: ok`` throughout (it looked at the local directory only). Now readiness asks
the bucket (one listing of at most one name, bounded, its answer kept a few seconds) and a bucket request
gives up after ``store_timeout_s`` (5 s by default), so the fetch is a 503
``store_unavailable`` with ``Retry-After`` well within 30 s; killed, at once.

Real parts: ``kcache serve`` on SQLite with ``KCACHE_STORE_URL``, and a moto S3 server
of this module's own (it is stopped and killed here; the session's is never touched).
The blobs are put into the bucket directly, so the replica has no copy of them.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from kcache_server.readiness import BoundedCheck

from kcache.store.s3 import S3ArtifactStore
from tests.s3_server import S3Server, own_s3_server, stop_s3_server
from tests.support import ServerProcess, wait_until

#: The server's default bucket timeout (KCACHE_STORE_TIMEOUT_S); a fetch gives up within
#: about twice it, "far below 30 s".
STORE_TIMEOUT_S = 5.0
#: The server's default readiness bound (KCACHE_READINESS_TIMEOUT_S).
READY_TIMEOUT_S = 3.0


@dataclass
class Outage:
    """A replica, the bucket behind it (through a client of the test's own) and its S3 server."""

    s3: S3Server
    bucket: S3ArtifactStore
    replica: ServerProcess

    def fresh_blob(self) -> str:
        """A blob stored in the bucket only (the replica never saw it)."""
        return self.bucket.put(os.urandom(4096))

    def ready(self) -> httpx.Response:
        return httpx.get(f"{self.replica.url}/readyz", timeout=60)

    def fetch(self, digest: str) -> httpx.Response:
        return httpx.get(f"{self.replica.url}/v1/blobs/{digest}", timeout=120)


@pytest.fixture(scope="module")
def outage(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Outage]:
    s3 = own_s3_server()
    try:
        store_url = f"s3://{s3.new_bucket('outage')}/kcache"
        bucket = S3ArtifactStore.from_url(
            store_url,
            endpoint_url=s3.endpoint,
            access_key_id=s3.env["AWS_ACCESS_KEY_ID"],
            secret_access_key=s3.env["AWS_SECRET_ACCESS_KEY"],
            timeout_s=2.0,
        )
        env = {
            **os.environ,
            **s3.env,
            "KCACHE_STORE_URL": store_url,
            "KCACHE_COMPILE_WORKERS": "1",
            "KCACHE_VERIFY_ENABLED": "false",
        }
        root = Path(tmp_path_factory.mktemp("outage"))
        with ServerProcess(root / "data", env=env) as replica:
            yield Outage(s3, bucket, replica)
    finally:
        stop_s3_server(s3)


def _timed(call: Callable[[], httpx.Response]) -> tuple[httpx.Response, float]:
    started = time.monotonic()
    reply = call()
    return reply, time.monotonic() - started


def test_readyz_asks_the_bucket(outage: Outage) -> None:
    reply = outage.ready()
    assert reply.status_code == 200, reply.text
    assert reply.json()["checks"]["bucket"] == "ok"
    digest = outage.fresh_blob()
    assert outage.fetch(digest).status_code == 200  # from the bucket, then kept locally


def test_a_stopped_bucket_is_not_ready_and_fetches_fail_fast(outage: Outage) -> None:
    digests = [outage.fresh_blob() for _ in range(2)]
    os.kill(outage.s3.process.pid, signal.SIGSTOP)
    try:
        time.sleep(3.5)  # the bucket's last answer (kept 3 s) is stale now
        ready, took = _timed(outage.ready)
        assert ready.status_code == 503, ready.text
        check = ready.json()["checks"]["bucket"]
        assert check.startswith("failed:") and "did not answer" in check, check
        assert took < 4 * READY_TIMEOUT_S, (
            took
        )  # bounded by its timeout, with room for a loaded machine
        assert outage.s3.endpoint.split("//")[1] not in ready.text  # the endpoint stays in the log
        # The replica itself is alive: liveness answers while the bucket hangs.
        assert httpx.get(f"{outage.replica.url}/healthz", timeout=5).status_code == 200
        for digest in digests:
            fetched, took = _timed(lambda d=digest: outage.fetch(d))
            assert fetched.status_code == 503, fetched.text
            assert fetched.json()["error"] == "store_unavailable"
            assert int(fetched.headers["retry-after"]) >= 1
            assert took < 4 * STORE_TIMEOUT_S, took  # bounded (was 30 s and more)
    finally:
        os.kill(outage.s3.process.pid, signal.SIGCONT)
    wait_until(lambda: outage.ready().status_code == 200, "readyz to recover", timeout=30)
    assert outage.ready().json()["checks"]["bucket"] == "ok"
    assert all(outage.fetch(d).status_code == 200 for d in digests)


def test_a_killed_bucket_is_not_ready_and_fetches_fail_at_once(outage: Outage) -> None:
    """Runs last: the module's S3 server does not come back."""
    digest = outage.fresh_blob()
    outage.s3.process.kill()
    outage.s3.process.wait(10)
    time.sleep(3.5)
    ready, took = _timed(outage.ready)
    assert ready.status_code == 503 and took < 4 * READY_TIMEOUT_S, (ready.text, took)
    check = ready.json()["checks"]["bucket"]
    assert check.startswith("failed: the bucket cannot be reached"), check
    fetched, took = _timed(lambda: outage.fetch(digest))
    assert fetched.status_code == 503 and fetched.json()["error"] == "store_unavailable"
    assert "retry-after" in fetched.headers and took < STORE_TIMEOUT_S, took  # refused: no wait


# ------------------------------------------------------------------ the bounded check itself
def test_a_hung_check_answers_failed_at_its_deadline_and_runs_once() -> None:
    release = threading.Event()
    calls: list[int] = []

    def hangs() -> str:
        calls.append(1)
        release.wait(30)
        return "ok"

    check = BoundedCheck("bucket", hangs, timeout_s=0.2, ttl_s=10)
    started = time.monotonic()
    results = [check.status() for _ in range(3)]  # all while the first is out
    # Each at its 0.2 s deadline, not at the hung check's 30 s (10 s: room for a loaded machine).
    assert time.monotonic() - started < 10
    assert all(r == "failed: the bucket did not answer within 0.2 s" for r in results)
    assert len(calls) == 1  # one check in flight, however many probes
    release.set()
    wait_until(lambda: check.status() == "ok", "the late answer to be kept", timeout=5)
    assert check.status() == "ok" and len(calls) == 1  # kept for ttl_s


def test_a_kept_answer_expires_and_a_raising_check_fails() -> None:
    now = [0.0]
    answers = iter(["ok", "failed: down"])
    check = BoundedCheck(
        "bucket", lambda: next(answers), timeout_s=5, ttl_s=3, clock=lambda: now[0]
    )
    assert check.status() == "ok"
    now[0] = 2.9
    assert check.status() == "ok"  # kept
    now[0] = 3.0
    assert check.status() == "failed: down"  # asked again

    def raises() -> str:
        raise RuntimeError("secret endpoint 10.0.0.1")

    broken = BoundedCheck("database", raises, timeout_s=5)
    result = broken.status()
    assert result.startswith("failed: the database check failed") and "10.0.0.1" not in result


def test_a_probe_that_gives_up_at_the_bound_says_the_bucket_did_not_answer() -> None:
    """The probe's own timeout is the check's bound: whichever fires first, one message.

    A bucket that accepts connections and never answers (this socket's backlog) made the
    probe fail at its timeout, which read "cannot be reached or refuses this server's
    credentials" when it fired a moment before the check's own deadline (a CI flake).
    """
    from kcache_server.readiness import _bucket

    silent = socket.create_server(("127.0.0.1", 0), backlog=64)  # connects; never answers
    try:
        bucket = S3ArtifactStore.from_url(
            "s3://silent-bucket/p",
            endpoint_url=f"http://127.0.0.1:{silent.getsockname()[1]}",
            access_key_id="test",
            secret_access_key="test",
            region="us-east-1",
            probe_timeout_s=0.5,
        )
        assert _bucket(bucket, 0.5) == "failed: the bucket did not answer within 0.5 s"
        for _ in range(3):  # the two deadlines race each time
            check = BoundedCheck("bucket", lambda: _bucket(bucket, 0.5), timeout_s=0.5)
            assert check.status() == "failed: the bucket did not answer within 0.5 s"
            time.sleep(0.3)  # the probe's own end lands
            assert check.status() == "failed: the bucket did not answer within 0.5 s"
    finally:
        silent.close()
