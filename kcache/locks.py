"""Cooperating-writer locks: one compile per key instead of one per process.

A lock here only avoids duplicate work. Correctness never depends on it: blobs
are published atomically under their digest and index files by atomic rename,
so two writers that both compile (a filesystem that grants locks to everyone, a
lock that timed out) publish the same bytes under the same name.

``KeyLock.hold(key)`` is a context manager that yields ``waited``: True when
another holder had the key first (the caller then re-checks the index and, if
that holder published, reports ``waited`` instead of compiling).

``FileKeyLock`` locks one file per key, ``<root>/locks/<key>.lock``, with ``filelock``'s
``flock`` of a descriptor (``lock_descriptor``), which the kernel drops when its holder
dies (a forked child closes its copy of a held descriptor). The holder removes its
file before it lets go, so ``locks/`` holds the keys being worked on now, not one file
per key ever fetched; a lock taken on a file removed meanwhile (no links left) counts
as not had, so a waiter never holds a removed file. A lock file is writable by whoever
may create files in ``locks/`` (``0666`` in a shared ``1777`` tier: every user's
processes open it). Where no lock can be had (a filesystem without ``flock``, a file
this user may not open, a link planted in its place) the caller goes ahead as the
holder: at worst a kernel is made twice. (Earlier releases locked a byte per key of
``locks/keys.lock``: while both run on one node they do not exclude each other, which
also costs duplicate work only.) A holder whose result is visible already may let go
before its block ends (``let_go``).

``FileKeyLock.hold_unless(key, timeout, published)`` is for waiters that can see the
holder's result without the lock (a node tier: entries are published by atomic
rename and every read verifies): it yields what ``published()`` found while
waiting, with the lock never taken, or None once the lock is held. Waiters that took
the lock only to find the entry went through it one after another, a convoy that
cost a rank more than its own fetch.

A waiter naps, 5 ms first (a few of a node's fetches from the server), half as long again
each time up to 50 ms (a compile takes seconds: a few percent more at most), and looks
(``published()``) after every nap; it tries the lock once the key's file is gone (its
holder removes it as it lets go, right after publishing) or at the longest naps (a holder
that died and left its file). A caller's ``idle`` work (a node tier's records of its own
earlier publishes) is done in place of the naps, never past a nap's end. A caller may
also ask to look before it tries the lock (``defer``): one nap first, then as a waiter
(a rank that expects the rank it follows to claim the key in a moment). Naps longer than
a fetch are what ranks asking for the same kernels in the same order want: the one
fetching goes on to the next kernel without waiting for anyone, and a waiter that wakes
finds several published and reads them back to back, so it wakes a few times per job
rather than once or more per kernel, and ends about one nap after the fetcher. (B8, eight
ranks on two cores, bench/RESULTS.md: 1 ms first naps doubled, or waking each waiter the
moment its holder let go, cost 1.5-2 times the CPU and made the fetcher's chain wait for
the cores; a waiter that saw only the key's file, not the entry, napped on while another
rank held the lock of a kernel already published for a moment; a former fetcher's records
of two dozen publishes, written whole before its first look, kept its last kernel 5-30 ms.)
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
from kcache.fsutil import make_dirs
from kcache.keys import require_hex_key

__all__ = ["FileKeyLock", "KeyLock", "SingleFlight", "try_file_lock"]

T = TypeVar("T")

# A waiter's first nap between looks for a key's entry, grown by _NAP_GROWTH up to the last.
_FIRST_NAP_S = 0.005
_LAST_NAP_S = 0.05
_NAP_GROWTH = 1.5
# try_file_lock: the pause between tries while another process holds the lock.
_FILE_LOCK_POLL_S = 0.05
# Errors that mean no lock is to be had here: go ahead as if it were (ENOSYS: no flock on
# this filesystem; EACCES/EPERM: a file or directory not writable here; ELOOP/EISDIR: a
# link or a directory where a key's file goes, which another user of a shared tier can make;
# ENOTDIR: a file where the locks' directory goes, a damaged tier).
_NO_LOCKS = frozenset(
    {
        errno.ENOTDIR,
        errno.ENOLCK,
        errno.ENOSYS,
        errno.EOPNOTSUPP,
        errno.EINVAL,
        errno.EACCES,
        errno.EPERM,
        errno.ELOOP,
        errno.EISDIR,
    }
)


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
        self,
        key: str,
        timeout: float,
        published: Callable[[], T | None],
        idle: Callable[[float], None] | None = None,
        *,
        defer: bool = False,
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
            with looking(key, timeout, published, idle, defer=defer) as found:
                yield found

    def let_go(self, key: str) -> None:
        """:meth:`FileKeyLock.let_go` of the inner lock (nothing for one without it).

        Threads of this process still wait in memory until the holder's block ends.
        """
        inner_let_go = getattr(self._inner, "let_go", None)
        if inner_let_go is not None:
            inner_let_go(key)

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
    """An exclusive lock per key across processes, under ``<root>/locks`` (see the module docstring).

    Released by the kernel when the holder dies (SIGKILL included).
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        locks = os.path.join(root, "locks")  # strings, one Path: every KernelCache() makes one
        make_dirs(locks)
        self.root = Path(locks)
        self._dir = locks
        # key -> (thread, its key file) for the locks held through this object (let_go).
        self._held: dict[str, tuple[int, _KeyFile]] = {}
        self._held_guard = threading.Lock()

    def path(self, key: str) -> str:
        """The lock file of ``key`` (there while someone holds it, or left by one that died)."""
        return f"{self._dir}/{require_hex_key(key, 'key')}.lock"

    def let_go(self, key: str) -> None:
        """Let go of ``key`` now, before the holding block ends, if this thread holds it here.

        For a holder that has made its result visible (a node tier that wrote the
        entry's alias) and has only bookkeeping left: the waiters may go on at once.
        """
        with self._held_guard:
            held = self._held.get(key)
            if held is None or held[0] != threading.get_ident():
                return
            del self._held[key]
        held[1].give_up()

    @contextlib.contextmanager
    def hold(self, key: str, timeout: float) -> Iterator[bool]:
        """Try without waiting first, so the caller learns whether it waited."""
        lock = _KeyFile(self.path(key), self._dir)
        waited = not lock.take()
        if waited:
            self._outwait(lock, key, timeout, None)
        with self._holding(key, lock):
            yield waited

    @contextlib.contextmanager
    def hold_unless(
        self,
        key: str,
        timeout: float,
        published: Callable[[], T | None],
        idle: Callable[[float], None] | None = None,
        *,
        defer: bool = False,
    ) -> Iterator[T | None]:
        """Hold ``key``'s lock, unless ``published()`` finds the holder's result first.

        Yields None with the lock held (free at once, or once the holder let go without
        publishing: it failed, or died and the kernel released its lock), or what
        ``published()`` returned while this process waited, with the lock never taken.
        A waiter looks (``published()``, which must need no lock) before each try of
        the lock: the holder publishes before it lets go, so the waiters find the
        entry instead of passing through the lock one after another. ``idle(until)``, if
        given, is work of the caller's own done in place of each nap, up to the monotonic
        time ``until`` at most (the rest of the nap is slept). With ``defer`` the lock is
        not tried at once: the first try comes after a nap and a look, as a waiter's
        would (a caller that expects another process to claim the key in a moment).
        Raises LockTimeoutError after ``timeout``.
        """
        lock = _KeyFile(self.path(key), self._dir)
        if defer or not lock.take():
            found = self._outwait(lock, key, timeout, published, idle)
            if found is not None:
                yield found
                return
        with self._holding(key, lock):
            yield None

    def _outwait(
        self,
        lock: _KeyFile,
        key: str,
        timeout: float,
        published: Callable[[], T | None] | None,
        idle: Callable[[float], None] | None = None,
    ) -> T | None:
        """Nap (or do ``idle``'s work) and look until ``lock`` is had (None) or
        ``published()`` finds the result."""
        deadline = time.monotonic() + timeout
        nap = _FIRST_NAP_S
        while True:
            now = time.monotonic()
            left = deadline - now
            if left <= 0:
                raise LockTimeoutError(
                    f"waited {timeout:.0f}s for the lock of {key} in {self._dir}"
                )
            wake = now + min(nap, left)
            if idle is not None:
                idle(wake)
            rest = wake - time.monotonic()
            if rest > 0:
                time.sleep(rest)
            longest = nap >= _LAST_NAP_S
            nap = min(_NAP_GROWTH * nap, _LAST_NAP_S)
            if published is not None:  # the holder publishes before it lets go: look first
                found = published()
                if found is not None:
                    return found
            if not longest and os.path.exists(lock.path):
                continue  # held still: its holder removes the file as it lets go
            if lock.take():
                return None

    @contextlib.contextmanager
    def _holding(self, key: str, lock: _KeyFile) -> Iterator[None]:
        """Note ``lock`` as this thread's for :meth:`let_go` while the caller's block runs."""
        with self._held_guard:
            self._held[key] = (threading.get_ident(), lock)
        try:
            yield
        finally:
            with self._held_guard:
                if key in self._held and self._held[key][1] is lock:
                    del self._held[key]
            lock.give_up()  # nothing if let go already


