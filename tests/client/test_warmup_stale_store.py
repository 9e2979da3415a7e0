"""Warmups on a long-lived store: nothing a previous job left there decides one (issue 30).

Real processes (torch.distributed on gloo, CPU) share a TCPStore the test hosts, as a
launcher's agent would, across two jobs: job 1 ends badly and leaves its warmup's keys;
job 2, every rank present, must succeed. Between the jobs the test deletes torch's own
rendezvous keys (gloo reads stale peer addresses from a reused store: that is torch's
affair) and keeps every kcache key. The workers use a stub cache (stale_store_worker.py):
the collectives over the store are what is under test. Threads with a store connection
each (as in test_store_collective.py) cover the same protocol quickly.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

dist = pytest.importorskip("torch.distributed")

from kcache_client import StoreCollective, WarmupError, WarmupTimeoutError  # noqa: E402
from kcache_client._warmup import warmup  # noqa: E402
from stale_store_worker import StubCache, recipe  # noqa: E402

WORKER = Path(__file__).with_name("stale_store_worker.py")
GROUP = hashlib.sha256(b"0,1").hexdigest()[:20]  # the call keys' name for ranks [0, 1]
#: The warmup timeout of a job that ends badly: its ranks wait it out.
GIVE_UP_S = 3.0
#: The warmup timeout of a job that must succeed promptly, so long that "nobody waited a
#: timeout out" is told apart from a loaded machine's slowness (those take under 2 s quiet).
PATIENT_S = 30.0


class LongLivedStore:
    """The test's TCPStore, outliving the jobs that use it."""

    def __init__(self) -> None:
        self.master = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30)
        )
        if not hasattr(self.master, "list_keys"):
            pytest.skip("this torch's TCPStore cannot list its keys")
        self.port = self.master.port

    def all_keys(self) -> list[str]:
        return [str(k) for k in self.master.list_keys()]

    def kcache_keys(self) -> list[str]:
        return [k for k in self.all_keys() if "/kcache/" in k]

    def forget_torch(self) -> None:
        """Delete torch's own keys (its gloo rendezvous), keeping every kcache key."""
        for key in self.all_keys():
            if "/kcache/" not in key:
                self.master.delete_key(key)

    def run_job(self, tmp_path: Path, name: str, **cfg: Any) -> list[dict[str, Any]]:
        """Two ranks of one job on this store; each rank's report (bounded: a hang fails)."""
        out = tmp_path / name
        out.mkdir()
        config = {
            "world": 2,
            "port": self.port,
            "timeout": GIVE_UP_S,
            "out": str(out),
            "recipes": ["stale_a", "stale_b"],
            **cfg,
        }
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(config))
        env = {k: v for k, v in os.environ.items() if k != "TORCHELASTIC_RUN_ID"}
        logs = [out / f"rank{r}.log" for r in range(2)]
        procs = []
        for rank in range(2):
            with logs[rank].open("wb") as log:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, str(WORKER), str(path), str(rank)], stderr=log, env=env
                    )
                )
        try:
            for proc in procs:
                proc.wait(60)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        reports = []
        for rank in range(2):
            report = out / f"{rank}.json"
            assert report.exists(), logs[rank].read_text(errors="replace")[-3000:]
            reports.append(json.loads(report.read_text()))
        return reports


@pytest.fixture
def store() -> Iterator[LongLivedStore]:
    held = LongLivedStore()
    yield held
    del held.master


def assert_job_succeeded(reports: list[dict[str, Any]]) -> None:
    assert all(r.get("ok") for r in reports), reports
    assert [r["leader"] for r in reports] == [True, False]
    assert {r["union"] for r in reports} == {2}
    assert reports[0]["digests"] == reports[1]["digests"]
    assert len(reports[0]["resolved"]) == 2 and reports[1]["resolved"] == []
    assert max(r["seconds"] for r in reports) < PATIENT_S / 2  # nobody waited a timeout out


def test_a_job_whose_rank_never_came_does_not_decide_the_next_jobs_warmup(
    store: LongLivedStore, tmp_path: Path
) -> None:
    """The issue's case: job 1's rank 0 timed out waiting for rank 1; job 2 has both."""
    first = store.run_job(tmp_path, "job1", absent=[1])
    assert first[1] == {"rank": 1, "absent": True}
    assert first[0]["error"] == "WarmupTimeoutError" and first[0]["missing_ranks"] == [1]
    assert "rank 1 did not reach the all-gather #1" in first[0]["message"]
    stale = store.kcache_keys()
    assert any(k.endswith("/0/verdict") for k in stale), stale  # job 1's verdict is there
    store.forget_torch()
    second = store.run_job(tmp_path, "job2", timeout=PATIENT_S)
    assert_job_succeeded(second)
    # Job 2 tidied all of its own keys; job 1's (another run's) are left alone, and ignored.
    assert set(store.kcache_keys()) <= set(stale)


def test_a_job_whose_leader_never_came_does_not_decide_the_next_jobs_warmup(
    store: LongLivedStore, tmp_path: Path
) -> None:
    """Job 1's rank 1 gave up on rank 0 and left that in the store; job 2's rank 0 waits it out."""
    first = store.run_job(tmp_path, "job1", absent=[0])
    assert first[1]["error"] == "WarmupTimeoutError" and first[1]["missing_ranks"] == [0]
    assert "rank 0 did not reach the all-gather #1" in first[1]["message"]
    assert any(k.endswith("/join/verdict") for k in store.kcache_keys())
    store.forget_torch()
    second = store.run_job(tmp_path, "job2", timeout=PATIENT_S)
    assert_job_succeeded(second)


