"""FileKeyLock.hold_unless: a waiter takes what the holder published without the lock,
and takes the lock only when the holder let go (or died) without publishing.

Each case runs twice: waiting for the holder to let go (a pool thread blocked in
``fcntl``), and watching the directory the result is renamed into (``where``, inotify).
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
from tests.support import wait_until

KEY = "ab" * 32
WAYS = ["lock", "watch"]


def _where(tmp_path: Path, way: str) -> str | None:
    """The directory a holder renames its result into (``watch``), or None (``lock``)."""
    if way == "lock":
        return None
    results = tmp_path / "results"
    results.mkdir(exist_ok=True)
    return str(results)


def _publish(where: str | None, published: list[str]) -> None:
    """What a tier's holder does: the result, renamed into its directory."""
    published.append("entry")
    if where is not None:
        staging = Path(where) / ".staging"
        staging.write_text("entry")
        os.replace(staging, Path(where) / "entry")


def _free_now(root: Path) -> bool:
    """True when another holder could take KEY's lock at once (never waits long)."""
    with FileKeyLock(root).hold(KEY, timeout=5) as waited:
        return not waited


def test_a_free_lock_is_held_and_nothing_is_looked_up(tmp_path: Path) -> None:
    looks: list[int] = []
    with FileKeyLock(tmp_path).hold_unless(KEY, 5, lambda: looks.append(1)) as found:
        assert found is None
        # Held: another process's lock on the same file (filelock, as the server's) must wait.
        other = subprocess.run(
            [sys.executable, "-c", _TRY_ONCE, str(tmp_path), KEY], capture_output=True, text=True
        )
        assert other.stdout.strip() == "busy", other.stderr
    assert looks == []
    assert _free_now(tmp_path)


@pytest.mark.parametrize("way", WAYS)
def test_a_waiter_returns_what_the_holder_published_without_taking_the_lock(
    tmp_path: Path, way: str
) -> None:
    published: list[str] = []
    held, release, let_go = threading.Event(), threading.Event(), threading.Event()
    where = _where(tmp_path, way)

    def holder() -> None:
        with FileKeyLock(tmp_path).hold(KEY, timeout=5):
            held.set()
            release.wait(10)
            _publish(where, published)  # published before letting go, as the tier does
            if way == "watch":
                let_go.wait(60)  # ... and held on: only the rename can wake the waiter

    thread = threading.Thread(target=holder)
    thread.start()
    assert held.wait(10)
    threading.Timer(0.05, release.set).start()
    with FileKeyLock(tmp_path).hold_unless(
        KEY, 30, lambda: published[0] if published else None, where
    ) as found:
        assert found == "entry"
        if way == "lock":
            # The waiter does not hold the lock while it uses the entry.
            assert _free_now(tmp_path)
    let_go.set()
    thread.join()


@pytest.mark.parametrize("way", WAYS)
def test_a_holder_that_dies_without_publishing_hands_the_lock_to_a_waiter(
    tmp_path: Path, way: str
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
        where = _where(tmp_path, way)
        with FileKeyLock(tmp_path).hold_unless(KEY, 30, lambda: None, where) as found:
            assert found is None  # nothing published: the waiter holds the lock now
            assert holder.wait(10) == -signal.SIGKILL
            other = subprocess.run(
                [sys.executable, "-c", _TRY_ONCE, str(tmp_path), KEY],
                capture_output=True,
                text=True,
            )
            assert other.stdout.strip() == "busy", other.stderr
    finally:
        holder.kill()
        holder.wait()
    assert _free_now(tmp_path)


@pytest.mark.parametrize("way", WAYS)
def test_a_waiter_gives_up_after_its_timeout_and_leaves_no_lock_behind(
    tmp_path: Path, way: str
) -> None:
    where = _where(tmp_path, way)
    with FileKeyLock(tmp_path).hold(KEY, timeout=5):  # noqa: SIM117
        with pytest.raises(LockTimeoutError, match="waited"):
            with FileKeyLock(tmp_path).hold_unless(KEY, 0.2, lambda: None, where):
                pass
    # The abandoned wait drops its shared lock once the holder lets go.
    with FileKeyLock(tmp_path).hold_unless(KEY, 5, lambda: "late") as found:
        assert found in (None, "late")
    # The abandoned wait's thread closes its descriptor as soon as its flock returns,
    # not at once: under load that is a moment after the holder lets go.
    wait_until(lambda: _free_now(tmp_path), "the abandoned wait to drop its shared lock", 10)


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
        with FileKeyLock(sys.argv[1]).hold(sys.argv[2], timeout=0.2):
            print("free")
    except LockTimeoutError:
        print("busy")
    """
)
