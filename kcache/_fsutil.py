"""Atomic publishing of files: unique temp beside the destination, fsync, rename, fsync dir."""

from __future__ import annotations

import errno
import os
import secrets
from pathlib import Path

from kcache.errors import StoreFullError

__all__ = ["TMP_PREFIX", "atomic_write", "fsync_dir"]

#: Staging files start with this prefix; readers and listings ignore them.
TMP_PREFIX = ".tmp-"


def fsync_dir(path: Path) -> None:
    """fsync a directory so a rename inside it survives a crash."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(dest: Path, data: bytes, *, verify: bytes | None = None) -> None:
    """Publish ``data`` at ``dest`` so readers see the old file, or all of the new one.

    The temp file is uniquely named in ``dest``'s own directory (same filesystem, so
    the rename is atomic), written, fsynced, optionally read back and compared with
    ``verify`` (catching a short write on a flaky filesystem), renamed over ``dest``,
    and the directory fsynced. On any failure the temp file is removed.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f"{TMP_PREFIX}{dest.name}-{os.getpid()}-{secrets.token_hex(6)}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            os.fsync(fd)
        finally:
            os.close(fd)
        if verify is not None and tmp.read_bytes() != verify:
            raise OSError(errno.EIO, f"read-back of {tmp} differs from what was written")
        os.replace(tmp, dest)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise StoreFullError(exc.errno, f"no space left to publish {dest.name}") from exc
        raise
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(dest.parent)
