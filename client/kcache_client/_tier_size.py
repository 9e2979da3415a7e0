"""A node tier's bounded size: what it holds, how much, and what goes when it holds too much.

The tier is bounded (:mod:`kcache.eviction`): ``max_bytes`` (``KCACHE_CACHE_MAX_BYTES``,
default 10 GiB or 10 % of the tier's filesystem, whichever is smaller; 0 for none).
When a publish's bookkeeping (written when the process is idle, every 32 publishes, or
on demand: :meth:`~kcache_client._tier.NodeTier.publish`) takes the blobs past the
high-water mark, the least recently used are evicted down to the low-water mark, by one
process at a time (a file lock; the others skip their pass). Recency is the mtime of an
entry's artifact record under ``index/artifacts/``, touched when a lookup reads the entry
(at most once per entry every few seconds per process), because atime is often off
(``noatime``). A pack (:mod:`kcache_client._packs`) is one unit of the LRU (its mtime), and
removing some of its entries writes a new pack without them.

Eviction never hands a reader wrong or partial bytes: it removes an entry's
artifact record and recipe aliases first and its blob last; a reader that opened
the blob keeps reading it (an unlinked file lives on for open descriptors) and
verifies the digest; one that comes later finds no blob, drops the alias and
fetches again. A publisher that stored the same bytes again meanwhile keeps them:
the evictor re-checks the blob's mtime and the record after setting the blob aside.
A publish writes no record for a blob gone by then, and takes back one written as it
went, so no record names a missing blob (:meth:`TierSize.record`). Nothing is removed
from a tier others could have rearranged: its standing is checked again first.

A tier holds one :class:`TierSize`, made at its first publish's bookkeeping, eviction or
listing: a process that only reads never imports this module.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from kcache.artifact import ArtifactMeta
from kcache.errors import KCacheError, LockTimeoutError
from kcache.eviction import LruCandidate, WaterMarks, least_recently_used
from kcache.index.file import FileIndex
from kcache.locks import try_file_lock
from kcache.standing import Standing
from kcache.store.local import LocalArtifactStore
from kcache_client._packs import PACKS_DIR, PackFile, TierPacks

__all__ = ["SizedTier", "TierEntry", "TierRemoval", "TierSize", "TierUsage"]

# A pack half written this long ago was left by a writer that died (a prefetch takes seconds).
_PARTIAL_PACK_S = 3600.0
# A process rescans the tier's size after a publish at least this often (or 20 scans' time).
_RESCAN_MIN_S = 1.0


class SizedTier(Protocol):
    """What :class:`TierSize` reads of its node tier (a :class:`~kcache_client._tier.NodeTier`)."""

    @property
    def root(self) -> Path: ...

    @property
    def store(self) -> LocalArtifactStore: ...

    @property
    def index(self) -> FileIndex: ...

    @property
    def packs(self) -> TierPacks: ...

    @property
    def standing(self) -> Standing: ...

    @property
    def marks(self) -> WaterMarks: ...

    def check_standing(self) -> Standing: ...

    def location(self, digest: str) -> str: ...

    def record_path(self, digest: str) -> str: ...


@dataclass(frozen=True)
class TierEntry:
    """One stored artifact of the tier: its blob, what the record says, when it was last used."""

    digest: str
    size: int
    last_used: float  # epoch seconds
    recipe_keys: tuple[str, ...] = ()
    kernel: str = ""
    target: str = ""
    kind: str = ""


@dataclass(frozen=True)
class TierUsage:
    """The tier's size against its cap (``kcache cache info``)."""

    root: Path
    bytes_used: int
    entries: int
    marks: WaterMarks
    oldest_use: float | None
    newest_use: float | None


@dataclass(frozen=True)
class TierRemoval:
    """What an eviction or a removal did."""

    removed: int
    bytes_freed: int
    unknown: tuple[str, ...] = ()


@dataclass(frozen=True)
class _Scanned:
    """A blob or a pack as one scan saw it (its own mtime tells a later rewrite apart).

    A pack is one unit of the LRU: ``digest`` is ``packs/<name>``, ``pack`` what it holds.
    """

    digest: str
    size: int
    last_used: float
    blob_mtime: float
    pack: PackFile | None = None

    @property
    def entries(self) -> int:
        return 1 if self.pack is None else len(self.pack.entries)


