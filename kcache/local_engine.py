"""Building an engine over a local data directory: the one place the core picks backends."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from kcache.compilers import InProcessCompiler
from kcache.dirs import cache_dir, cache_layout, mark_cache_dir
from kcache.engine import Engine
from kcache.include_sets import IncludeSets
from kcache.index.file import FileIndex
from kcache.locks import FileKeyLock, SingleFlight
from kcache.store.local import LocalArtifactStore
from kcache.toolchain import load_toolchain

__all__ = ["open_local_engine"]


def open_local_engine(
    data_dir: str | os.PathLike[str] | None = None,
    *,
    include_sets: Mapping[str, str | Path] | None = None,
    toolchain_dir: Path | None = None,
) -> Engine:
    """An engine with a directory store, JSON index, file locks and in-process NVRTC.

    ``data_dir`` defaults to the user's cache directory (:func:`kcache.dirs.cache_dir`),
    which the client's node tier and ``kcache compile`` share; a server's data
    directory is indexed in SQL and is never the default here.
    """
    root = cache_dir(data_dir)
    mark_cache_dir(root)
    flat = cache_layout(root) == "flat"
    return Engine(
        store=LocalArtifactStore(root, flat=flat),
        index=FileIndex(root, flat=flat),
        lock=SingleFlight(FileKeyLock(root)),
        # One user's compiles: a set's digest is walked each time (no second of staleness).
        compiler=InProcessCompiler(
            load_toolchain(toolchain_dir), IncludeSets(include_sets, max_age_s=0)
        ),
    )
