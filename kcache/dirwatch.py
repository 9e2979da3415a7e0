"""Sleeping until a file is renamed into a directory, or a timeout: inotify, where Linux has it.

A node tier's waiter sleeps while another process fetches the kernel it wants, and
wakes when the entry appears (every file is published by a rename into its
directory). One wake-up per wait, in the waiting thread itself: a waiter that slept
in a blocking record lock had to hand the wait to a helper thread (``fcntl`` has no
timeout), and the two extra hand-offs cost about 150 us of CPU per wait on the
benchmark machine, paid by every waiting rank for every kernel (B8).

A :class:`RenameWatch` is made per wait and closed after it (an inotify instance and
one watch: a few system calls), so threads never share one and nothing outlives its
wait. It is armed before the waiter looks for the file, so a rename between the look
and the sleep still wakes it. Any rename into the directory wakes it (the caller
looks again); nothing else does: a writer's staging file, its writes and its close
do not.

Where inotify is missing (not Linux, no ``libc``, the per-user watch limit reached,
the directory gone) :func:`rename_watch` returns None and the caller waits as it
did before. inotify sees only what this machine's kernel does: a file renamed into
a shared filesystem by another machine wakes nobody, so callers wake on a timeout too.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import select
import sys

__all__ = ["RenameWatch", "rename_watch"]

# <sys/inotify.h>
_IN_MOVED_TO = 0x00000080
_IN_ONLYDIR = 0x01000000
_IN_NONBLOCK = os.O_NONBLOCK
_IN_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
# Events are read and dropped: the caller looks for its file itself.
_READ_BYTES = 4096


def _load_libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.inotify_init1.argtypes = [ctypes.c_int]
        libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = _load_libc()


class RenameWatch:
    """An armed watch on one directory: :meth:`wait` sleeps until a rename into it."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._poll = select.poll()
        self._poll.register(fd, select.POLLIN)

    def wait(self, timeout: float) -> bool:
        """Sleep up to ``timeout`` seconds; True when something was renamed in since the last wait."""
        ready = self._poll.poll(max(0, int(timeout * 1000)))
        if not ready:
            return False
        with contextlib.suppress(BlockingIOError, InterruptedError):
            while os.read(self._fd, _READ_BYTES):  # drain: one wake for a burst of renames
                pass
        return True

    def close(self) -> None:
        """Drop the watch (closing the instance removes it)."""
        os.close(self._fd)

    def __enter__(self) -> RenameWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def rename_watch(directory: str) -> RenameWatch | None:
    """A watch for files renamed into ``directory``, armed now; None where that cannot be had."""
    if _LIBC is None:
        return None
    fd = _LIBC.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
    if fd < 0:  # EMFILE (the per-user instance limit), ENOSYS
        return None
    if _LIBC.inotify_add_watch(fd, os.fsencode(directory), _IN_MOVED_TO | _IN_ONLYDIR) < 0:
        os.close(fd)  # ENOENT (not made yet), ENOSPC (the per-user watch limit), EACCES
        return None
    return RenameWatch(fd)
