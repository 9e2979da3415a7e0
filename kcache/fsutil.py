"""Atomic publishing of files (unique temp beside the destination, fsync, rename, fsync dir),
whole-file reads in few system calls (with the identity of the file read), and the
free-space checks that turn a nearly full disk into :class:`StoreFullError`."""

from __future__ import annotations

import contextlib
import errno
import os
import secrets

from kcache.errors import StoreFullError

__all__ = [
    "TMP_PREFIX",
    "FileIdentity",
    "atomic_write",
    "check_free_space",
    "free_bytes",
    "fsync_dir",
    "identity",
    "is_disk_full",
    "read_file",
    "read_file_identified",
]

#: Staging files start with this prefix; readers and listings ignore them.
TMP_PREFIX = ".tmp-"


def free_bytes(path: str | os.PathLike[str]) -> int:
    """Bytes an unprivileged writer may still use on the filesystem holding ``path``."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def is_disk_full(exc: BaseException) -> bool:
    """True for the errors a full filesystem or an exhausted quota raise."""
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


def check_free_space(path: str | os.PathLike[str], minimum: int, what: str) -> None:
    """Raise :class:`StoreFullError` when ``path``'s filesystem has fewer than ``minimum`` bytes free.

    ``what`` names the use and the setting, for the message (for example
    ``"compile scratch (min_free_bytes)"``).
    """
    if minimum <= 0:
        return
    free = free_bytes(path)
    if free < minimum:
        raise StoreFullError(
            errno.ENOSPC,
            f"only {free} bytes are free on the filesystem of {what}; at least {minimum} are needed. "
            "Free some space (kcache db gc removes unreferenced blobs) and retry",
        )


#: What tells one file at a path from another: (device, inode, size, mtime ns, ctime ns).
FileIdentity = tuple[int, int, int, int, int]


def read_file(path: str) -> bytes:
    """The whole of the file at ``path``, in few system calls (raises OSError as ``open`` does).

    ``open(path, "rb").read()`` makes eight (open, two fstat, an isatty ioctl, a seek,
    two reads, close), a good part of a node-tier hit, which reads two small files;
    here: open, fstat, one read of the whole size plus one byte, close. A shorter
    answer than asked for is the end of the file; a full one means the file grew
    meanwhile, and it is read on to its end.
    """
    return read_file_identified(path)[0]


def read_file_identified(path: str) -> tuple[bytes, FileIdentity]:
    """:func:`read_file`, and the identity of the file read, from the same descriptor.

    The identity is taken before the bytes are read, so a change to the file while it
    is read shows in a later identity (a write moves mtime and ctime on; only the
    kernel sets ctime), and bytes read from a file that grew or shrank meanwhile do
    not have the identity's size.
    """
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        asked = st.st_size + 1
        data = os.read(fd, asked)
        if len(data) == asked:  # grew since the fstat: read on to the end
            chunks = [data]
            while chunks[-1]:
                chunks.append(os.read(fd, 1 << 16))
            data = b"".join(chunks)
    finally:
        os.close(fd)
    return data, identity(st)


def identity(st: os.stat_result) -> FileIdentity:
    """The :data:`FileIdentity` of a file ``os.stat`` or ``os.fstat`` described."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a directory so a rename inside it survives a crash."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)


def atomic_write(
    dest: str | os.PathLike[str],
    data: bytes,
    *,
    verify: bytes | None = None,
    durable: bool = True,
) -> None:
    """Publish ``data`` at ``dest`` so readers see the old file, or all of the new one.

    The temp file is uniquely named in ``dest``'s own directory (same filesystem, so
    the rename is atomic), written, fsynced, optionally read back and compared with
    ``verify`` (catching a short write on a flaky filesystem), renamed over ``dest``,
    and the directory fsynced. On any failure the temp file is removed. A missing
    directory (a new fan-out directory) is created when the temp file's creation
    says so, not checked before every write: a cold node tier publishing a few
    hundred files paid a ``mkdir`` for each.

    ``durable=False`` skips both fsyncs, for caches only (the client's node tier):
    readers still see the old file or all of the new one while the machine runs
    (the rename is atomic either way), but after a power loss or kernel crash the
    file may be missing, empty or hold stale blocks. That is acceptable only where
    every reader treats an unreadable file as absent and verifies content by digest,
    so the loss costs a refetch, never wrong data. A source of truth (the server's
    store and index) keeps the default.
    """
    # Strings, not pathlib: this runs several times per kernel a node tier publishes.
    dest = os.fspath(dest)
    parent, name = os.path.split(dest)
    tmp = os.path.join(parent, f"{TMP_PREFIX}{name}-{os.getpid()}-{secrets.token_hex(6)}")
    try:
        try:
            fd = os.open(tmp, _CREATE, 0o644)
        except FileNotFoundError:
            # Inside the outer try: a fan-out directory needs a block too, on a full disk.
            os.makedirs(parent, exist_ok=True)
            fd = os.open(tmp, _CREATE, 0o644)
        try:
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        if verify is not None and read_file(tmp) != verify:
            raise OSError(errno.EIO, f"read-back of {tmp} differs from what was written")
        os.replace(tmp, dest)
    except OSError as exc:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if is_disk_full(exc):
            raise StoreFullError(exc.errno, f"no space left to publish {name}") from exc
        raise
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if durable:
        fsync_dir(parent)
