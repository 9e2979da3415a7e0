"""FileKeyLock.hold_unless: a waiter takes what the holder published without the lock,
and takes the lock only when the holder let go (or died) without publishing.

A waiter looks (``published()``) between tries of the lock, so it finds the holder's
result while the holder still holds the key; it never queues behind the holder to read it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from kcache.errors import LockTimeoutError
from kcache.locks import FileKeyLock, SingleFlight

KEY = "ab" * 32


def _free_now(root: Path) -> bool:
    """True when another holder could take KEY's lock at once (never waits long)."""
    with FileKeyLock(root).hold(KEY, timeout=5) as waited:
        return not waited


def _other_process_finds(root: Path) -> str:
    """What another process gets when it tries KEY once: "free" or "busy"."""
    other = subprocess.run(
        [sys.executable, "-c", _TRY_ONCE, str(root), KEY], capture_output=True, text=True
    )
    assert other.stdout.strip() in ("free", "busy"), other.stderr
    return other.stdout.strip()


def test_a_free_lock_is_held_and_nothing_is_looked_up(tmp_path: Path) -> None:
    looks: list[int] = []
    with FileKeyLock(tmp_path).hold_unless(KEY, 5, lambda: looks.append(1)) as found:
        assert found is None
        assert _other_process_finds(tmp_path) == "busy"  # held across processes
    assert looks == []
    assert _free_now(tmp_path)


def test_a_waiter_returns_what_the_holder_published_while_the_holder_still_holds(
    tmp_path: Path,
) -> None:
    published: list[str] = []
    held, release, let_go = threading.Event(), threading.Event(), threading.Event()

    def holder() -> None:
        with FileKeyLock(tmp_path).hold(KEY, timeout=5):
            held.set()
            release.wait(10)
            published.append("entry")  # published, and held on: the waiter must look
            let_go.wait(60)

    thread = threading.Thread(target=holder)
    thread.start()
    try:
        assert held.wait(10)
        threading.Timer(0.05, release.set).start()
        with FileKeyLock(tmp_path).hold_unless(
            KEY, 30, lambda: published[0] if published else None
        ) as found:
            assert found == "entry"
            assert _other_process_finds(tmp_path) == "busy"  # the holder's, not the waiter's
    finally:
        let_go.set()
        thread.join()
    assert _free_now(tmp_path)


def test_a_holder_that_dies_without_publishing_hands_the_lock_to_a_waiter(
    tmp_path: Path,
) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD_FOREVER, str(tmp_path), KEY],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "held"
        threading.Timer(0.1, os.kill, (holder.pid, signal.SIGKILL)).start()
        with FileKeyLock(tmp_path).hold_unless(KEY, 30, lambda: None) as found:
            assert found is None  # nothing published: the waiter holds the lock now
            assert holder.wait(10) == -signal.SIGKILL
            assert _other_process_finds(tmp_path) == "busy"
    finally:
        holder.kill()
        holder.wait()
    assert _free_now(tmp_path)


def test_a_waiter_gives_up_after_its_timeout_and_leaves_no_lock_behind(tmp_path: Path) -> None:
    with FileKeyLock(tmp_path).hold(KEY, timeout=5):
        with (
            pytest.raises(LockTimeoutError, match="waited"),
            FileKeyLock(tmp_path).hold_unless(KEY, 0.2, lambda: None),
        ):
            pass
        with pytest.raises(LockTimeoutError, match="waited"), FileKeyLock(tmp_path).hold(KEY, 0.1):
            pass
    assert _free_now(tmp_path)  # at once: nothing of the abandoned waits is left
    assert list((tmp_path / "locks").iterdir()) == []


def test_a_waiter_looks_after_every_nap_and_does_its_idle_work_in_place_of_the_naps(
    tmp_path: Path,
) -> None:
    """The key's file stays (its holder, or another waiter that took the lock for a moment,
    holds it): the waiter still looks after each nap, and finds the entry at the first look
    that can see it. Its ``idle`` work comes before each look, bounded by the nap's end."""
    import time

    calls: list[str] = []
    ends: list[float] = []

    def idle(until: float) -> None:
        assert until > time.monotonic()  # a bound still ahead: the nap's end
        ends.append(until)
        calls.append("idle")

    def published() -> str | None:
        calls.append("look")
        return "entry" if calls.count("look") == 3 else None

    waiter = SingleFlight(FileKeyLock(tmp_path))
    with (
        FileKeyLock(tmp_path).hold(KEY, timeout=5),  # held all along
        waiter.hold_unless(KEY, 30, published, idle) as found,
    ):
        assert found == "entry"
    assert calls == ["idle", "look"] * 3
    assert ends == sorted(ends)


def test_single_flight_threads_of_one_process_take_the_published_entry(tmp_path: Path) -> None:
    lock = SingleFlight(FileKeyLock(tmp_path))
    published: list[str] = []
    results: list[str | None] = []
    held = threading.Event()

    def first() -> None:
        with lock.hold_unless(KEY, 5, lambda: published[0] if published else None) as found:
            assert found is None
            held.set()
            threading.Event().wait(0.05)
            published.append("entry")

    def second() -> None:
        held.wait(10)
        with lock.hold_unless(KEY, 5, lambda: published[0] if published else None) as found:
            results.append(found)

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == ["entry"]


_HOLD_FOREVER = textwrap.dedent(
    """
    import sys, time
    from kcache.locks import FileKeyLock
    with FileKeyLock(sys.argv[1]).hold(sys.argv[2], timeout=5):
        print("held", flush=True)
        time.sleep(600)
    """
)
_TRY_ONCE = textwrap.dedent(
    """
    import sys
    from kcache.errors import LockTimeoutError
    from kcache.locks import FileKeyLock
    try:
        with FileKeyLock(sys.argv[1]).hold(sys.argv[2], timeout=0.05):
            print("free")
    except LockTimeoutError:
        print("busy")
    """
)
