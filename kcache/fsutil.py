"""Atomic publishing of files (unique temp beside the destination, fsync, rename, fsync dir),
whole-file reads in few system calls (with the identity of the file read), directory
walks, and the free-space checks that turn a nearly full disk into :class:`StoreFullError`.

Reads and walks never trust what a directory holds, since a directory other users can
write (a node tier shared on a host) may hold anything: a read opens with
``O_NOFOLLOW | O_NONBLOCK`` (a symbolic link is refused, a FIFO does not block the
open) and reads only a regular file, at most the bytes its caller expects
(:class:`UnsafeFileError` otherwise); a walk (:func:`regular_files`) lists regular
files only and never descends through a symbolic link.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Iterator

from kcache.errors import KCacheError, StoreFullError

__all__ = [
    "TMP_PREFIX",
    "FileIdentity",
    "UnsafeFileError",
    "atomic_write",
    "check_free_space",
    "free_bytes",
    "fsync_dir",
    "identity",
    "is_disk_full",
    "make_dirs",
    "make_private_dirs",
    "open_regular",
    "read_file",
    "read_file_identified",
    "regular_files",
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

_READ = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0) | os.O_NONBLOCK


class UnsafeFileError(KCacheError, OSError):
    """A path that should be a regular file is a link, a FIFO, a device, or larger than expected.

    Callers that read caches treat it as an absent or damaged entry; ``path`` and
    ``reason`` say which and why (for the one warning a reader gives).
    """

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path} {reason}: not read")
        self.path = path
        self.reason = reason


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def read_file(path: str, max_bytes: int | None = None) -> bytes:
    """The whole of the file at ``path``, in few system calls (raises OSError as ``open`` does).

    ``open(path, "rb").read()`` makes eight (open, two fstat, an isatty ioctl, a seek,
    two reads, close), a good part of a node-tier hit, which reads two small files;
    here: open, fstat, one read of the whole size plus one byte, close. A shorter
    answer than asked for is the end of the file; a full one means the file grew
    meanwhile, and it is read on to its end.
    """
    return read_file_identified(path, max_bytes)[0]


def open_regular(path: str) -> tuple[int, os.stat_result]:
    """A read-only descriptor of the regular file at ``path`` (never through a symbolic link,
    never blocking on a FIFO) and its ``fstat``; :class:`UnsafeFileError` for anything else.
    A file standing where one of its directories goes is FileNotFoundError: no file is
    there (readers of a damaged cache read the entry as absent). The caller closes it."""
    try:
        fd = os.open(path, _READ)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeFileError(path, "is a symbolic link") from None
        if exc.errno == errno.ENOTDIR:
            raise FileNotFoundError(
                errno.ENOENT, "no such file (a part of its path is a file)", path
            ) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeFileError(path, f"is {_kind(st.st_mode)}")
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def read_file_identified(path: str, max_bytes: int | None = None) -> tuple[bytes, FileIdentity]:
    """:func:`read_file`, and the identity of the file read, from the same descriptor.

    The identity is taken before the bytes are read, so a change to the file while it
    is read shows in a later identity (a write moves mtime and ctime on; only the
    kernel sets ctime), and bytes read from a file that grew or shrank meanwhile do
    not have the identity's size.

    Only a regular file is read, never through a symbolic link, and never more than
    ``max_bytes`` (None: no bound): otherwise :class:`UnsafeFileError` (module docstring).
    A file that grows past the bound while it is read is cut there (its bytes then do
    not have the identity's size, which callers check).
    """
    fd, st = open_regular(path)
    try:
        if max_bytes is not None and st.st_size > max_bytes:
            raise UnsafeFileError(
                path, f"holds {st.st_size} bytes, more than the {max_bytes} expected"
            )
        asked = st.st_size + 1
        data = os.read(fd, asked)
        if len(data) == asked:  # grew since the fstat: read on to the end (or the bound)
            limit = max_bytes + 1 if max_bytes is not None else None
            chunks = [data]
            total = len(data)
            while chunks[-1] and (limit is None or total < limit):
                chunks.append(os.read(fd, 1 << 16))
                total += len(chunks[-1])
            data = b"".join(chunks)
            if limit is not None:
                data = data[:limit]
    finally:
        os.close(fd)
    return data, identity(st)


def regular_files(directory: str | os.PathLike[str], depth: int = 0) -> Iterator[os.DirEntry[str]]:
    """The regular files ``depth`` directory levels below ``directory`` (0: in it).

    Nothing is followed: a symbolic link (to a file or a directory) is skipped, and so
    is ``directory`` itself when it is a link, or anything but a directory (nothing is
    listed). A directory that vanishes meanwhile is skipped.
    """
    try:
        if not stat.S_ISDIR(os.lstat(directory).st_mode):
            return
        entries = list(os.scandir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return
    for entry in entries:
        try:
            if depth == 0:
                if entry.is_file(follow_symlinks=False):
                    yield entry
            elif entry.is_dir(follow_symlinks=False):
                yield from regular_files(entry.path, depth - 1)
        except OSError:
            continue


def identity(st: os.stat_result) -> FileIdentity:
    """The :data:`FileIdentity` of a file ``os.stat`` or ``os.fstat`` described."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def make_dirs(path: str) -> None:
    """Make the directory ``path`` (and its parents) unless it is there: one ``mkdir`` when it
    is (``Path.mkdir(parents=True, exist_ok=True)`` adds a ``stat`` and pathlib's own work,
    paid for each of a node tier's directories in every process's ``KernelCache()``).

    A file of that name is not checked for here: what is written below it fails, and the
    node tier's standing check (:func:`kcache.standing.directory_standing`) refuses it.
    """
    try:
        os.mkdir(path)
    except FileExistsError:
        pass
    except FileNotFoundError:
        os.makedirs(path, exist_ok=True)


def make_private_dirs(path: str) -> None:
    """Make the directory ``path`` and any missing parent with mode 0700: this user's alone.

    ``os.makedirs(path, mode=0o700)`` gives only the last one that mode and its parents the
    umask's, which a umask of 002 leaves writable by the group: a parent others can write
    lets them swap the directory below it (kcache's pin file and verified-signature memo
    live in such directories and are trusted only while private). Directories already there
    are left as they are.
    """
    missing = []
    here = path
    while not os.path.isdir(here):
        missing.append(here)
        parent = os.path.dirname(here)
        if parent == here:
            break
        here = parent
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):
            os.mkdir(directory, 0o700)


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
    mode: int = 0o644,
) -> None:
    """Publish ``data`` at ``dest`` so readers see the old file, or all of the new one.

    The temp file is uniquely named in ``dest``'s own directory (same filesystem, so
    the rename is atomic), written, fsynced, optionally read back and compared with
    ``verify`` (catching a short write on a flaky filesystem), renamed over ``dest``,
    and the directory fsynced. On any failure the temp file is removed. A missing
    directory (a new fan-out directory) is created when the temp file's creation
    says so, not checked before every write: a cold node tier publishing a few
    hundred files paid a ``mkdir`` for each.

    ``mode`` is the new file's (less the umask) from its creation: a private file
    (``0o600``) is never readable by others under either name.

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
    parent = parent or os.curdir  # a bare name: the directory to sync is the current one
    tmp = os.path.join(parent, f"{TMP_PREFIX}{name}-{os.getpid()}-{secrets.token_hex(6)}")
    try:
        try:
            fd = os.open(tmp, _CREATE, mode)
        except FileNotFoundError:
            # Inside the outer try: a fan-out directory needs a block too, on a full disk.
            os.makedirs(parent, exist_ok=True)
            fd = os.open(tmp, _CREATE, mode)
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
