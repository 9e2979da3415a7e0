"""The blobs of evicted artifacts: deleted once no row names them, the young ones after their grace.

Blobs go last, after their rows (:mod:`kcache_server.eviction`), and by the store's own
protocol (:meth:`~kcache.store.base.ArtifactStore.collect_many`): batched, one
question to the index per thousand blobs, just before they go, so a compile that stored
the same bytes again in the meantime keeps them. A directory sets each blob aside by
rename first; a bucket, which cannot show a reuse, counts the grace from the eviction.
A blob written or reused within ``grace_s`` (a compile publishes its blob before it
commits the row that names it) is kept for now and offered again when its grace is
over. A reader holding a blob open finishes its read: unlinking a file does not take it
from an open descriptor.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from kcache.store.base import ArtifactStore
from kcache_server.index import SqlIndex

__all__ = ["EvictedBlobs"]


class EvictedBlobs:
    """Deletes evicted artifacts' blobs through the store, and keeps those it must wait for."""

    def __init__(self, store: ArtifactStore, index: SqlIndex, *, grace_s: float) -> None:
        self.store = store
        self.index = index
        self.grace_s = grace_s
        # Blobs kept for now (written or reused within the grace): digest -> when due.
        self._deferred: dict[str, float] = {}
        self._lock = threading.Lock()

    @property
    def waiting(self) -> bool:
        """Whether some blob waits for its grace to end."""
        return bool(self._deferred)

    def collect(self, digests: Sequence[str]) -> None:
        """Delete the blobs of ``digests`` that no row names; the young wait for their grace."""
        if not digests:
            return
        done = self.store.collect_many(digests, time.time() - self.grace_s, self.index.named)
        if done.young:
            with self._lock:
                for digest, since in done.young.items():
                    self._deferred[digest] = since + self.grace_s

    def collect_due(self) -> None:
        """Offer the kept blobs whose grace is over again: named meanwhile (recompiled), kept; else gone."""
        now = time.time()
        with self._lock:
            due = [digest for digest, when in self._deferred.items() if when <= now]
            for digest in due:
                del self._deferred[digest]
        self.collect(due)