def test_under_torchrun_the_run_id_names_the_keys(store: LongLivedStore, tmp_path: Path) -> None:
    first = store.run_job(tmp_path, "job1", absent=[1], run_id="run-1")
    assert first[0]["error"] == "WarmupTimeoutError"
    run = hashlib.sha256(b"run-1").hexdigest()[:20]
    assert any(f"/kcache/collective/{GROUP}/run-{run}/0/verdict" in k for k in store.all_keys())
    assert not any("/join/" in k for k in store.all_keys())  # no join: the run id is shared
    store.forget_torch()
    second = store.run_job(tmp_path, "job2", run_id="run-2", timeout=PATIENT_S)
    assert_job_succeeded(second)


def test_a_garbage_verdict_in_the_store_is_reported_as_malformed_on_every_rank(
    store: LongLivedStore, tmp_path: Path
) -> None:
    run = hashlib.sha256(b"run-g").hexdigest()[:20]
    key = f"kcache/collective/{GROUP}/run-{run}/0/verdict"
    reports = store.run_job(
        tmp_path,
        "job",
        run_id="run-g",
        garbage={"key": key, "value": "not a verdict"},
        timeout=PATIENT_S,
    )
    assert not any(r["ok"] for r in reports)
    assert {r["error"] for r in reports} == {"WarmupError"}  # not a timeout
    assert len({r["message"] for r in reports}) == 1, reports
    message = reports[0]["message"]
    assert "malformed verdict b'not a verdict' for the all-gather #1" in message
    assert f"in the store (key '{key}')" in message
    assert "died" not in message and "timed out" not in message
    assert max(r["seconds"] for r in reports) < PATIENT_S / 2


# ---------------------------------------------------------------------- in one process
class Job:
    """A TCPStore for a test, a connection per member, members of one job each call."""

    def __init__(self) -> None:
        self.master = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10)
        )

    def members(self, n: int, timeout: float, run: str | None = None) -> list[StoreCollective]:
        """One job's members: fresh store connections, so fresh sessions (new processes)."""
        return [
            StoreCollective(
                dist.TCPStore(
                    "127.0.0.1", self.master.port, is_master=False, timeout=timedelta(seconds=10)
                ),
                rank=r,
                world_size=n,
                timeout=timeout,
                run=run,
            )
            for r in range(n)
        ]


def run_all(fns: list[Callable[[], Any]]) -> list[Any]:
    results: list[Any] = [None] * len(fns)

    def run(i: int) -> None:
        try:
            results[i] = fns[i]()
        except Exception as exc:
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
        assert not t.is_alive(), "a member hung"
    return results


def test_every_kind_of_stale_call_is_ignored_by_the_next_job() -> None:
    job = Job()
    three = hashlib.sha256(b"0,1,2").hexdigest()[:20]
    # Job A: member 2 never comes, so its call's verdict stays in the store.
    a = job.members(3, timeout=0.3)
    left = run_all([lambda: a[0].all_gather("a0"), lambda: a[1].all_gather("a1")])
    assert all(isinstance(e, WarmupTimeoutError) for e in left), left
    # Job B: member 0 never comes; the others give up on the join and say so.
    b = job.members(3, timeout=0.3)
    gave_up = run_all([lambda: b[1].all_gather("b1"), lambda: b[2].all_gather("b2")])
    assert len({str(e) for e in gave_up}) == 1 and "rank 0 did not reach" in str(gave_up[0])
    # Job C crashed mid-call: its run, an open gather with two arrivals, a welcome.
    stale = f"kcache/collective/{three}/nonce-crashed/"
    job.master.set(f"kcache/collective/{three}/join/run", "nonce-crashed")
    job.master.set(f"kcache/collective/{three}/join/welcome/1", "0123 nonce-crashed")
    for m in (0, 1):
        job.master.set(f"{stale}0/part/{m}", json.dumps(f"c{m}"))
    job.master.add(f"{stale}0/arrived", 2)
    # Job D, everyone present, the leader last: every call of it succeeds, promptly.
    d = job.members(3, timeout=PATIENT_S)
    started = time.monotonic()
    for round_ in range(3):
        got = run_all([lambda m=m, n=round_: m.all_gather([m.rank, n]) for m in reversed(d)])
        assert got == [[[r, round_] for r in range(3)]] * 3, got
    # The leader waited only for job B's marks to clear, not its timeout out.
    assert time.monotonic() - started < PATIENT_S / 2
    assert int(job.master.add(f"{stale}0/arrived", 0)) == 2  # job C's call was never touched


def test_a_garbage_verdict_reaches_warmup_as_malformed_not_as_a_dead_rank() -> None:
    job = Job()
    members = job.members(2, timeout=5.0, run="job-42")
    key = f"{members[0].call_prefix(0)}verdict"
    job.master.set(key, "{oops")
    recipes = [recipe("garbage_a")]
    errors = run_all(
        [lambda m=m: warmup(StubCache(m.rank), recipes, group=m, timeout=5.0) for m in members]
    )
    assert all(type(e) is WarmupError for e in errors), errors
    assert len({str(e) for e in errors}) == 1
    assert (
        f"malformed verdict b'{{oops' for the all-gather #1 over ranks [0, 1] in the store (key '{key}')"
        in str(errors[0])
    )
    assert errors[0].kind == "MalformedVerdict"
