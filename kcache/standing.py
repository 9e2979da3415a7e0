"""Where a cache directory stands: who else could have written what it holds.

A node tier is read by every process of a host, and what it holds is loaded into
them as GPU code: anyone who can write it can choose the kernel a rank runs (a
recipe key is computable by anyone). So the tier looks at its own directories when
it is opened, and again before it deletes anything:

``private``
    Every directory is owned by this user (or root) and writable by no one else, and
    none is a symbolic link: only this user (and root) wrote what is there, so its
    entries, those compiled here unsigned included, are used as they are.
``shared``
    Some directory is writable by others but has the sticky bit (``chmod 1777``, or
    ``1775`` for a group), so others cannot remove or rename what this user wrote,
    and none is a symbolic link: a team's shared tier. Only entries signed by a
    trusted key are used; an entry compiled here is not published into it (nothing
    could prove it to the others).
``untrusted``
    Anything else: a directory others can write without the sticky bit, one owned by
    another user, one that is a symbolic link, or not a directory. It is read for
    signed entries only and never written or cleaned.

The check is a ``lstat`` per directory (the tier's few top-level directories, and the
fan-out directories of an old layout at most on demand), so it is cheap to repeat.
What it cannot close: another user who owns a directory of a shared tier may swap it
for a link between the check and a use; reads then still refuse links and irregular
files and verify every byte, and deletion re-checks right before it runs.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

__all__ = ["Standing", "StandingKind", "directory_standing"]

StandingKind = Literal["private", "shared", "untrusted"]


@dataclass(frozen=True)
class Standing:
    """A directory tree's standing, and why (the first directory that decided it)."""

    kind: StandingKind
    reason: str

    @property
    def writable(self) -> bool:
        """Whether this process may publish into and clean the tree."""
        return self.kind != "untrusted"

    @property
    def signed_only(self) -> bool:
        """Whether only signed entries may be used from it."""
        return self.kind != "private"


def _one(path: str, uid: int) -> Standing:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return Standing("private", "")  # made by this process when it is needed
    if stat.S_ISLNK(st.st_mode):
        return Standing("untrusted", f"{path} is a symbolic link")
    if not stat.S_ISDIR(st.st_mode):
        return Standing("untrusted", f"{path} is not a directory")
    mode = stat.S_IMODE(st.st_mode)
    others_write = bool(mode & (stat.S_IWGRP | stat.S_IWOTH))
    sticky = bool(mode & stat.S_ISVTX)
    if st.st_uid not in (uid, 0):
        if sticky and others_write:
            return Standing(
                "shared", f"{path} belongs to uid {st.st_uid} in a shared (sticky) tier"
            )
        return Standing("untrusted", f"{path} belongs to another user (uid {st.st_uid})")
    if not others_write:
        return Standing("private", "")
    if sticky:
        return Standing("shared", f"{path} is writable by others, with the sticky bit ({mode:o})")
    return Standing(
        "untrusted",
        f"{path} is writable by others without the sticky bit (mode {mode:o}): "
        f"chmod go-w {path} (a private tier), or chmod +t {path} (a shared one)",
    )


_RANK = {"private": 0, "shared": 1, "untrusted": 2}


def _parent_check(parent: str, root: str, st: os.stat_result, uid: int) -> Standing | None:
    """Why ``parent`` (a directory above ``root``) lets someone else move ``root``, or None."""
    if st.st_uid not in (uid, 0):
        return Standing("untrusted", f"{parent}, a parent of {root}, belongs to uid {st.st_uid}")
    mode = stat.S_IMODE(st.st_mode)
    if mode & (stat.S_IWGRP | stat.S_IWOTH) and not mode & stat.S_ISVTX:
        return Standing(
            "untrusted",
            f"{parent}, a parent of {root}, is writable by others without the sticky bit",
        )
    return None


def _ancestors(root: str, uid: int) -> Standing:
    """Whether anyone else could move ``root`` away: its real parents, as ``ssh`` checks them.

    One ``lstat`` per directory above ``root`` when none of them is a link (a link among
    them: its real parents, as ``realpath`` finds them, each ``stat``-ed).
    """
    absolute = os.path.abspath(root)
    parents = []
    here = os.path.dirname(absolute)
    while True:
        parents.append(here)
        if here == "/" or not here:
            break
        here = os.path.dirname(here)
    found = []
    for parent in parents:
        st = os.lstat(parent)
        if stat.S_ISLNK(st.st_mode):
            return _real_ancestors(root, uid)
        found.append((parent, st))
    for parent, st in found:
        problem = _parent_check(parent, root, st, uid)
        if problem is not None:
            return problem
    return Standing("private", "")


def _real_ancestors(root: str, uid: int) -> Standing:
    """:func:`_ancestors` where a link lies above ``root``: its real parents."""
    for parent in Path(os.path.realpath(root)).parents:
        problem = _parent_check(str(parent), root, os.stat(parent), uid)
        if problem is not None:
            return problem
    return Standing("private", "")


def directory_standing(root: Path, subdirs: Iterable[str] = ()) -> Standing:
    """The standing of ``root`` and of ``subdirs`` (relative to it): the worst of them.

    ``root``'s parents count too: one that others may write without the sticky bit, or
    that belongs to another user, could have ``root`` replaced. Paths are strings and each
    directory costs one ``lstat`` (this runs in every process's ``KernelCache()``).
    """
    uid = os.geteuid()
    base = os.fspath(root)
    worst = _one(base, uid)
    if worst.kind != "untrusted":
        above = _ancestors(base, uid)
        if above.kind == "untrusted":
            return above
    for sub in subdirs:
        if worst.kind == "untrusted":
            break
        found = _one(os.path.join(base, sub), uid)
        if _RANK[found.kind] > _RANK[worst.kind]:
            worst = found
    return worst
