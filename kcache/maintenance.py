"""Maintenance of a local data directory: verify every blob, collect garbage.

Both are safe while writers run: verification only reads (and quarantines blobs
whose bytes no longer match their name), and garbage collection removes only
staging files older than a grace period and blobs that no index record names
and that are themselves older than the grace period (a writer publishes the blob
before its index record, so a young unreferenced blob may be about to be named;
a writer that reuses an old orphan refreshes its mtime). Each deletion re-checks
the blob's mtime and the index after setting the blob aside, so a blob named by a
row at the moment of deletion is never removed (:meth:`LocalArtifactStore.collect`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from kcache.errors import CorruptArtifactError, KCacheError
from kcache.index.file import FileIndex
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


def check_index_knows_store(store: LocalArtifactStore, referenced: set[str]) -> None:
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
            f"the index names none of the {count} blobs in {store.root}: the database may be lost "
            "or not the one this store belongs to (check --db-url / KCACHE_DB_URL), and collecting "
            "would delete every blob. Restore the database, or start the server once with "
            "--recreate-index to index the blobs again; pass --force to delete them anyway"
        )


def _indexed_digests(index: FileIndex) -> set[str]:
    return {p.stem for p in index.files("artifacts")}


def verify_store(store: LocalArtifactStore, index: FileIndex) -> VerifyReport:
    """Re-hash every blob; quarantine corrupt ones; list indexed artifacts without a blob."""
    return verify_blobs(store, _indexed_digests(index))


def verify_blobs(store: LocalArtifactStore, indexed: Iterable[str]) -> VerifyReport:
    """:func:`verify_store` for any index: ``indexed`` are the digests its artifacts name."""
    report = VerifyReport()
    for digest in list(store.digests()):
        report.checked += 1
        try:
            store.get(digest)
        except CorruptArtifactError:
            report.corrupt.append(digest)
    report.missing = sorted(d for d in set(indexed) if not store.has(d))
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
    store: LocalArtifactStore,
    referenced: set[str],
    *,
    grace_seconds: float = 3600.0,
    still_referenced: Callable[[str], bool] | None = None,
) -> GcReport:
    """Remove old staging files and old blobs whose digest is not in ``referenced``.

    ``referenced`` comes from whichever index owns the store: the JSON files
    (:func:`file_index_references`) or a server's SQL database; it is a snapshot, so
    ``still_referenced(digest)`` is asked again for each blob just before it goes
    (a row committed since the snapshot keeps it).
    """
    report = GcReport()
    store.restore_set_aside()  # an earlier collector was killed between set-aside and delete
    for path in store.stale_temp_files(grace_seconds):
        try:
            report.bytes_freed += path.stat().st_size
            path.unlink()
        except FileNotFoundError:
            continue
        report.temp_files += 1
    cutoff = time.time() - grace_seconds
    recheck = still_referenced or (lambda _digest: False)
    for digest in list(store.digests()):
        if digest in referenced:
            continue
        freed = store.collect(digest, cutoff, recheck)
        if freed is not None:
            report.blobs += 1
            report.bytes_freed += freed
    return report
