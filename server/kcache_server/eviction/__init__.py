"""The server store's byte cap: a background evictor, one at a time across replicas.

Policy (:mod:`kcache.eviction`): when the artifacts the index holds pass the high-water
mark of ``max_store_bytes``, the least recently used unpinned ones are evicted down
to the low-water mark. Recency is ``artifacts.last_used_at``, which the audit writer
refreshes in batches from every hit and fetch (no write per request); an artifact
never served counts from its creation.

Order of an eviction, so that no row ever names a missing blob:

1. one transaction per batch deletes the artifacts' aliases, manifest entries,
   compile charges and rows, and logs them in the eviction log (a row used since the
   pass began, or pinned meanwhile, is skipped): :meth:`SqlIndex.evict
   <kcache_server.index.SqlIndex.evict>`;
2. this process forgets those recipe keys and blobs in its memory caches; every
   other replica does the same when it reads the log (every ``poll_s``):
   :mod:`~kcache_server.eviction.log`;
3. the blob goes last, by the store's own collection protocol, and not while a
   compile may be about to name it again: :mod:`~kcache_server.eviction.blobs`.

One evictor at a time (:mod:`~kcache_server.eviction.lock`): a PostgreSQL advisory
lock, or on SQLite a file lock in the data directory. A process that does not get it
skips its pass; whoever holds it does the work. Compiles wake the evictor
(:mod:`~kcache_server.eviction.evictor`), so the store is over its high-water mark
for at most one pass after a compile pushed it there. What ``kcache cache info|ls``
show is :mod:`~kcache_server.eviction.reports`.
"""

from kcache_server.eviction.blobs import EvictedBlobs
from kcache_server.eviction.evictor import PassReport, StoreEvictor, install_eviction
from kcache_server.eviction.lock import EvictorLock
from kcache_server.eviction.log import EvictionLog, evictions_between
from kcache_server.eviction.reports import RemovalReport, StoreEntry, StoreInfo, list_entries

__all__ = [
    "EvictedBlobs",
    "EvictionLog",
    "EvictorLock",
    "PassReport",
    "RemovalReport",
    "StoreEntry",
    "StoreEvictor",
    "StoreInfo",
    "evictions_between",
    "install_eviction",
    "list_entries",
]
