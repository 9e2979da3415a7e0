"""Maintenance of a store: verify its blobs, collect garbage.

The store is any :class:`~kcache.store.base.ArtifactStore`: a local directory
(:class:`~kcache.store.local.LocalArtifactStore`) or a server's bucket
(:class:`~kcache.store.s3.S3ArtifactStore`: the truth behind every replica's local
copies, so a server's ``kcache db verify|gc`` work on it directly). What differs
between them (set-aside renames, staging files, an object's age) is the store's own
:meth:`~kcache.store.base.ArtifactStore.collect_many` and
:meth:`~kcache.store.base.ArtifactStore.sweep_leftovers`.

Both are safe while writers run: verification only reads (and quarantines blobs
whose bytes no longer match their name), and garbage collection removes only
staging files older than a grace period and blobs that no index record names
and that are themselves older than the grace period (a writer publishes the blob
before its index record, so a young unreferenced blob may be about to be named;
a writer that reuses an old orphan refreshes its mtime, or the object's
``Last-Modified``). Each deletion re-checks the index and the blob's age just before:
a local blob is set aside first, so a blob named by a row at the moment of deletion
is never removed (:meth:`LocalArtifactStore.collect_many`); a bucket has no rename, see
:meth:`S3ArtifactStore.collect_many` for what that leaves.

Verification is full (every blob of the store re-hashed, every digest the index
names looked for) or a sample (:func:`verify_sample`: that many of the index's
digests, each fetched and hashed, for a bucket too large to read whole every time).
``dry_run`` collection counts what it would remove and changes nothing.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kcache.errors import ArtifactNotFoundError, CorruptArtifactError, KCacheError
from kcache.index.file import FileIndex
from kcache.store.base import ArtifactStore
from kcache.store.local import LocalArtifactStore

__all__ = [
    "MIN_SAFE_GRACE_S",
    "GcReport",
    "VerifyReport",
    "check_file_indexed",
    "check_index_knows_store",
    "collect_garbage",
    "file_index_references",
    "verify_blobs",
    "verify_sample",
    "verify_store",
]

#: A server's data directory holds its SQLite database under this name.
_SERVER_DB = "kcache.db"

#: Grace periods below this need an explicit force: a compile can take minutes between
#: publishing its blob and committing the row that names it.
MIN_SAFE_GRACE_S = 600.0


@dataclass
class VerifyReport:
    """What ``verify_store`` found."""

    checked: int = 0
    corrupt: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # indexed artifacts whose blob is gone
    #: How many of the index's digests a sample drew (None: a full verification).
    sampled: int | None = None

    @property
    def ok(self) -> bool:
        """True when nothing is corrupt or missing."""
        return not self.corrupt and not self.missing


@dataclass
class GcReport:
    """What ``collect_garbage`` removed."""

    temp_files: int = 0
    blobs: int = 0
    bytes_freed: int = 0
    #: Nothing was removed: the counts are what a real run would have removed.
    dry_run: bool = False


def check_file_indexed(root: Path) -> None:
    """Refuse a directory whose blobs are indexed elsewhere (a server's SQL database).

    Garbage collection keeps only blobs that the JSON index names; run on a server's
    data directory it would see no references and delete the whole store.
    """
    if (root / _SERVER_DB).exists() or (
        (root / "blobs").is_dir() and not (root / "index").is_dir()
    ):
        raise KCacheError(
            f"{root} is a kcache server's data directory (its index is in SQL, not in {root}/index); "
            "`kcache gc`/`verify` here work on CLI and client-tier directories only"
        )


def store_name(store: ArtifactStore) -> str:
    """Where ``store`` keeps its blobs, for messages: its URL, or its directory."""
    url = getattr(store, "url", None)
    return str(url) if url else str(getattr(store, "root", store))


def check_index_knows_store(store: ArtifactStore, referenced: set[str]) -> None:
    """Refuse to collect when the index names none of the store's blobs.

    That is what a lost, recreated or wrong index looks like (a deleted database, a
    different ``--db-url``): collecting would delete every blob. A store whose blobs
    are all orphans for a legitimate reason is rare; the caller offers a force flag.
    """
    count = 0
    for digest in store.digests():
        if digest in referenced:
            return
        count += 1
    if count:
        raise KCacheError(
            f"the index names none of the {count} blobs in {store_name(store)}: the database may be lost "
            "or not the one this store belongs to (check --db-url / KCACHE_DB_URL), and collecting "
            "would delete every blob. Restore the database, or start the server once with "
            "--recreate-index to index the blobs again; pass --force to delete them anyway"
        )


def _indexed_digests(index: FileIndex) -> set[str]:
    return {p.stem for p in index.files("artifacts")}


def verify_store(store: LocalArtifactStore, index: FileIndex) -> VerifyReport:
    """Re-hash every blob; quarantine corrupt ones; list indexed artifacts without a blob."""
    return verify_blobs(store, _indexed_digests(index))


def verify_blobs(store: ArtifactStore, indexed: Iterable[str]) -> VerifyReport:
    """:func:`verify_store` for any index and store: ``indexed`` are the digests its artifacts name.

    Every blob the store lists is read and hashed (a bucket's objects are downloaded:
    the replica's local copies are not the bucket); every indexed digest it does not
    list is looked for once more (it may have been published since the listing).
    """
    report = VerifyReport()
    listed: set[str] = set()
    for digest in list(store.digests()):
        listed.add(digest)
        report.checked += 1
        try:
            store.get(digest)
        except CorruptArtifactError:  # quarantined: a row naming it is missing its blob now
            report.corrupt.append(digest)
            listed.discard(digest)
        except ArtifactNotFoundError:  # deleted since the listing
            listed.discard(digest)
    report.missing = sorted(d for d in set(indexed) - listed if not store.has(d))
    return report


def verify_sample(
    store: ArtifactStore, indexed: Iterable[str], sample: int, rng: random.Random | None = None
) -> VerifyReport:
    """Fetch and hash ``sample`` of the ``indexed`` digests, drawn at random: missing or corrupt.

    For a store too large to read whole: each run checks other digests, and a blob
    lost or damaged anywhere is found with the chance ``sample / len(indexed)`` per run.
    """
    digests = sorted(set(indexed))
    drawn = (rng or random.SystemRandom()).sample(digests, min(sample, len(digests)))
    report = VerifyReport(sampled=len(drawn))
    for digest in drawn:
        report.checked += 1
        try:
            store.get(digest)
        except CorruptArtifactError:
            report.corrupt.append(digest)
        except ArtifactNotFoundError:
            report.missing.append(digest)
    report.corrupt.sort()
    report.missing.sort()
    return report


def file_index_references(index: FileIndex) -> set[str]:
    """Every digest a JSON index names (artifact records and manifest entries)."""
    referenced = _indexed_digests(index)
    for manifest in index.files("manifests"):
        try:
            referenced.update(e["digest"] for e in json.loads(manifest.read_text()))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return referenced


def collect_garbage(
    store: ArtifactStore,
    referenced: set[str],
    *,
    grace_seconds: float = 3600.0,
    still_referenced: Callable[[str], bool] | None = None,
    dry_run: bool = False,
) -> GcReport:
    """Remove old staging files and old blobs whose digest is not in ``referenced``.

    ``referenced`` comes from whichever index owns the store: the JSON files
    (:func:`file_index_references`) or a server's SQL database; it is a snapshot, so
    ``still_referenced(digest)`` is asked again for each blob just before it goes
    (a row committed since the snapshot keeps it). A bucket has no staging files (a
    blob is one PUT). ``dry_run`` counts what would go and changes nothing.
    """
    report = GcReport(dry_run=dry_run)
    cutoff = time.time() - grace_seconds
    # First: an earlier collector killed between set-aside and delete left blobs to put back.
    leftovers = store.sweep_leftovers(cutoff, dry_run=dry_run)
    report.temp_files = leftovers.temp_files
    report.bytes_freed = leftovers.temp_bytes
    recheck = still_referenced or (lambda _digest: False)

    def named(digests: Sequence[str]) -> set[str]:
        return {digest for digest in digests if recheck(digest)}

    unreferenced = [digest for digest in store.digests() if digest not in referenced]
    collected = store.collect_many(unreferenced, cutoff, named, dry_run=dry_run)
    report.blobs = len(collected.freed)
    report.bytes_freed += collected.bytes_freed
    return report
