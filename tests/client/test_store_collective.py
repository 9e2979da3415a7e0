"""The warmup's collectives over a real TCPStore: agreement, bounded waits, the same error everywhere.

Each member is a thread with its own store connection (as each rank of a job has);
the multi-process tests in test_warmup_ranks.py drive the same code through torch.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest

dist = pytest.importorskip("torch.distributed")

from kcache_client import StoreCollective, WarmupTimeoutError  # noqa: E402


class Job:
    """A TCPStore server for one test, and a client connection per member."""

    def __init__(self) -> None:
        self.master = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10)
        )
        self.port = self.master.port

    def client(self) -> Any:
        return dist.TCPStore("127.0.0.1", self.port, is_master=False, timeout=timedelta(seconds=10))

    def members(
        self, n: int, timeout: float, job_ranks: list[int] | None = None
    ) -> list[StoreCollective]:
        return [
            StoreCollective(
                self.client(), rank=r, world_size=n, timeout=timeout, job_ranks=job_ranks
            )
            for r in range(n)
        ]


def run_all(fns: list[Callable[[], Any]]) -> list[Any]:
    """Run each member's part in its own thread; each result is a value or the exception raised."""
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


def late(seconds: float, fn: Callable[[], Any]) -> Callable[[], Any]:
    def call() -> Any:
        time.sleep(seconds)
        return fn()

    return call


def test_all_gather_and_broadcast_agree_under_skew_and_leave_no_keys() -> None:
    job = Job()
    members = job.members(4, timeout=10)
    rng = random.Random(18)
    for round_ in range(6):
        gathered = run_all(
            [
                late(
                    rng.uniform(0, 0.05), lambda m=m, n=round_: m.all_gather({"r": m.rank, "n": n})
                )
                for m in members
            ]
        )
        assert gathered == [[{"r": r, "n": round_} for r in range(4)]] * 4
        src = round_ % 4
        got = run_all(
            [
                late(rng.uniform(0, 0.05), lambda m=m, s=src: m.broadcast(f"from {m.rank}", s))
                for m in members
            ]
        )
        assert got == [f"from {src}"] * 4
    # The last member out of each call deleted its keys.
    assert job.master.num_keys() == 0


def test_a_member_that_never_arrives_is_named_and_everyone_raises_the_same() -> None:
    job = Job()
    members = job.members(3, timeout=0.5, job_ranks=[4, 5, 6])
    # Group rank 2 (job rank 6) arrives after the others' waits have run out.
    errors = run_all(
        [
            lambda: members[0].all_gather("a"),
            lambda: members[1].all_gather("b"),
            late(1.2, lambda: members[2].all_gather("c")),
        ]
    )
    assert all(isinstance(e, WarmupTimeoutError) for e in errors), errors
    assert len({str(e) for e in errors}) == 1  # the late member raises the verdict too
    assert {tuple(e.missing_ranks) for e in errors} == {(6,)}
    assert "rank 6 did not reach the all-gather" in str(errors[0])
    # Everyone left that call at the same point, so the next one works.
    assert run_all([lambda m=m: m.all_gather(m.rank) for m in members]) == [[0, 1, 2]] * 3


def test_a_source_that_never_broadcasts_fails_every_receiver_alike() -> None:
    job = Job()
    members = job.members(3, timeout=0.5)
    errors = run_all(
        [
            late(1.2, lambda: members[0].broadcast({"outcomes": {}}, 0)),  # the source, too late
            lambda: members[1].broadcast(None, 0),
            lambda: members[2].broadcast(None, 0),
        ]
    )
    assert all(isinstance(e, WarmupTimeoutError) for e in errors), errors
    assert len({str(e) for e in errors}) == 1
    assert errors[0].missing_ranks == [0]
    assert "rank 0 sent nothing in the broadcast" in str(errors[0])


def test_a_member_whose_wait_runs_out_as_the_last_arrives_still_agrees() -> None:
    # Race the last arrival against the deadline many times: whatever wins, every
    # member must see the same end (all values, or all the same error).
    job = Job()
    for i in range(12):
        members = job.members(2, timeout=0.2, job_ranks=[100 + i, 200 + i])
        results = run_all(
            [
                lambda m=members[0]: m.all_gather(0),
                late(0.2 + (i - 6) * 0.004, lambda m=members[1]: m.all_gather(1)),
            ]
        )
        if isinstance(results[0], Exception):
            assert [str(r) for r in results] == [str(results[0])] * 2
        else:
            assert results == [[0, 1], [0, 1]]


def test_the_store_dying_fails_every_member_with_the_same_error() -> None:
    job = Job()
    members = job.members(3, timeout=20)
    errors: list[Any] = []

    def receivers() -> None:
        errors.extend(run_all([lambda m=m: m.broadcast(None, 0) for m in members[1:]]))

    waiting = threading.Thread(target=receivers)
    started = time.monotonic()
    waiting.start()
    time.sleep(0.3)
    del job.master  # the store's host goes away while the receivers wait for rank 0
    waiting.join(30)
    assert not waiting.is_alive()
    assert all(isinstance(e, WarmupTimeoutError) for e in errors), errors
    assert len({str(e) for e in errors}) == 1
    assert "key-value store stopped answering during the broadcast" in str(errors[0])
    assert time.monotonic() - started < 20  # well before the timeout: nobody waited it out


def test_constructor_rejects_a_rank_outside_the_group() -> None:
    job = Job()
    with pytest.raises(ValueError, match="rank 3 is not in a group of 3"):
        StoreCollective(job.client(), rank=3, world_size=3, timeout=1)


def test_data_that_is_not_json_is_the_callers_error_not_a_timeout() -> None:
    job = Job()  # held: the store lives as long as its Job
    (member,) = job.members(1, timeout=1)
    with pytest.raises(TypeError):
        member.all_gather({1, 2})  # a set: JSON has none
    assert member.all_gather([1, 2]) == [[1, 2]]  # and the next call is unaffected
