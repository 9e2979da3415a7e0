"""Server-side include sets: directories an operator registers by name (say, a CUTLASS checkout).

Recipes name them (``"include_sets": ["cutlass"]``), never give paths. Files read
from them are dependencies like in-memory headers; their hashes are memoised by
``(size, mtime_ns, ctime_ns, inode)`` so a lookup does not re-read an unchanged tree.
A file belongs to a set only when it lies strictly inside the root, after resolving
symlinks: a link in the tree that points elsewhere is not part of the set (a compile
that reads through it is refused, see :mod:`kcache.deps`). A set's root is an ``-I``
directory, so its headers include each other by their path from the root (as CUTLASS
and CCCL do), and a quoted include is found next to the including file first.

A file's timestamps only move in clock ticks, so an edit made within a tick of the
hashing can leave every stat field as it was (same size, same mtime). As git does
for its "racy" index entries, a memo is trusted only for files whose last change is
older than ``RACY_SECONDS`` before they were hashed; younger ones are re-read.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kcache.errors import RecipeError

__all__ = ["RACY_SECONDS", "IncludeSet", "IncludeSets"]

#: A file changed less than this long before it was hashed is always re-hashed.
RACY_SECONDS = 2.0


@dataclass(frozen=True)
class IncludeSet:
    """One registered directory."""

    name: str
    root: Path

    def resolve(self, relative: str) -> Path | None:
        """The file ``relative`` inside this set, or None if it is absent or escapes the root."""
        path = (self.root / relative).resolve()
        if path == self.root or not path.is_relative_to(self.root) or not path.is_file():
            return None
        return path


class IncludeSets:
    """The registry of include sets, with a memo of file hashes."""

    def __init__(self, sets: Mapping[str, str | Path] | None = None) -> None:
        self._sets = {
            name: IncludeSet(name, Path(root).resolve()) for name, root in (sets or {}).items()
        }
        for item in self._sets.values():
            if not item.root.is_dir():
                raise ValueError(f"include set {item.name!r}: {item.root} is not a directory")
        self._memo: dict[Path, tuple[tuple[int, int, int, int], str]] = {}
        self._lock = threading.Lock()

    @property
    def names(self) -> list[str]:
        """Registered names."""
        return sorted(self._sets)

    def get(self, name: str, field: str = "include_sets") -> IncludeSet:
        """The set named ``name``, or a :class:`RecipeError` naming the registered ones."""
        try:
            return self._sets[name]
        except KeyError:
            known = ", ".join(self.names) or "none are registered"
            raise RecipeError(field, f"include set {name!r} is not registered ({known})") from None

    def as_mapping(self) -> dict[str, str]:
        """name -> root, for handing to a compile worker."""
        return {name: str(item.root) for name, item in self._sets.items()}

    def file_hash(self, set_name: str, relative: str) -> str | None:
        """sha256 of a file in a set, or None if the set or file is gone."""
        item = self._sets.get(set_name)
        path = item.resolve(relative) if item else None
        if path is None:
            return None
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
