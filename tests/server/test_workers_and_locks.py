"""The compile worker pool (timeouts, crashes, the bounded queue) and PostgreSQL advisory locks."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kcache.errors import CompileTimeoutError, LockTimeoutError, ToolchainError
from kcache.include_sets import IncludeSets
from kcache.recipe import Recipe
from kcache.toolchain import load_toolchain
from tests.support import NEVER_FINISHES, unique, upgrade, vector_add, wait_until


def _pool(tmp_path: Path, **kwargs: object):  # type: ignore[no-untyped-def]
    from kcache_server.compile_pool import ProcessPoolCompiler

    options: dict[str, object] = {
        "workers": 1,
        "timeout_s": 30.0,
        "memory_mb": 8192,
        "queue_limit": 0,
    }
    options.update(kwargs)
    return ProcessPoolCompiler(load_toolchain(), IncludeSets(), tmp_dir=tmp_path / "tmp", **options)  # type: ignore[arg-type]


def _wait_until_compiling(scratch: Path) -> None:
    """Until the worker with this scratch directory is inside NVRTC.

    A compile makes its trace directory (``kcache-trace-*``, in the worker's ``TMPDIR``)
    just before it calls NVRTC, and removes it when the compile ends.
    """
    wait_until(lambda: any(scratch.glob("kcache-trace-*")), "the worker to start compiling")


def _recipe(source: str) -> Recipe:
    return Recipe(source=source, target="sm_80", toolchain=load_toolchain().id)


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[object]:
    p = _pool(tmp_path, timeout_s=30.0)
    p.start()
    yield p
    p.close()


def test_a_crashing_worker_fails_one_compile_and_is_replaced(pool) -> None:  # type: ignore[no-untyped-def]
    from kcache_server.errors import CompileWorkerCrashedError

    errors: list[BaseException] = []

    def compile_slow() -> None:
        try:
            pool.compile(_recipe(f"// {unique()}\n{NEVER_FINISHES}"))
        except BaseException as exc:
            errors.append(exc)

    worker = next(iter(pool._all))
    thread = threading.Thread(target=compile_slow)
    thread.start()
    _wait_until_compiling(worker.scratch)
    os.kill(worker.process.pid, signal.SIGKILL)  # what a segfault in NVRTC looks like from outside
    thread.join(timeout=30)
    assert len(errors) == 1 and isinstance(errors[0], CompileWorkerCrashedError)
    assert "died while compiling" in str(errors[0])
    output = pool.compile(_recipe(vector_add(unique())["source"]))
    assert output.data.startswith(b"\x7fELF") and pool.restarts == 1


def test_timeout_kills_the_worker_and_the_queue_is_bounded(tmp_path: Path) -> None:
    from kcache_server.errors import OverloadedError

    pool = _pool(tmp_path, timeout_s=2.0, queue_limit=0)
    pool.start()
    try:
        results: list[BaseException] = []

        def compile_slow() -> None:
            try:
                pool.compile(_recipe(NEVER_FINISHES))
            except BaseException as exc:
                results.append(exc)

        thread = threading.Thread(target=compile_slow)
        thread.start()
        wait_until(lambda: pool.pending == 1, "the slow compile to take the one worker")
        with pytest.raises(
            OverloadedError
        ) as overloaded:  # one worker busy, no queue: refused at once
            pool.compile(_recipe(vector_add(unique())["source"]))
        assert overloaded.value.retry_after == 5 and "compile_queue_limit=0" in str(
            overloaded.value
        )
        thread.join(timeout=30)
        assert isinstance(results[0], CompileTimeoutError)
        assert pool.compile(_recipe(vector_add(unique())["source"])).data.startswith(b"\x7fELF")
    finally:
        pool.close()


def test_workers_are_handed_out_in_turn_across_callers(tmp_path: Path) -> None:
    """One worker; caller A queues two never-finishing compiles, then B one good one: B goes second."""
    from kcache_server.errors import OverloadedError
    from kcache_server.fairness import current_caller

    pool = _pool(tmp_path, timeout_s=2.0, queue_limit=8, caller_queue_limit=1)
    pool.start()
    finished: list[str] = []
    outcomes: dict[str, BaseException | None] = {}

    def compile_as(caller: str, name: str, source: str) -> None:
        current_caller.set(caller)  # a new thread starts with an empty context
        try:
            pool.compile(_recipe(source))
            outcomes[name] = None
        except BaseException as exc:
            outcomes[name] = exc
        finished.append(name)

    def start(caller: str, name: str, source: str, pending: int) -> threading.Thread:
        thread = threading.Thread(target=compile_as, args=(caller, name, source))
        thread.start()
        wait_until(
            lambda: pool.pending >= pending or not thread.is_alive(),
            f"{name} to be running or queued",
            timeout=30,
        )
        return thread

    try:
        threads = [
            start("token:a", "a1", f"// {unique()}\n{NEVER_FINISHES}", 1),
            start("token:a", "a2", f"// {unique()}\n{NEVER_FINISHES}", 2),
        ]
        # A holds its one worker and has its one queued compile: a third is refused at once.
        compile_as("token:a", "a3", f"// {unique()}\n{NEVER_FINISHES}")
        refused = outcomes["a3"]
        assert isinstance(refused, OverloadedError) and "compile_caller_queue_limit=1" in str(
            refused
        )
        threads.append(start("token:b", "b1", vector_add(unique())["source"], 3))
        for thread in threads:
            thread.join(timeout=60)
        assert finished == ["a3", "a1", "b1", "a2"]  # FIFO would have served a2 before b1
        assert isinstance(outcomes["a1"], CompileTimeoutError) and outcomes["b1"] is None
    finally:
        pool.close()


def test_a_memory_limit_too_small_for_nvrtc_says_so(tmp_path: Path) -> None:
    pool = _pool(tmp_path, memory_mb=256)
    with pytest.raises(ToolchainError, match="compile_memory_mb=256"):
        pool.start()
    pool.close()


@pytest.mark.postgres
def test_pg_advisory_lock_reports_waiting_and_times_out(pg_url: str) -> None:
    from kcache_server.db import open_database
    from kcache_server.locks import PgAdvisoryKeyLock, advisory_id

    upgrade(pg_url)
    engine = open_database(pg_url)
    # Two lock objects on separate pools behave like two replicas.
    other = open_database(pg_url)
    first, second = PgAdvisoryKeyLock(engine), PgAdvisoryKeyLock(other)
    key = "ab" * 32
    assert advisory_id(key) == advisory_id(key) and -(2**63) <= advisory_id(key) < 2**63
    try:
        with first.hold(key, 5) as waited:
            assert waited is False
            started = time.monotonic()
            with pytest.raises(LockTimeoutError), second.hold(key, 0.5):
                pass
            assert 0.4 < time.monotonic() - started < 5
            outcome: list[bool] = []
            waiter = threading.Thread(target=lambda: outcome.append(_hold(second, key)))
            waiter.start()
            wait_until(lambda: _advisory_waiters(engine) == 1, "the second holder to wait")
        waiter.join(timeout=10)
        assert outcome == [True]  # it had to wait for the first holder
        with second.hold(key, 1) as waited:
            assert waited is False  # released again
    finally:
        engine.dispose()
        other.dispose()


def _advisory_waiters(engine: Any) -> int:
    """Sessions of this database waiting for an advisory lock another session holds."""
    import sqlalchemy as sa

    with engine.connect() as conn:
        return int(
            conn.execute(
                sa.text(
                    "SELECT count(*) FROM pg_locks l JOIN pg_database d ON d.oid = l.database"
                    " WHERE l.locktype = 'advisory' AND NOT l.granted"
                    " AND d.datname = current_database()"
                )
            ).scalar_one()
        )


def _hold(lock: object, key: str) -> bool:
    with lock.hold(key, 10) as waited:  # type: ignore[attr-defined]
        return bool(waited)
