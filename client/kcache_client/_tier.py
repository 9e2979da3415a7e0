"""The node-local tier: the core's store, index and locks in one directory per node.

Every process of a node (every rank, every job) opens the same directory. Blobs
are published by the core's atomic write under their digest, index entries by
atomic rename, so readers never see half a file and two processes that download
the same blob agree. The per-key lock (in-process single-flight around a file
lock) only makes the node download a blob once instead of once per rank; it
guards no correctness. The same holds on a shared filesystem where ``flock`` is
advisory or granted to everyone: duplicate downloads, never a wrong result.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kcache.artifact import ArtifactMeta, CompileFailure
from kcache.dirs import cache_dir
from kcache.errors import ArtifactNotFoundError, CorruptArtifactError
from kcache.fsutil import atomic_write
from kcache.index.file import FileIndex
from kcache.keys import sha256_hex
from kcache.locks import FileKeyLock, SingleFlight
from kcache.store.local import LocalArtifactStore

__all__ = ["NodeTier", "default_cache_dir"]


def default_cache_dir() -> Path:
    """``$KCACHE_CACHE_DIR``, else ``$XDG_CACHE_HOME/kcache/client`` (``~/.cache/kcache/client``)."""
    return cache_dir()


class NodeTier:
    """Artifacts by recipe key in ``root``, shared by all processes that open ``root``."""

    def __init__(self, root: str | os.PathLike[str], *, lock_timeout: float = 900.0) -> None:
        self.root = Path(root)
        self.store = LocalArtifactStore(self.root)
        self.index = FileIndex(self.root)
        self.lock = SingleFlight(FileKeyLock(self.root))
        self.lock_timeout = lock_timeout

    def lookup(self, recipe_key: str) -> tuple[ArtifactMeta, bytes] | None:
        """The artifact and its verified bytes, or None.

        A blob whose bytes no longer match its digest is quarantined by the store
        and its alias dropped, so the caller refetches instead of using it. A
        negative entry (a failed local compile) is not an answer here: the server
        may know better.
        """
        entry = self.index.lookup(recipe_key)
        if entry is None or isinstance(entry, CompileFailure):
            return None
        try:
            data = self.store.get(entry.digest)
        except CorruptArtifactError:
            self.index.forget(recipe_key)
            return None
        except ArtifactNotFoundError:
            self.index.forget(recipe_key)  # metadata without a blob (gc, or a manual delete)
            return None
        return entry, data

    def publish(self, recipe_key: str, base_key: str, meta: ArtifactMeta, data: bytes) -> Path:
        """Store verified bytes, then the index entry (the blob first, as everywhere)."""
        digest = self.store.put(data)
        if digest != meta.digest:  # the caller verified already; this is a second line of defence
            raise CorruptArtifactError(meta.digest, digest, None)
        self.index.record_artifact(recipe_key, base_key, meta)
        return self.store.path(digest)

    def path(self, digest: str) -> Path:
        """Where the blob lives."""
        return self.store.path(digest)

    @contextlib.contextmanager
    def hold(self, recipe_key: str) -> Iterator[bool]:
        """The per-key download lock; yields True when another process or thread had it first."""
        with self.lock.hold(recipe_key, self.lock_timeout) as waited:
            yield waited

    # ---------------------------------------------------------------- server facts
    def _facts_path(self, url: str) -> Path:
        return self.root / "servers" / f"{sha256_hex(url)[:32]}.json"

    def save_server_facts(self, url: str, facts: dict[str, Any]) -> None:
        """Remember what a server said (its default toolchain), so keys can be computed offline."""
        atomic_write(
            self._facts_path(url),
            json.dumps({"url": url, "saved_at": time.time(), **facts}).encode(),
        )

    def load_server_facts(self, url: str) -> dict[str, Any] | None:
        """The last facts saved for ``url``, or None."""
        try:
            data = json.loads(self._facts_path(url).read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None