class TierSize:
    """The size of one tier as this process last scanned it, and its eviction (module docstring).

    Its callers write their own pending publishes' records first
    (:meth:`~kcache_client._tier.NodeTier.flush`): they count.
    """

    def __init__(self, tier: SizedTier) -> None:
        self._tier = tier
        #: The tier's one-evictor-at-a-time file lock.
        self.evict_lock_path = tier.root / "locks" / "evict.lock"
        self._lock = threading.Lock()
        self._scanned_bytes: int | None = None  # the tier's size at this process's last scan
        self._since_scan = 0  # bytes this process published since
        self._scanned_at = float("-inf")
        self._rescan_s = _RESCAN_MIN_S

    def record(self, base_key: str | None, meta: ArtifactMeta, size: int) -> None:
        """A published entry's record and manifest entry; may evict.

        The blob may be gone by now (evicted by another process, which saw no record
        yet, removed by ``kcache cache clear``, quarantined as damaged): then nothing is
        recorded, and a record written as the blob went is taken back, so that no
        record names a missing blob. (Its alias, if still there, reads as absent.)
        """
        tier = self._tier
        blob = tier.location(meta.digest)
        if not os.path.isfile(blob):
            return
        if base_key is not None:
            tier.index.record_metadata(base_key, meta)
        elif tier.index.artifact(meta.digest) is None:  # the record alone (publish)
            tier.index._write("artifacts", meta.digest, meta.to_dict())  # the index's own layout
        if not os.path.isfile(blob):
            with contextlib.suppress(OSError):
                os.unlink(tier.record_path(meta.digest))
            return
        self.stored(size)

    def stored(self, nbytes: int) -> None:
        """Note ``nbytes`` just stored in the tier (a publish, a local compile); may evict.

        The tier's size is rescanned when this process's own publishes since its last
        scan could have taken it past the high-water mark, and at least every second
        or so (other processes publish too), never more often than 20 scans' time.
        """
        marks = self._tier.marks
        if not marks.bounded:
            return
        with self._lock:
            self._since_scan += nbytes
            estimate = (self._scanned_bytes or 0) + self._since_scan
            due = time.monotonic() - self._scanned_at >= self._rescan_s
            if self._scanned_bytes is not None and not due and not marks.over(estimate):
                return
        self.evict()

    def _scan(self) -> list[_Scanned]:
        """Every blob and pack of the tier, with its size and last use (and this process's
        size estimate brought up to date)."""
        tier = self._tier
        started = time.monotonic()
        found = []
        for digest in tier.store.digests():
            try:
                blob = os.stat(tier.store.path(digest))
            except FileNotFoundError:
                continue
            try:
                used = os.stat(tier.record_path(digest)).st_mtime
            except FileNotFoundError:
                used = blob.st_mtime  # no record (yet): as old as the blob
            found.append(_Scanned(digest, blob.st_size, used, blob.st_mtime))
        for pack in tier.packs.files():
            found.append(
                _Scanned(f"{PACKS_DIR}/{pack.name}", pack.size, pack.mtime, pack.mtime, pack)
            )
        took = time.monotonic() - started
        with self._lock:
            self._scanned_bytes = sum(b.size for b in found)
            self._since_scan = 0
            self._scanned_at = time.monotonic()
            self._rescan_s = max(_RESCAN_MIN_S, 20 * took)
        return found

    @contextlib.contextmanager
    def _evicting(self, wait_s: float) -> Iterator[bool]:
        """The tier's one-evictor-at-a-time file lock; yields False when not had within ``wait_s``."""
        with try_file_lock(self.evict_lock_path, wait_s) as held:
            yield held

    @contextlib.contextmanager
    def _evicting_within(self, wait_s: float) -> Iterator[None]:
        """:meth:`_evicting`, or LockTimeoutError when another process held it ``wait_s``."""
        with self._evicting(wait_s) as held:
            if not held:
                raise LockTimeoutError(
                    f"another process held {self.evict_lock_path} for {wait_s:.0f}s"
                )
            yield

    def evict(self) -> TierRemoval | None:
        """Evict least recently used entries down to the low-water mark if over the high one.

        None when another process is evicting already (it does the work).
        """
        tier = self._tier
        if not tier.standing.writable:
            return None  # nothing is removed from a tier others could have rearranged
        with self._evicting(0) as held:
            if not held:
                return None
            tier.packs.sweep_partials(time.time() - _PARTIAL_PACK_S)
            scanned = self._scan()
            to_free = tier.marks.to_free(sum(b.size for b in scanned))
            if to_free <= 0:
                return TierRemoval(0, 0)
            candidates = [LruCandidate(b.digest, b.size, b.last_used) for b in scanned]
            chosen = {c.name for c in least_recently_used(candidates, to_free)}
            return self._remove([b for b in scanned if b.digest in chosen])

    def aliases(self) -> dict[str, list[Path]]:
        """digest -> the recipe alias files that name it (read only when removing)."""
        found: dict[str, list[Path]] = {}
        for path in self._tier.index.files("recipes"):
            digest = _alias_digest(path)
            if digest is not None:
                found.setdefault(digest, []).append(path)
        return found

    def _remove(self, victims: Iterable[_Scanned]) -> TierRemoval:
        """Records and aliases first, blobs last (kept when republished since the scan).

        The tier's standing is checked again first: a directory swapped for a link since
        the tier was opened stops every deletion (nothing outside the tier is removed).
        """
        tier = self._tier
        standing = tier.check_standing()
        if not standing.writable:
            raise KCacheError(
                f"nothing removed from the node tier {tier.root}: {standing.reason} "
                "(an untrusted tier is never written or cleaned)"
            )
        aliases = self.aliases()
        removed = freed = 0
        for victim in victims:
            if victim.pack is not None:  # a pack goes whole; its readers keep their descriptor
                gone_bytes = tier.packs.remove(victim.pack.name)
                if gone_bytes:
                    removed += len(victim.pack.entries)
                    freed += gone_bytes
                continue
            Path(tier.record_path(victim.digest)).unlink(missing_ok=True)
            for alias in aliases.get(victim.digest, ()):
                if _alias_digest(alias) == victim.digest:  # not re-pointed meanwhile
                    alias.unlink(missing_ok=True)
            gone = tier.store.collect(
                victim.digest,
                # Kept if its mtime moved since the scan (stored again) or a record names it again.
                victim.blob_mtime + 1e-6,
                self._recorded,
            )
            if gone is not None:
                removed += 1
                freed += gone
        with self._lock:
            if self._scanned_bytes is not None:
                self._scanned_bytes -= freed
        return TierRemoval(removed, freed)

    def _recorded(self, digest: str) -> bool:
        return os.path.exists(self._tier.record_path(digest))

    def entries(self) -> list[TierEntry]:
        """Every stored artifact, most recently used first, with its recipe keys and metadata."""
        aliases = self.aliases()
        listed = []
        for blob in self._scan():
            if blob.pack is not None:
                for key, packed in blob.pack.entries.items():
                    listed.append(
                        TierEntry(
                            packed.digest,
                            packed.size,
                            blob.last_used,
                            (key,),
                            packed.kernel,
                            packed.target,
                            packed.kind,
                        )
                    )
                continue
            meta = self._tier.index.artifact(blob.digest)
            keys = tuple(sorted(p.stem for p in aliases.get(blob.digest, ())))
            listed.append(
                TierEntry(
                    blob.digest,
                    blob.size,
                    blob.last_used,
                    keys,
                    meta.kernel if meta else "",
                    meta.target if meta else "",
                    meta.kind if meta else "",
                )
            )
        return sorted(listed, key=lambda e: (-e.last_used, e.digest))

    def usage(self) -> TierUsage:
        """Bytes used of the cap, entries, oldest and newest use."""
        scanned = self._scan()
        stamps = [b.last_used for b in scanned]
        return TierUsage(
            self._tier.root,
            sum(b.size for b in scanned),
            sum(b.entries for b in scanned),
            self._tier.marks,
            min(stamps, default=None),
            max(stamps, default=None),
        )

    def remove(self, keys: Iterable[str], *, wait_s: float = 60.0) -> TierRemoval:
        """Remove the entries ``keys`` name (recipe keys or digests) now."""
        tier = self._tier
        wanted: dict[str, str] = {}
        unknown = []
        packs = tier.packs.files()
        packed: dict[str, set[str]] = {}  # pack name -> its recipe keys to remove
        for key in keys:
            in_packs = {
                (pack.name, k)
                for pack in packs
                for k, meta in pack.entries.items()
                if key in (k, meta.digest)
            }
            for name, k in in_packs:
                packed.setdefault(name, set()).add(k)
            entry = tier.index.lookup(key)
            if isinstance(entry, ArtifactMeta):
                wanted[entry.digest] = key
            elif tier.store.has(key):
                wanted[key] = key
            elif not in_packs:
                unknown.append(key)
        with self._evicting_within(wait_s):
            removal = self._remove([b for b in self._scan() if b.digest in wanted])
            removed, freed = removal.removed, removal.bytes_freed
            if packed and not tier.check_standing().writable:
                raise KCacheError(f"nothing removed from the node tier {tier.root}: not writable")
            for name, drop in packed.items():
                count, nbytes = tier.packs.without(name, drop)
                removed += count
                freed += nbytes
        return TierRemoval(removed, freed, tuple(unknown))

    def clear(self, *, wait_s: float = 60.0) -> TierRemoval:
        """Remove every entry."""
        with self._evicting_within(wait_s):
            return self._remove(self._scan())


def _alias_digest(path: Path) -> str | None:
    """The digest a recipe alias file points at (None for a negative entry or an unreadable file)."""
    try:
        with open(path, "rb") as handle:
            entry = json.loads(handle.read())
    except (OSError, ValueError):
        return None
    digest = entry.get("digest") if isinstance(entry, dict) else None
    return digest if isinstance(digest, str) else None
