"""The toolchain id written down after a load, so ``kcache key`` need not load NVRTC to learn it.

:func:`kcache.toolchain.load_toolchain` locates NVRTC and nvJitLink with cuda-pathfinder
and loads them (most of what ``kcache key`` took). The id depends only on which
libraries a process finds and what they and the header tree extracted from them
hold, so after a load it is remembered together with a *stamp* of everything that
decides those, and recalled while the stamp still matches:

- where cuda-pathfinder looks first: the site-packages directories (the user's too,
  where this interpreter uses it) and ``$CONDA_PREFIX``, each with its mtime:
  installing, upgrading or removing any wheel adds or removes a ``.dist-info``
  directory there, so a newly installed NVRTC that would now be found first
  invalidates the memo;
- each library (path, size, mtime, inode; ``libnvrtc-builtins`` included) and the
  mtime of its directory (a library added beside it);
- the header tree's marker (path, size, mtime, inode).

The same trust as the library hashes (``library-hashes.json``, keyed by path, size,
mtime and inode): a file rewritten in place with its old size and mtime goes unseen.
Only a load that found both libraries by that search (pip wheels, conda) is
remembered: one found through the system loader (``LD_LIBRARY_PATH``,
``ld.so.cache``, ``$CUDA_HOME``) or already loaded by something else in the process
depends on what the stamp does not see, so such a toolchain is loaded every time.
The stamp of the libraries is taken right after they are located, before they are
hashed, so a library replaced during a load leaves a memo that no longer matches,
never one that matches a wrong id.

One memo per Python environment (its prefixes, search directories and
``LD_PRELOAD``), as a JSON file under the toolchain directory, written atomically.
A memo that cannot be read, has another shape or no longer matches is ignored; one
that cannot be written is not kept (the next command loads the toolchain again).
"""

from __future__ import annotations

import hashlib
import json
import os
import site
import sys
from pathlib import Path

__all__ = ["memo_path", "recall", "remember", "stamp"]

#: How cuda-pathfinder tells a library found by the search this memo can check.
SEARCHED = frozenset({"site-packages", "conda"})


def _search_roots() -> list[str]:
    """The directories cuda-pathfinder searches before the system loader, in its order."""
    roots = list(site.getsitepackages())
    if site.ENABLE_USER_SITE:
        roots.append(site.getusersitepackages())
    conda = os.environ.get("CONDA_PREFIX")
    if conda:
        roots.append(conda)
    return roots


def memo_path(root: Path) -> Path:
    """This Python environment's memo under the toolchain directory ``root``."""
    environment = json.dumps(
        [sys.prefix, sys.base_prefix, _search_roots(), os.environ.get("LD_PRELOAD", "")]
    )
    return root / "ids" / f"{hashlib.sha256(environment.encode()).hexdigest()[:16]}.json"


def _file_stamp(path: str) -> str:
    """``path|size|mtime|inode``, or ``path|absent``."""
    try:
        st = os.stat(path)
    except OSError:
        return f"{path}|absent"
    return f"{path}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}"


def stamp(libraries: list[Path]) -> list[str]:
    """What must stay the same for the same libraries to be found, with the same bytes."""
    directories = dict.fromkeys([*_search_roots(), *(str(p.parent) for p in libraries)])
    return [_file_stamp(path) for path in [*directories, *map(str, libraries)]]


def remember(
    root: Path, toolchain_id: str, libraries: list[Path], stamped: list[str], marker: Path
) -> None:
    """Write ``toolchain_id`` down for ``libraries`` (whose :func:`stamp` at location was ``stamped``).

    ``marker`` is the header tree's ``tree.sha256``. Failing to write is not an error:
    the memo only saves a later load.
    """
    from kcache.fsutil import atomic_write

    memo = {
        "id": toolchain_id,
        "libraries": [str(p) for p in libraries],
        "marker": str(marker),
        "stamp": [*stamped, _file_stamp(str(marker))],
    }
    path = memo_path(root)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps(memo, indent=1).encode())
    except OSError:
        return


def recall(root: Path) -> str | None:
    """The remembered toolchain id of this environment, or None when absent or stale."""
    try:
        memo = json.loads(memo_path(root).read_text())
        toolchain_id, libraries, marker = memo["id"], memo["libraries"], memo["marker"]
        remembered = memo["stamp"]
    except (OSError, ValueError, TypeError, KeyError):
        return None
    if not (
        isinstance(toolchain_id, str)
        and isinstance(marker, str)
        and isinstance(libraries, list)
        and libraries
        and all(isinstance(p, str) for p in libraries)
    ):
        return None
    current = [*stamp([Path(p) for p in libraries]), _file_stamp(marker)]
    return toolchain_id if current == remembered else None
