"""Server-side include sets: directories an operator registers by name (say, a CUTLASS checkout).

Recipes name them (``"include_sets": ["cutlass"]``), never give paths. Files read
from them are dependencies like in-memory headers; their hashes are memoised by
``(size, mtime_ns, ctime_ns, inode)`` so a lookup does not re-read an unchanged tree.
A file belongs to a set only when it lies strictly inside the root, after resolving
symlinks: a link in the tree that points elsewhere is not part of the set (a compile
that reads through it is refused, see :mod:`kcache.deps`). A set's root is an ``-I``
directory, so its headers include each other by their path from the root (as CUTLASS
and CCCL do), and a quoted include is found next to the including file first.

**A set's digest** (:meth:`IncludeSets.digest`) is what a recipe key holds of it
(``name@<digest>``, docs/design.md "What a binding rests on"): the sha256 of every
regular file's path and hash, sorted, so an edit, an added or a removed file anywhere
in the set gives every recipe naming it another key. Walking a large tree (a CUTLASS
checkout: thousands of files) costs a stat per file, so a digest is reused for
``max_age_s`` (a second by default: an edit is noticed within it) and the files' hashes
come from the memo below. A compile checks the digest again, fresh, after it ran, so a
set edited during a compile never publishes under the digest it started from.

A file's timestamps only move in clock ticks, so an edit made within a tick of the
hashing can leave every stat field as it was (same size, same mtime). As git does
for its "racy" index entries, a memo is trusted only for files whose last change is
older than ``RACY_SECONDS`` before they were hashed; younger ones are re-read.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from kcache.dirs import is_kcache_cache_dir
from kcache.errors import RecipeError
from kcache.recipe import include_set_name

__all__ = [
    "CURRENT_AGE_S",
    "DIGEST_MAX_AGE_S",
    "MAX_SET_FILES",
    "RACY_SECONDS",
    "IncludeSet",
    "IncludeSets",
]

#: A file changed less than this long before it was hashed is always re-hashed.
RACY_SECONDS = 2.0
#: How long a set's digest is reused before its tree is walked again.
DIGEST_MAX_AGE_S = 1.0
#: The age of a digest that still counts as "now" (a client's pin, a pin that disagrees):
#: at most ten walks a second, however many requests ask.
CURRENT_AGE_S = 0.1
#: The most files a set may hold: a walk never reads a whole filesystem.
MAX_SET_FILES = 200_000


@dataclass(frozen=True)
class IncludeSet:
    """One registered directory."""

    name: str
    root: Path

    def resolve(self, relative: str) -> Path | None:
        """The file ``relative`` inside this set, or None if it is absent, escapes the root,
        or is inside a kcache cache directory (:func:`is_kcache_cache_dir`)."""
        path = self._inside(relative)
        if path is None:
            return None
        for parent in path.parents:
            if parent == self.root or not parent.is_relative_to(self.root):
                break
            if is_kcache_cache_dir(parent):
                return None
        return path

    def _inside(self, relative: str) -> Path | None:
        path = (self.root / relative).resolve()
        if path == self.root or not path.is_relative_to(self.root) or not path.is_file():
            return None
        return path


class IncludeSets:
    """The registry of include sets, with a memo of file hashes."""

    def __init__(
        self, sets: Mapping[str, str | Path] | None = None, *, max_age_s: float = DIGEST_MAX_AGE_S
    ) -> None:
        #: How long :meth:`digest` reuses a set's digest by default (0: walked every time).
        self.max_age_s = max_age_s
        self._sets = {
            name: IncludeSet(name, Path(root).resolve()) for name, root in (sets or {}).items()
        }
        for item in self._sets.values():
            if not item.root.is_dir():
                raise ValueError(f"include set {item.name!r}: {item.root} is not a directory")
        self._memo: dict[Path, tuple[tuple[int, int, int, int], str]] = {}
        self._digests: dict[str, tuple[float, str, Mapping[str, str | None]]] = {}
        self._lock = threading.Lock()

    @property
    def names(self) -> list[str]:
        """Registered names."""
        return sorted(self._sets)

    def get(self, name: str, field: str = "include_sets") -> IncludeSet:
        """The set named ``name`` (or ``name@<digest>``), or a :class:`RecipeError` naming the registered ones."""
        try:
            return self._sets[include_set_name(name)]
        except KeyError:
            known = ", ".join(self.names) or "none are registered"
            raise RecipeError(field, f"include set {name!r} is not registered ({known})") from None

    def as_mapping(self) -> dict[str, str]:
        """name -> root, for handing to a compile worker."""
        return {name: str(item.root) for name, item in self._sets.items()}

    def digest(self, name: str, *, max_age_s: float | None = None) -> str:
        """sha256 of the set's contents: every regular file's relative path and hash, sorted.

        Reused for ``max_age_s`` seconds (0: walked now; None: the registry's own). A file
        that cannot be read enters as unreadable (it cannot be compiled from either); a
        link that leads out of the root is not part of the set, as
        :meth:`IncludeSet.resolve` says.
        """
        return self.contents(name, max_age_s=max_age_s)[0]

    def contents(
        self, name: str, *, max_age_s: float | None = None
    ) -> tuple[str, Mapping[str, str | None]]:
        """The set's :meth:`digest` and the walk it hashes: relative path -> sha256 (None: unreadable)."""
        item = self.get(include_set_name(name))
        max_age_s = self.max_age_s if max_age_s is None else max_age_s
        now = time.monotonic()
        with self._lock:
            known = self._digests.get(item.name)
        if known is not None and max_age_s > 0 and now - known[0] < max_age_s:
            return known[1], known[2]
        # The walk found each file and where it resolves: hashed there, not resolved again.
        files = {
            relative: None if path is None else self._hash(path)
            for relative, path in self._files(item).items()
        }
        lines = [f"{relative}\0{digest or '-'}\n" for relative, digest in files.items()]
        digest = hashlib.sha256("".join(lines).encode()).hexdigest()
        frozen = MappingProxyType(files)
        with self._lock:
            self._digests[item.name] = (now, digest, frozen)
        return digest, frozen

    def digests(self, *, max_age_s: float | None = None) -> dict[str, str]:
        """name -> :meth:`digest` of every registered set (what ``GET /v1/toolchains`` lists)."""
        return {name: self.digest(name, max_age_s=max_age_s) for name in self.names}

    @staticmethod
    def _files(item: IncludeSet) -> dict[str, Path | None]:
        """Every regular file's path relative to the root, sorted, and where it is: a link is
        followed only inside the root (None where it leads into a cache directory, as
        :meth:`IncludeSet.resolve` says); any other file is where the walk found it, since the
        walk follows no directory link and skips cache directories."""
        found: dict[str, Path | None] = {}
        for dirpath, dirnames, filenames in os.walk(item.root):  # no followlinks: no loops
            base = Path(dirpath)
            if base != item.root and is_kcache_cache_dir(base):
                dirnames[:] = []  # a cache under the set (its files change with every lookup)
                continue
            dirnames.sort()
            for filename in filenames:
                path = base / filename
                relative = path.relative_to(item.root).as_posix()
                if path.is_symlink():
                    if item._inside(relative) is not None:
                        found[relative] = item.resolve(relative)
                elif path.is_file():
                    found[relative] = path
            if len(found) > MAX_SET_FILES:
                raise ValueError(
                    f"include set {item.name!r}: {item.root} holds more than {MAX_SET_FILES} files"
                )
        return dict(sorted(found.items()))

    def file_hash(self, set_name: str, relative: str) -> str | None:
        """sha256 of a file in a set, or None if the set or file is gone."""
        item = self._sets.get(set_name)
        path = item.resolve(relative) if item else None
        return None if path is None else self._hash(path)

    def _hash(self, path: Path) -> str | None:
        """sha256 of the file at ``path`` (memoised by its stat), or None if it is gone."""
        try:
            st = path.stat()
        except OSError:
            return None
        stamp = (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
        with self._lock:
            cached = self._memo.get(path)
        if cached and cached[0] == stamp:
            return cached[1]
        hashed_at = time.time_ns()
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        if max(st.st_mtime_ns, st.st_ctime_ns) < hashed_at - int(RACY_SECONDS * 1e9):
            with self._lock:
                self._memo[path] = (stamp, digest)
        return digest
