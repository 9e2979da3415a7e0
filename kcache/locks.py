"""Cooperating-writer locks: one compile per key instead of one per process.

A lock here only avoids duplicate work. Correctness never depends on it: blobs
are published atomically under their digest and index files by atomic rename,
so two writers that both compile (a filesystem that grants flock to everyone, a
lock that timed out) publish the same bytes under the same name.

``KeyLock.hold(key)`` is a context manager that yields ``waited``: True when
another holder had the key first (the caller then re-checks the index and, if
that holder published, reports ``waited`` instead of compiling).

``FileKeyLock.hold_unless(key, timeout, published)`` is for waiters that can see the
holder's result without the lock (a node tier: entries are published by atomic
rename and every read verifies): it yields what ``published()`` found while
waiting, with the lock never taken, or None once the lock is held. Waiters that
took the lock only to find the entry there went through it one after another, a
convoy that cost a rank more than its own fetch.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol, TypeVar, runtime_checkable

import filelock

from kcache.errors import LockTimeoutError

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: hold_unless polls instead
    fcntl = None  # type: ignore[assignment]
from kcache.keys import require_hex_key

__all__ = ["FileKeyLock", "KeyLock", "SingleFlight", "try_file_lock"]

T = TypeVar("T")

# hold_unless: the pause before trying again when another waiter was quicker.
_RETRY_S = 0.001


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
        with self._local(key, timeout) as waited:
            if self._inner is None:
                yield waited
            else:
                with self._inner.hold(key, timeout) as inner_waited:
                    yield waited or inner_waited

    @contextlib.contextmanager
    def hold_unless(
        self, key: str, timeout: float, published: Callable[[], T | None]
    ) -> Iterator[T | None]:
        """:meth:`FileKeyLock.hold_unless` behind this process's own queue for ``key``.

        Threads of one process wait in memory as with :meth:`hold`; the one at the head
        of the queue waits for other processes through the inner lock's ``hold_unless``
        (its plain ``hold`` when it has none: the caller then looks under the lock).
        """
        with self._local(key, timeout) as waited:
            if waited:
                # Another thread of this process held the key: look before queueing again.
                found = published()
                if found is not None:
                    yield found
                    return
            inner = self._inner
            if inner is None:
                yield None
                return
            looking = getattr(inner, "hold_unless", None)  # FileKeyLock's; others only hold
            if looking is None:
                with inner.hold(key, timeout):
                    yield None
                return
            with looking(key, timeout, published) as found:
                yield found

    @contextlib.contextmanager
    def _local(self, key: str, timeout: float) -> Iterator[bool]:
        """The in-process lock of ``key``; yields whether another thread had it first."""
        with self._guard:
            lock, users = self._locks.get(key, (threading.Lock(), 0))
            self._locks[key] = (lock, users + 1)
        try:
            waited = not lock.acquire(blocking=False)
            if waited and not lock.acquire(timeout=timeout):
                raise LockTimeoutError(f"waited {timeout:.0f}s for another compile of {key}")
            try:
                yield waited
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

    def _lock_path(self, key: str) -> Path:
        require_hex_key(key, "key")
        path = self.root / key[:2] / f"{key}.lock"
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    @contextlib.contextmanager
    def hold(self, key: str, timeout: float) -> Iterator[bool]:
        """Try without blocking first, so the caller learns whether it waited."""
        path = self._lock_path(key)
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
    def hold_unless(
        self, key: str, timeout: float, published: Callable[[], T | None]
    ) -> Iterator[T | None]:
        """Hold ``key``'s lock, unless ``published()`` finds the holder's result first.

        Yields None with the lock held (free at once, or once the holder let go without
        publishing: it failed, or died and the kernel released its ``flock``), or what
        ``published()`` returned while this process waited, with the lock never taken.
        A waiter sleeps until the holder lets go, then looks (``published()``, which must
        need no lock) before it tries the lock: the holder publishes before it lets go,
        so the waiters find the entry, all at once, instead of passing through the lock
        one after another. Raises LockTimeoutError after ``timeout``.
        """
        path = self._lock_path(key)
        if fcntl is None:  # no flock here: the portable lock and a look under it
            with self.hold(key, timeout):
                yield None
            return
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            # flock directly, not filelock: its try costs ~100 us here against ~3 us, and a
            # node of ranks tries once per kernel each (it locks the same file with flock,
            # so the two exclude each other).
            if not _try_flock(fd):
                found = _wait_or_look(fd, path, timeout, published)
                if found is not None:
                    yield found
                    return
            yield None
        finally:
            os.close(fd)  # releases the lock


def _try_flock(fd: int) -> bool:
    """Take the exclusive flock of ``fd`` if free; True also where flock is unsupported.

    A filesystem without flock (ENOLCK, ENOSYS) gives no lock at all: the caller then
    goes ahead as the holder, and at worst the node downloads a kernel twice.
    """
    assert fcntl is not None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES):
            return False
        if exc.errno in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP):
            return True
        raise
    return True


def _wait_or_look(
    fd: int, path: Path, timeout: float, published: Callable[[], T | None]
) -> T | None:
    """What ``published()`` finds once the holder of ``fd``'s lock lets go, or None once it is had.

    The wait is a blocking shared ``flock`` of the same file (:class:`_Release`): no
    CPU while the holder works, and every waiter wakes at once when it lets go, since
    shared locks do not exclude each other. Then a look, and the lock only when the
    holder published nothing.
    """
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not _Release(str(path)).wait(left):
            raise LockTimeoutError(f"waited {timeout:.0f}s for the lock {path}")
        found = published()
        if found is not None:
            return found
        if _try_flock(fd):
            return None
        time.sleep(_RETRY_S)  # another waiter took it, or holds its shared lock a moment


class _Release:
    """A shared ``flock`` of a lock file, taken by a helper thread: ``flock`` has no timeout.

    The thread blocks in the kernel until the exclusive holder lets go (or dies). A
    waiter that gives up first leaves the descriptor to the thread, which closes it
    (releasing its shared lock at once) when its ``flock`` returns.
    """

    def __init__(self, path: str) -> None:
        assert fcntl is not None
        self._fd = os.open(path, os.O_RDONLY | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        self._done = threading.Event()
        self._guard = threading.Lock()
        self._abandoned = False
        threading.Thread(target=self._run, name="kcache-lock-wait", daemon=True).start()

    def _run(self) -> None:
        assert fcntl is not None
        with contextlib.suppress(OSError):  # no lock to wait on (ENOLCK): the caller just looks
            fcntl.flock(self._fd, fcntl.LOCK_SH)
        with self._guard:
            self._done.set()
            if not self._abandoned:
                return
        os.close(self._fd)

    def wait(self, timeout: float) -> bool:
        """True when the holder let go within ``timeout`` (the shared lock is dropped again)."""
        self._done.wait(timeout)
        with self._guard:
            if not self._done.is_set():
                self._abandoned = True
                return False
        os.close(self._fd)
        return True


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
