"""A node tier's directories, and who else could have written them (what of the tier is used).

Who else could have written the tier decides what of it is used
(:mod:`kcache.standing`, checked at open and again before anything is deleted): a
*private* tier (this user's, writable by no one else) is used as it is; from a
*shared* one (writable by others, sticky) only entries signed by a key this client
trusts (:mod:`~kcache_client._trust`) are used, and nothing unsigned is published
into it; an *untrusted* one (writable by others without the sticky bit, another
user's, a linked directory) is only read, for signed entries. The standing is said at
open (a warning for an untrusted tier; a shared one, as its owner meant it, at INFO), and
each entry refused is warned about once. Every file is read with ``O_NOFOLLOW``, only if it
is a regular file, and no further than expected (an alias by
:data:`~kcache.index.file.MAX_ENTRY_BYTES`, a blob by its size), and walks never
follow links (:mod:`kcache.fsutil`), so a FIFO, a device or a link planted in the
tier costs a refused entry, never a hang, an unbounded read or a deletion outside it.

A shared tier's directories are made up front with the root's mode (:func:`share_dirs`),
so that one made on first use by one user does not turn the tier untrusted for the others.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from kcache.standing import Standing, directory_standing

__all__ = ["SERVERS_DIR", "TIER_DIRS", "share_dirs", "tier_standing"]

#: The tier's own directories, whose standing is checked (kcache.standing).
TIER_DIRS = (
    "blobs",
    "index",
    "index/recipes",
    "index/artifacts",
    "index/manifests",
    "index/complete",
    "locks",
    "packs",
)
#: Where a server's facts are kept (its default toolchain, include sets' digests).
SERVERS_DIR = "servers"
#: The lock files under ``locks/`` made up front (the eviction lock; kcache.locks.FileKeyLock
#: makes a key's own while it is held, writable by all in a shared tier).
_LOCK_FILES = ("evict.lock",)


def tier_standing(root: Path, read_only: bool) -> Standing:
    """The standing of the tier at ``root`` now (:func:`kcache.standing.directory_standing`); a
    read-only layer's is untrusted whatever its directories say (signed entries only, no writes)."""
    found = directory_standing(root, TIER_DIRS)
    if read_only and found.kind != "untrusted":
        return Standing("untrusted", f"{root} is a read-only layer")
    return found


def share_dirs(root: Path) -> None:
    """Make the directories of the tier at ``root`` now, with the tier's standing: in a shared
    tier (root sticky, writable by others) each gets the root's mode (``1777``, ``1775``), so
    the other users can publish into it too and find it shared, not another user's private
    directory (untrusted). A directory made later, on first use (``packs/`` by the first
    prefetch, ``index/complete/``, ``servers/``), made with the umask's ``0755``, turned
    the tier untrusted for every other user until its creator opened it again. This
    user's directories made before are given the mode too.

    Every process of every user opens the tier, so the common case, everything there as
    it should be, costs one ``lstat`` per directory and nothing else."""
    base = os.fspath(root)
    try:
        st = os.lstat(base)
    except OSError:
        return
    mode = st.st_mode & 0o7777
    if not (mode & 0o1000 and mode & 0o022):
        return  # not shared: a private tier makes its directories when it first needs them
    uid = os.geteuid()
    for sub in (*TIER_DIRS, SERVERS_DIR):
        path = f"{base}/{sub}"
        with contextlib.suppress(OSError):
            try:
                made = os.lstat(path)
            except FileNotFoundError:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(path)  # the umask's mode, then the root's below
                made = os.lstat(path)
            if made.st_uid == uid and made.st_mode & 0o7777 != mode:
                os.chmod(path, mode, follow_symlinks=False)
    # The lock files every user's processes open for writing (the per-key download lock,
    # the eviction lock): made writable by all here, or the first user's 0644 files would
    # stop every other user's lookups (a sticky directory keeps them).
    for name in _LOCK_FILES:
        path = f"{base}/locks/{name}"
        if os.path.lexists(path):
            continue
        with contextlib.suppress(OSError):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
            try:
                os.fchmod(fd, 0o666)
            finally:
                os.close(fd)
