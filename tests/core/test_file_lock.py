"""``try_file_lock``: one holder across processes, let go when the holder ends or dies."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import filelock

from kcache.locks import try_file_lock

HOLD = """
import sys, time
from pathlib import Path
from kcache.locks import try_file_lock
with try_file_lock(Path(sys.argv[1]), 0) as held:
    print("held" if held else "refused", flush=True)
    time.sleep(600)
"""


def _holder(path: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(path)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_another_process_holding_it_refuses_until_it_dies(tmp_path: Path) -> None:
    path = tmp_path / "locks" / "evict.lock"  # the directory is made on first use
    holder = _holder(path)
    try:
        with try_file_lock(path, 0) as held:
            assert held is False
        with try_file_lock(path, 0.2) as held:  # a short wait is not enough either
            assert held is False
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with try_file_lock(path, 0) as held:  # the kernel let go with the dead holder
        assert held is True
        with try_file_lock(path, 0) as again:  # exclusive even within one process
            assert again is False
    with try_file_lock(path, 0) as held:  # and the block's end let go
        assert held is True


WAIT = """
import sys
from pathlib import Path
from kcache.locks import try_file_lock
with try_file_lock(Path(sys.argv[1]), 0) as held:
    print(held, flush=True)
with try_file_lock(Path(sys.argv[1]), 60) as held:
    print(held, flush=True)
"""


def test_a_waiter_gets_it_once_the_holder_lets_go(tmp_path: Path) -> None:
    path = tmp_path / "evict.lock"
    holder = _holder(path)
    waiter = subprocess.Popen(
        [sys.executable, "-c", WAIT, str(path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert waiter.stdout is not None
        assert waiter.stdout.readline().strip() == "False"  # held: refused at once
    finally:
        holder.send_signal(signal.SIGTERM)
        holder.wait()
    out, _ = waiter.communicate(timeout=60)
    assert out.strip() == "True"  # ... and had, waiting, once the holder was gone


def test_it_excludes_filelock_holders_of_earlier_releases(tmp_path: Path) -> None:
    """Earlier releases took this lock with ``filelock``: both kinds exclude each other."""
    path = tmp_path / "evict.lock"
    older = filelock.FileLock(str(path), thread_local=False)
    older.acquire(timeout=0)
    try:
        with try_file_lock(path, 0) as held:
            assert held is False
    finally:
        older.release()
    with try_file_lock(path, 0) as held:
        assert held is True
        try:
            older.acquire(timeout=0)
            raise AssertionError("filelock took a lock try_file_lock holds")
        except filelock.Timeout:
            pass
