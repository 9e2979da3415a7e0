"""Cooperating-writer locks: one compile per key instead of one per process.

A lock here only avoids duplicate work. Correctness never depends on it: blobs
are published atomically under their digest and index files by atomic rename,
so two writers that both compile (a filesystem that grants locks to everyone, a
lock that timed out) publish the same bytes under the same name.

``KeyLock.hold(key)`` is a context manager that yields ``waited``: True when
another holder had the key first (the caller then re-checks the index and, if
that holder published, reports ``waited`` instead of compiling).

``FileKeyLock`` locks one byte per key of a single file, ``<root>/locks/keys.lock``,
with Linux's open-file-description (OFD) record locks: no file is created per key
(a cold node tier paid an inode creation, 0.1-0.4 ms on the benchmark machine's
ext4, for each kernel's lock file, and kept one file per key it ever fetched), and
the kernel drops a lock when its holder dies. Where OFD locks do not exist (not
Linux), a ``filelock`` file per key does the same. (Earlier releases flocked a file
per key: while both run on one node they do not exclude each other, which costs
duplicate work only.) A holder whose result is visible already may let go before
its block ends (``let_go``).

``FileKeyLock.hold_unless(key, timeout, published)`` is for waiters that can see the
holder's result without the lock (a node tier: entries are published by atomic
rename and every read verifies): it yields what ``published()`` found while
waiting, with the lock never taken, or None once the lock is held. Waiters that
took the lock only to find the entry went through it one after another, a convoy
that cost a rank more than its own fetch. Given the directory the result is renamed
into, a waiter sleeps in its own thread until a rename there (inotify,
:mod:`kcache.dirwatch`), waking every so often to see whether the holder let go
without publishing. Otherwise it sleeps until the holder lets go (a blocking shared
lock of the key's byte, taken by a thread of a small pool: ``fcntl`` has no timeout);
the hand-offs to and from that thread cost about 150 us of CPU per wait on a loaded
node. Either way every waiter wakes at once. Waiters that looked in turns instead
kept the cores of a loaded node busy; a thread started per wait cost milliseconds.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol, TypeVar, runtime_checkable

import filelock

from kcache.dirwatch import rename_watch
from kcache.errors import LockTimeoutError
from kcache.fsutil import make_dirs
from kcache.keys import require_hex_key

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: a filelock file per key
    fcntl = None  # type: ignore[assignment]

__all__ = ["FileKeyLock", "KeyLock", "SingleFlight", "try_file_lock"]

T = TypeVar("T")

#: Whether OFD record locks exist here (Linux 3.15 and later).
_OFD = fcntl is not None and hasattr(fcntl, "F_OFD_SETLK")
# hold_unless: the pause before trying again when another waiter was quicker.
_RETRY_S = 0.001
# hold_unless with a watch: a waiter's first nap, doubled each time up to the last.
_WATCH_NAP_S = 0.005
_WATCH_NAP_MAX_S = 0.2
# try_file_lock: the pause between tries while another process holds the lock.
_FILE_LOCK_POLL_S = 0.05
# Errors that mean the filesystem keeps no record locks: go ahead as if the lock were had.
_NO_LOCKS = frozenset({errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL})


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
        where: str | None = None,
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
            with looking(key, timeout, published, where) as found:
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
        self._keys = os.path.join(locks, "keys.lock")
        # key -> (thread, its byte) for the locks held through this object (let_go).
        self._held: dict[str, tuple[int, _KeyRange]] = {}
        self._held_guard = threading.Lock()

    def let_go(self, key: str) -> None:
        """Let go of ``key`` now, before the holding block ends, if this thread holds it here.

        For a holder that has made its result visible (a node tier that wrote the
        entry's alias) and has only bookkeeping left: the waiters may go on at once.
        Nothing where OFD locks do not exist.
        """
        with self._held_guard:
            held = self._held.get(key)
            if held is None or held[0] != threading.get_ident():
                return
            del self._held[key]
        held[1].give_up()

    @contextlib.contextmanager
    def _holding(self, key: str, lock: _KeyRange) -> Iterator[None]:
        """Note ``lock`` as this thread's for :meth:`let_go` while the caller's block runs."""
        with self._held_guard:
            self._held[key] = (threading.get_ident(), lock)
        try:
            yield
        finally:
            with self._held_guard:
                if key in self._held and self._held[key][1] is lock:
                    del self._held[key]

    @contextlib.contextmanager
    def hold(self, key: str, timeout: float) -> Iterator[bool]:
        """Try without waiting first, so the caller learns whether it waited."""
        if not _OFD:
            with self._per_key_file(key, timeout) as waited:
                yield waited
            return
        with _KeyRange(self._keys, key) as lock:
            waited = not lock.take()
            if waited:
                deadline = time.monotonic() + timeout
                while True:
                    self._await_release(lock, key, timeout, deadline)
                    if lock.take():
                        break
            with self._holding(key, lock):
                yield waited

    @contextlib.contextmanager
    def hold_unless(
        self,
        key: str,
        timeout: float,
        published: Callable[[], T | None],
        where: str | None = None,
    ) -> Iterator[T | None]:
        """Hold ``key``'s lock, unless ``published()`` finds the holder's result first.

        Yields None with the lock held (free at once, or once the holder let go without
        publishing: it failed, or died and the kernel released its lock), or what
        ``published()`` returned while this process waited, with the lock never taken.
        A waiter looks (``published()``, which must need no lock) before it tries the
        lock: the holder publishes before it lets go, so the waiters find the entry, all
        at once, instead of passing through the lock one after another. Raises
        LockTimeoutError after ``timeout``.

        ``where`` is the directory the holder's result is renamed into: the waiter then
        sleeps until a rename there (:mod:`kcache.dirwatch`), or for a short while at most
        (the holder may fail, or die, without publishing), instead of until the holder
        lets go; without it, or without inotify, it sleeps until the holder lets go.
        """
        if not _OFD:  # the portable lock, and a look under it (by the caller)
            with self._per_key_file(key, timeout):
                yield None
            return
        with _KeyRange(self._keys, key) as lock:
            if lock.take():
                with self._holding(key, lock):
                    yield None
                return
            found = self._outwait(lock, key, timeout, published, where)
            if found is not None:
                yield found
                return
            with self._holding(key, lock):
                yield None

    def _outwait(
        self,
        lock: _KeyRange,
        key: str,
        timeout: float,
        published: Callable[[], T | None],
        where: str | None,
    ) -> T | None:
        """Wait until ``published()`` finds the result (returned) or ``lock`` is had (None)."""
        deadline = time.monotonic() + timeout
        watch = rename_watch(where) if where is not None else None
        try:
            naps = 0
            while True:
                if watch is None:
                    self._await_release(lock, key, timeout, deadline)
                found = published()  # with a watch: armed before this look, so nothing slips by
                if found is not None:
                    return found
                if lock.take():
                    return None
                if watch is None:
                    # Another waiter took it, or holds its shared lock a moment.
                    time.sleep(_RETRY_S)
                    continue
                left = deadline - time.monotonic()
                if left <= 0:
                    raise LockTimeoutError(
                        f"waited {timeout:.0f}s for the lock of {key} in {self._keys}"
                    )
                # Woken by a rename there, or after a nap that grows to _WATCH_NAP_MAX_S:
                # a holder that failed or died lets go without renaming anything in.
                watch.wait(min(left, _WATCH_NAP_S * 2**naps, _WATCH_NAP_MAX_S))
                naps = min(naps + 1, 16)
        finally:
            if watch is not None:
                watch.close()

    def _await_release(self, lock: _KeyRange, key: str, timeout: float, deadline: float) -> None:
        """Return once the holder of ``key`` lets go; LockTimeoutError past ``deadline``."""
        if not _released(lock, deadline - time.monotonic()):
            raise LockTimeoutError(f"waited {timeout:.0f}s for the lock of {key} in {self._keys}")

    @contextlib.contextmanager
    def _per_key_file(self, key: str, timeout: float) -> Iterator[bool]:
        """A ``filelock`` file per key (where OFD locks do not exist); yields whether it waited."""
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


class _Flock(ctypes.Structure):
    """``struct flock`` (fcntl(2)), with the platform's own field sizes and padding."""

    _fields_ = [
        ("l_type", ctypes.c_short),
        ("l_whence", ctypes.c_short),
        ("l_start", ctypes.c_int64),
        ("l_len", ctypes.c_int64),
        ("l_pid", ctypes.c_int),
    ]


class _KeyRange:
    """One key's byte of the shared lock file, through a descriptor of its own.

    OFD locks belong to the open file description, so two descriptors (two threads,
    two processes) exclude each other, and closing the descriptor releases the lock.
    The byte is the key's first 60 bits: two keys that share them only wait for each
    other.
    """

    def __init__(self, path: str, key: str) -> None:
        assert fcntl is not None
        offset = int(require_hex_key(key, "key")[:15], 16)
        self.path = path
        self._exclusive = bytes(_Flock(fcntl.F_WRLCK, os.SEEK_SET, offset, 1, 0))
        self._unlock = bytes(_Flock(fcntl.F_UNLCK, os.SEEK_SET, offset, 1, 0))
        #: The same byte, shared: granted once no one holds it exclusively.
        self.shared = bytes(_Flock(fcntl.F_RDLCK, os.SEEK_SET, offset, 1, 0))
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)
        try:
            self._fd = os.open(path, flags, 0o644)
        except FileNotFoundError:  # the locks directory was removed (a cleared cache)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            self._fd = os.open(path, flags, 0o644)

    def take(self) -> bool:
        """Take the lock if no other description holds the byte; True also without record locks."""
        assert fcntl is not None
        try:
            fcntl.fcntl(self._fd, fcntl.F_OFD_SETLK, self._exclusive)
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EACCES):
                return False
            if exc.errno in _NO_LOCKS:
                # No record locks on this filesystem: go ahead as the holder; at worst
                # the node downloads (or compiles) a kernel twice.
                return True
            raise
        return True

    def give_up(self) -> None:
        """Release the lock now (the descriptor stays open until the block ends)."""
        assert fcntl is not None
        try:
            fcntl.fcntl(self._fd, fcntl.F_OFD_SETLK, self._unlock)
        except OSError as exc:
            if exc.errno not in _NO_LOCKS:  # none was taken there
                raise

    def __enter__(self) -> _KeyRange:
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self._fd)  # releases the lock, if it was taken


