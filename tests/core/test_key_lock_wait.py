"""FileKeyLock's wait: polled with a growing pause, bounded by the timeout."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from kcache.errors import LockTimeoutError
from kcache.locks import FileKeyLock

KEY = "ab" * 32


def test_a_waiter_gets_the_lock_once_released_and_says_it_waited(tmp_path: Path) -> None:
    holder, waiter = FileKeyLock(tmp_path), FileKeyLock(tmp_path, poll_s=0.001)
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with holder.hold(KEY, timeout=5) as waited:
            assert waited is False
            held.set()
            release.wait(10)

    thread = threading.Thread(target=hold)
    thread.start()
    assert held.wait(10)
    threading.Timer(0.05, release.set).start()
    with waiter.hold(KEY, timeout=30) as waited:
        assert waited is True
        assert release.is_set()  # not before the holder let go
    thread.join()


def test_a_waiter_gives_up_after_its_timeout(tmp_path: Path) -> None:
    holder, waiter = FileKeyLock(tmp_path), FileKeyLock(tmp_path, poll_s=0.001)
    with holder.hold(KEY, timeout=5), pytest.raises(LockTimeoutError, match="waited"):  # noqa: SIM117
        with waiter.hold(KEY, timeout=0.2):
            pass
    with waiter.hold(KEY, timeout=0.2) as waited:  # free again
        assert waited is False
