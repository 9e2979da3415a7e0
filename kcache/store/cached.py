"""``CachedArtifactStore``: a bounded local blob directory in front of a remote store (a bucket).

Each server replica keeps its own data directory; the bucket behind it is shared.
The remote store is the truth: a blob is published there first, then kept locally.
A read is served from the local directory when the blob is there (a file read, as
fast as a plain :class:`~kcache.store.local.LocalArtifactStore`), else fetched from
the remote store, verified, and published locally with the same atomic
write-and-rename, so a cold replica fills itself from the bucket and a warm one
never asks it. A local copy that fails verification is quarantined and fetched
again; a remote one that fails is the remote store's to report.

The local directory is bounded with the policy every kcache store shares
(:mod:`kcache.eviction`): above the high-water mark of ``max_bytes``, least recently
used local copies (by mtime, refreshed on every local read) are removed down to the
low-water mark. Removing a local copy never loses a blob: the bucket still holds it.

It subclasses :class:`LocalArtifactStore`, so everything the server does with files
(serving by path, free-space checks) works on the local copies unchanged;
:meth:`path` fills the local copy first, :meth:`local_file` never does.

Collection (:meth:`CachedArtifactStore.collect_many`) deletes from the remote store
too, and counts a blob's age from the first call that asked about it: a bucket cannot
show that a blob was stored again (its conditional PUT leaves an object it already
holds untouched), so the collector's grace runs from when the rows went.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from kcache.errors import ArtifactNotFoundError, CorruptArtifactError
from kcache.eviction import LruCandidate, WaterMarks, least_recently_used
from kcache.fsutil import TMP_PREFIX, atomic_write
from kcache.keys import is_hex_key, require_hex_key
from kcache.lru import LruCache
from kcache.store.base import COLLECT_BATCH, ArtifactStore, BlobInfo, Collected, Leftovers, NamedNow
from kcache.store.local import LocalArtifactStore

__all__ = ["CachedArtifactStore"]

_log = logging.getLogger(__name__)


class CachedArtifactStore(LocalArtifactStore):
    """An :class:`~kcache.store.base.ArtifactStore`: ``remote`` behind a bounded local directory."""

    remote: ArtifactStore

    def __init__(
        self,
        root: str | os.PathLike[str],
        remote: ArtifactStore,
        *,
        max_bytes: int,
        high_water: float = 0.9,
        low_water: float = 0.8,
    ) -> None:
        super().__init__(root)
        self.remote = remote
        self.marks = WaterMarks(max_bytes, high_water, low_water)
        self._evict_lock = threading.Lock()
        # Digests the remote store was seen to hold: a hit whose blob is not local yet asks
        # the bucket once, not on every request. Only delete() removes remote blobs here.
        self._remote_has: LruCache[str, bool] = LruCache(max_entries=100_000)
        self._used = sum(size for _, size, _ in self._local_blobs())
        # Blobs a collector asked about -> when it first did (collect_many): their grace
        # counts from then. Emptied as they go or turn out named; one entry per evicted blob.
        self._unnamed_since: dict[str, float] = {}
        self._unnamed_lock = threading.Lock()

    @property
    def local_bytes(self) -> int:
        """Bytes of local copies as this process counts them (a pass recounts exactly)."""
        return self._used

    # ------------------------------------------------------------------ the contract
    def put(self, data: bytes) -> str:
        """Publish to the remote store (uploaded once), then keep a local copy."""
        digest = self.remote.put(data)
        self._remote_has.put(digest, True)
        if not self._local(digest):
            self._keep_local(digest, data)
        return digest

    def get(self, digest: str) -> bytes:
        """The verified bytes: the local copy, else the remote store's (kept locally)."""
        try:
            data = super().get(digest)
        except ArtifactNotFoundError:
            pass
        except CorruptArtifactError as exc:  # the local copy is quarantined; the bucket's is whole
            _log.warning("local copy of %s was corrupt, fetching it again: %s", digest, exc)
        else:
            # Recency for the local LRU; evicted between the read and now: the bytes are good.
            with contextlib.suppress(FileNotFoundError):
                os.utime(self._path_str(digest))
            return data
        try:
            data = self.remote.get(digest)  # verified by the remote store
        except (ArtifactNotFoundError, CorruptArtifactError):
            self._remote_has.discard(digest)  # gone, or quarantined by the remote store
            raise
        self._remote_has.put(digest, True)
        self._keep_local(digest, data)
        return data

    def has(self, digest: str) -> bool:
        """True when the blob is local or the remote store holds it."""
        if self._local(digest):
            return True
        if self._remote_has.get(digest):
            return True
        present = self.remote.has(digest)
        if present:
            self._remote_has.put(digest, True)
        return present

    def path(self, digest: str) -> Path:
        """The local copy's path, filled from the remote store first when it holds the blob."""
        path = self.path_local(digest)
        if not self._local(digest):
            # Absent everywhere: the path names nothing, as a local store's would.
            with contextlib.suppress(ArtifactNotFoundError):
                self.get(digest)
        return path

    def delete(self, digest: str) -> bool:
        """Remove the blob from the remote store and the local directory."""
        self._remote_has.discard(digest)
        try:
            os.unlink(self._path_str(digest))
            local = True
        except FileNotFoundError:
            local = False
        remote = self.remote.delete(digest)
        return local or remote

    def collect(
        self, digest: str, older_than: float, still_referenced: Callable[[str], bool]
    ) -> int | None:
        """:meth:`LocalArtifactStore.collect` on the local copy only (the bucket keeps its blob)."""
        if not self._local(digest):
            return None  # never fill a copy from the bucket just to collect it
        return super().collect(digest, older_than, still_referenced)

    def blob_info(self, digest: str) -> BlobInfo | None:
        """The remote store's answer: the blob there is the truth (a local copy is younger)."""
        return self.remote.blob_info(digest)

    def collect_many(
        self,
        digests: Sequence[str],
        older_than: float,
        named: NamedNow,
        *,
        dry_run: bool = False,
    ) -> Collected:
        """Delete blobs from the remote store and this directory once they were unnamed since ``older_than``.

        A blob this store was not asked about before is kept and reported young as of
        now; a later call whose ``older_than`` is past that moment deletes it (the local
        copy, then the remote store's blob, whatever its age there) unless ``named``
        names it then. With ``older_than`` one grace before now, that is the grace
        counted from the first call: a compile that stored the same bytes before then
        has committed its row by the second, and the index says so. (One that commits
        between that question and the delete leaves a row without its blob; the engine
        finds the blob missing and compiles the recipe again.)
        """
        done = Collected()
        now = time.time()
        for start in range(0, len(digests), COLLECT_BATCH):
            due: list[str] = []
            with self._unnamed_lock:
                for digest in digests[start : start + COLLECT_BATCH]:
                    require_hex_key(digest, "digest")
                    since = self._unnamed_since.get(digest)
                    if since is None:
                        since = now
                        if not dry_run:
                            self._unnamed_since[digest] = now
                    if since > older_than:  # (at the moment itself: its grace is over)
                        done.young[digest] = since
                    else:
                        due.append(digest)
            if not due:
                continue
            still = named(due)
            unnamed = [digest for digest in due if digest not in still]
            # Asked and answered: the age here no longer counts. Gone, or named again (a
            # later eviction of it starts over).
            if not dry_run:
                with self._unnamed_lock:
                    for digest in due:
                        self._unnamed_since.pop(digest, None)
                for digest in unnamed:
                    self._remote_has.discard(digest)
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(self._path_str(digest))
            # The remote store deletes with its own protocol; the age was decided here.
            gone = self.remote.collect_many(unnamed, math.inf, lambda _: (), dry_run=dry_run)
            done.freed.update(gone.freed)
        return done

    def sweep_leftovers(self, older_than: float, *, dry_run: bool = False) -> Leftovers:
        """The local directory's leftovers (:meth:`LocalArtifactStore.sweep_leftovers`), then the remote store's."""
        local = super().sweep_leftovers(older_than, dry_run=dry_run)
        remote = self.remote.sweep_leftovers(older_than, dry_run=dry_run)
        return Leftovers(
            local.restored + remote.restored,
            local.temp_files + remote.temp_files,
            local.temp_bytes + remote.temp_bytes,
        )

    def digests(self) -> Iterator[str]:
        """The remote store's digests (every local copy is also there)."""
        return self.remote.digests()

    # ------------------------------------------------------------------ the local bound
    def _keep_local(self, digest: str, data: bytes) -> None:
        try:
            atomic_write(self.path_local(digest), data, verify=data)
        except OSError as exc:  # a full local disk costs speed, not correctness
            _log.warning("could not keep a local copy of %s: %s", digest, exc)
            return
        self._used += len(data)
        if self.marks.over(self._used):
            self.evict_local()

    def _local(self, digest: str) -> bool:
        # The local file only: LocalArtifactStore.has goes through path(), which fills.
        return os.path.isfile(self._path_str(digest))

    def path_local(self, digest: str) -> Path:
        """Where the local copy of ``digest`` lives (never filled from the remote store)."""
        return Path(self._path_str(digest))

    def _local_blobs(self) -> Iterator[tuple[str, int, float]]:
        for path in self.blobs.glob("*/*/*"):
            name = path.name
            if name.startswith(TMP_PREFIX) or not is_hex_key(name):
                continue
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            yield name, st.st_size, st.st_mtime

    def evict_local(self) -> int:
        """Remove least recently used local copies down to the low-water mark; bytes freed."""
        if not self._evict_lock.acquire(blocking=False):
            return 0  # a pass is running in this process; it recounts when done
        try:
            candidates = [LruCandidate(n, s, t) for n, s, t in self._local_blobs()]
            used = sum(c.size for c in candidates)
            freed = 0
            for victim in least_recently_used(candidates, self.marks.to_free(used)):
                require_hex_key(victim.name, "digest")
                try:
                    os.unlink(self._path_str(victim.name))
                except FileNotFoundError:
                    continue
                freed += victim.size
            self._used = used - freed
            return freed
        finally:
            self._evict_lock.release()
