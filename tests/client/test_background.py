"""The tier's bookkeeping thread (``BackgroundWork``) and what the tier hands it."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from kcache_client._background import BackgroundWork
from kcache_client._tier import NodeTier

from kcache.artifact import ArtifactMeta
from kcache.keys import sha256_hex


def _entry(text: str) -> tuple[str, str, ArtifactMeta, bytes]:
    data = text.encode() * 100
    meta = ArtifactMeta(
        digest=sha256_hex(data), size=len(data), kind="cubin", target="sm_90", toolchain="t"
    )
    return sha256_hex(f"k {text}".encode()), sha256_hex(f"b {text}".encode()), meta, data


def test_jobs_run_in_order_and_flush_waits_for_all_of_them() -> None:
    work = BackgroundWork("test-work")
    gate = threading.Event()
    done: list[int] = []
    work.submit(lambda: gate.wait(30))
    for i in range(5):
        work.submit(lambda i=i: done.append(i))
    assert work.flush(0.05) is False and done == []  # the first job holds the rest
    gate.set()
    assert work.flush(30) is True and done == [0, 1, 2, 3, 4]
    assert work.flush(0) is True  # nothing pending


def test_a_failing_job_is_logged_and_the_next_ones_still_run(
    caplog: pytest.LogCaptureFixture,
) -> None:
    work = BackgroundWork("test-failing")
    done: list[str] = []

    def fail() -> None:
        raise OSError(28, "No space left on device")

    with caplog.at_level(logging.WARNING, logger="kcache_client"):
        work.submit(fail)
        work.submit(lambda: done.append("after"))
        assert work.flush(30)
    assert done == ["after"]
    assert "test-failing failed" in caplog.text and "No space left" in caplog.text


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_runs_its_own_jobs_even_when_forked_mid_job() -> None:
    work = BackgroundWork("test-fork")
    gate, running = threading.Event(), threading.Event()
    work.submit(lambda: (running.set(), gate.wait(30)))
    assert running.wait(30)  # the parent's thread is inside a job (and may hold the lock)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            done: list[str] = []
            work.submit(lambda: done.append("child"))
            code = 0 if work.flush(10) and done == ["child"] else 1
        finally:
            os._exit(code)
    gate.set()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert work.flush(30)


def test_publish_leaves_the_record_to_the_bookkeeping_and_close_writes_it(tmp_path: Path) -> None:
    """A process that publishes and closes its cache leaves the record and manifest entry."""
    key, base, meta, data = _entry("closed")
    code = (
        "import sys, time\n"
        "from kcache_client import KernelCache\n"
        "from kcache_client._tier import NodeTier\n"
        "from kcache.artifact import ArtifactMeta\n"
        "cache = KernelCache(None, cache_dir=sys.argv[1])\n"
        "slow = cache.tier.index.record_metadata\n"
        "cache.tier.index.record_metadata = lambda *a: (time.sleep(0.5), slow(*a))\n"
        f"meta = ArtifactMeta.from_dict({meta.to_dict()!r})\n"
        f"cache.tier.publish({key!r}, {base!r}, meta, {data!r})\n"
        "print(cache.tier.index.artifact(meta.digest) is None, flush=True)\n"
        "cache.close()\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"  # publish returned before the record was written
    tier = NodeTier(tmp_path)
    assert tier.index.artifact(meta.digest) == meta  # ... and close waited for it
    assert [e.digest for e in tier.index.manifest(base)] == [meta.digest]


def test_a_blob_removed_before_its_bookkeeping_leaves_no_record(tmp_path: Path) -> None:
    """``kcache cache clear`` (or another process's eviction) between a publish and its record."""
    tier = NodeTier(tmp_path, max_bytes=0)
    gate = threading.Event()
    tier._bookkeeping.submit(lambda: gate.wait(30))  # the bookkeeping is busy a moment
    key, base, meta, data = _entry("cleared")
    tier.publish(key, base, meta, data)
    other = NodeTier(tmp_path, max_bytes=0)  # as another process: its own bookkeeping
    assert other.clear().removed == 1
    gate.set()
    assert tier.flush(30)
    assert tier.index.artifact(meta.digest) is None  # no record names the missing blob
    assert tier.index.manifest(base) == [] and tier.lookup(key) is None
    assert tier.usage().entries == 0