class _KeyFile:
    """One key's lock file, locked through a descriptor of its own (two threads of one
    process exclude each other as two processes do) with ``filelock.lock_descriptor``:
    the ``flock`` that filelock's ``FileLock`` takes, without its acquire's bookkeeping
    (120-350 us a try, which tripled what B8's eight ranks spent on the lock)."""

    def __init__(self, path: str, directory: str) -> None:
        self.path = path
        self._dir = directory
        self._fd: int | None = None

    def take(self) -> bool:
        """Take the lock if no one holds it; True also where no lock is to be had (_NO_LOCKS)."""
        try:
            fd = _open_key_file(self.path, self._dir)
        except OSError as exc:
            if exc.errno in _NO_LOCKS:
                return True
            raise
        try:
            # A file its holder removed meanwhile is no one's lock any more: try again later.
            if not filelock.lock_descriptor(fd, blocking=False) or os.fstat(fd).st_nlink == 0:
                os.close(fd)
                return False
        except OSError as exc:
            os.close(fd)
            if exc.errno in _NO_LOCKS:
                return True
            raise
        self._fd = fd
        _HELD.add(self)
        return True

    def give_up(self) -> None:
        """Remove the file, if it is still the one held, and let go (nothing if not held)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        _HELD.discard(self)
        try:
            with contextlib.suppress(OSError):
                if os.path.samestat(os.lstat(self.path), os.fstat(fd)):
                    os.unlink(self.path)
            with contextlib.suppress(OSError):  # not only the close: a forked child shares fd
                filelock.unlock_descriptor(fd)
        finally:
            os.close(fd)


def _open_key_file(path: str, directory: str) -> int:
    """A descriptor of ``path``, made if absent with ``0644`` plus ``directory``'s write bits."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags | os.O_EXCL, 0o644)
    except FileExistsError:
        return os.open(path, flags)
    except FileNotFoundError:  # the directory was removed (a cleared cache)
        make_dirs(directory)
        fd = os.open(path, flags | os.O_EXCL, 0o644)
    with contextlib.suppress(OSError):  # not the umask's: others open it too in a shared tier
        os.fchmod(fd, _lock_file_mode(directory))
    return fd


