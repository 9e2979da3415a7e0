"""Cooperating-writer locks: one compile per key instead of one per process.

A lock here only avoids duplicate work. Correctness never depends on it: blobs
are published atomically under their digest and index files by atomic rename,
so two writers that both compile (a filesystem that grants flock to everyone, a
lock that timed out) publish the same bytes under the same name.

``KeyLock.hold(key)`` is a context manager that yields ``waited``: True when
another holder had the key first (the caller then re-checks the index and, if
that holder published, reports ``waited`` instead of compiling).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol, runtime_checkable

import filelock

from kcache.errors import LockTimeoutError
from kcache.keys import require_hex_key

__all__ = ["FileKeyLock", "KeyLock", "SingleFlight", "try_file_lock"]


@runtime_checkable
class KeyLock(Protocol):
    """An exclusive lock per key, shared by cooperating writers."""

    def hold(self, key: str, timeout: float) -> contextlib.AbstractContextManager[bool]:
        """Hold the lock for ``key``; yields True if someone else held it first.

        Raises LockTimeoutError after ``timeout`` seconds.
        """
        ...


class SingleFlight:
    """In-process single-flight: threads asking for the same key queue on one lock.

    Wraps a cross-process ``KeyLock`` (or none), so that within one process only one
    thread contends for the file or database lock and the rest wait in memory.
    """

    def __init__(self, inner: KeyLock | None = None) -> None:
        self._inner = inner
        self._guard = threading.Lock()
        self._locks: dict[str, tuple[threading.Lock, int]] = {}

    @contextlib.contextmanager
    def hold(self, key: str, timeout: float) -> Iterator[bool]:
        """Hold ``key`` in this process, then across processes through the inner lock."""
        with self._guard:
            lock, users = self._locks.get(key, (threading.Lock(), 0))
            self._locks[key] = (lock, users + 1)
        try:
            waited = not lock.acquire(blocking=False)
            if waited and not lock.acquire(timeout=timeout):
                raise LockTimeoutError(f"waited {timeout:.0f}s for another compile of {key}")
            try:
                if self._inner is None:
                    yield waited
                else:
                    with self._inner.hold(key, timeout) as inner_waited:
                        yield waited or inner_waited
            finally:
                lock.release()
        finally:
            with self._guard:
                lock, users = self._locks[key]
                if users == 1:
                    del self._locks[key]
                else:
                    self._locks[key] = (lock, users - 1)


class FileKeyLock:
    """``flock`` per key under ``<root>/locks/ab/<key>.lock`` (released by the kernel on SIGKILL)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root) / "locks"
        self.root.mkdir(parents=True, exist_ok=True)

    @contextlib.contextmanager
    def hold(self, key: str, timeout: float) -> Iterator[bool]:
        """Try without blocking first, so the caller learns whether it waited."""
        require_hex_key(key, "key")
        path = self.root / key[:2] / f"{key}.lock"
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = filelock.FileLock(str(path), thread_local=False)
        waited = False
        try:
            lock.acquire(timeout=0)
        except filelock.Timeout:
            waited = True
            try:
                lock.acquire(timeout=timeout)
            except filelock.Timeout as exc:
                raise LockTimeoutError(f"waited {timeout:.0f}s for the lock {path}") from exc
        try:
            yield waited
        finally:
            lock.release()


@contextlib.contextmanager
def try_file_lock(path: Path, wait_s: float) -> Iterator[bool]:
    """Hold the file lock at ``path`` across processes: yields True while held, False when it
    was not had within ``wait_s`` (the caller then leaves the work to the holder)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = filelock.FileLock(str(path), thread_local=False)
    try:
        lock.acquire(timeout=wait_s)
    except filelock.Timeout:
        yield False
        return
    try:
        yield True
    finally:
        lock.release()