def _released(lock: _KeyRange, timeout: float) -> bool:
    """Whether the holder of ``lock``'s byte let go (or died) within ``timeout`` seconds."""
    if timeout <= 0:
        return False
    wait = _Wait(lock.path, lock.shared)
    _WAITERS.put(wait)
    return wait.done.wait(timeout)


class _Wait:
    """One wait for a key's holder to let go: the shared request, and the event that tells."""

    def __init__(self, path: str, shared: bytes) -> None:
        self.path = path
        self.shared = shared
        self.done = threading.Event()


class _WaitPool:
    """Daemon threads that each block in ``F_OFD_SETLKW`` for one :class:`_Wait` at a time.

    ``fcntl`` has no timeout, so a thread blocks for the waiter, which waits on an event
    with its own timeout. The thread takes the shared lock once the holder lets go (or
    dies), drops it at once and sets the event; a waiter that gave up leaves its
    thread blocked until then. Threads are kept for later waits, and one is started
    only when all are busy: starting one per wait cost a rank milliseconds on a loaded
    node.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """No threads, no waits (also in a forked child: the threads stayed with the parent)."""
        self._jobs: queue.SimpleQueue[_Wait] = queue.SimpleQueue()
        self._guard = threading.Lock()
        self._idle = 0

    def put(self, wait: _Wait) -> None:
        """Have a thread wait for ``wait`` (an idle one, else a new one)."""
        with self._guard:
            start = self._idle == 0
            if not start:
                self._idle -= 1
        self._jobs.put(wait)
        if start:
            threading.Thread(target=self._serve, name="kcache-lock-wait", daemon=True).start()

    def _serve(self) -> None:
        assert fcntl is not None
        while True:
            wait = self._jobs.get()
            with contextlib.suppress(OSError):  # no lock to wait on: the waiter just looks
                fd = os.open(wait.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                try:
                    fcntl.fcntl(fd, fcntl.F_OFD_SETLKW, wait.shared)
                finally:
                    os.close(fd)  # the shared lock goes with it
            wait.done.set()
            with self._guard:
                self._idle += 1


_WAITERS = _WaitPool()
if hasattr(os, "register_at_fork"):  # a forked child has none of the parent's threads
    os.register_at_fork(after_in_child=_WAITERS.reset)


@contextlib.contextmanager
def try_file_lock(path: Path, wait_s: float) -> Iterator[bool]:
    """Hold the file lock at ``path`` across processes: yields True while held, False when it
    was not had within ``wait_s`` (the caller then leaves the work to the holder).

    A ``flock`` of the file, as ``filelock`` takes it (the two exclude each other, so
    releases that used ``filelock`` here share the lock), without its machinery: a node
    tier's first publish in each process asks for its eviction lock, and ``filelock``
    cost 0.2-0.5 ms of CPU per call. Released when the block ends or the holder dies.
    """
    if fcntl is None:  # pragma: no cover - Windows
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
        return
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o644)
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, flags, 0o644)
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                left = deadline - time.monotonic()
                if left <= 0:
                    yield False
                    return
                time.sleep(min(_FILE_LOCK_POLL_S, left))
        yield True
    finally:
        os.close(fd)  # releases the lock, if it was had