#: The key files held in this process: a forked child closes its copies of their
#: descriptors (and holds none), so that a lock goes when its holder dies even while the
#: child lives on.
_HELD: set[_KeyFile] = set()


def _close_held_in_child() -> None:
    for held in _HELD:
        fd, held._fd = held._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_held_in_child)


def _lock_file_mode(directory: str) -> int:
    """``0644`` plus ``directory``'s group and other write bits: whoever may make a key's lock
    file there may open another's (a shared ``1777`` tier's are ``0666``)."""
    try:
        return 0o644 | (os.stat(directory).st_mode & 0o022)
    except OSError:
        return 0o644


@contextlib.contextmanager
def try_file_lock(path: Path, wait_s: float) -> Iterator[bool]:
    """Hold the file lock at ``path`` across processes: yields True while held, False when it
    was not had within ``wait_s`` (the caller then leaves the work to the holder).

    A ``flock`` of the file through ``filelock.lock_descriptor``, as ``filelock.FileLock``
    takes it (the two exclude each other, so releases that used ``FileLock`` here share
    the lock), without its bookkeeping: a node tier's first publish in each process asks
    for its eviction lock, and ``FileLock`` cost 0.2-0.5 ms of CPU per call. Released
    when the block ends or the holder dies.
    """
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o644)
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, flags, 0o644)
    try:
        deadline = time.monotonic() + wait_s
        while not filelock.lock_descriptor(fd, blocking=False):
            left = deadline - time.monotonic()
            if left <= 0:
                yield False
                return
            time.sleep(min(_FILE_LOCK_POLL_S, left))
        yield True
    finally:
        os.close(fd)  # releases the lock, if it was had
