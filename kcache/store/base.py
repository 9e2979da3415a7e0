"""The ``ArtifactStore`` seam: blobs addressed by the sha256 of their bytes.

A backend owns everything done to its blobs, garbage collection included: the
server's evictor, ``kcache gc`` and ``kcache db gc`` hand it digests and a question
for the index (:meth:`ArtifactStore.collect_many`), never paths or rename prefixes,
so a new backend is its module here and one line in
:data:`kcache.store.urls.STORE_URL_SCHEMES`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, Protocol, runtime_checkable

__all__ = ["COLLECT_BATCH", "ArtifactStore", "BlobInfo", "Collected", "Leftovers", "NamedNow"]

#: Blobs per question to the index in :meth:`ArtifactStore.collect_many` (one query each).
COLLECT_BATCH = 1000

#: ``named(digests)``: those of ``digests`` that a row (a record) names right now.
NamedNow = Callable[[Sequence[str]], Collection[str]]


class BlobInfo(NamedTuple):
    """A stored blob's size and when it was last written (unix seconds), read without its bytes."""

    size: int
    written_at: float


@dataclass
class Collected:
    """What one :meth:`ArtifactStore.collect_many` did.

    ``freed``: digest -> bytes, the blobs deleted (in a dry run: that would be).
    ``young``: digest -> the unix time its age counts from, the blobs kept because they
    may have been stored at or after the cutoff; asked again once that time is older
    than the caller's grace, they may go. Blobs absent, or named again, are in neither.
    """

    freed: dict[str, int] = field(default_factory=dict)
    young: dict[str, float] = field(default_factory=dict)

    @property
    def bytes_freed(self) -> int:
        """The sizes of the blobs deleted, added up."""
        return sum(self.freed.values())


@dataclass(frozen=True)
class Leftovers:
    """What :meth:`ArtifactStore.sweep_leftovers` found of killed writers and collectors."""

    #: Blobs a collector set aside and never finished with, put back.
    restored: int = 0
    #: Staging files of writers that never published, removed (dry run: that would be).
    temp_files: int = 0
    temp_bytes: int = 0


@runtime_checkable
class ArtifactStore(Protocol):
    """Content-addressed bytes. Publishing is atomic and idempotent; reads verify digests."""

    def put(self, data: bytes) -> str:
        """Publish ``data`` and return its sha256 digest; storing the same bytes twice is a no-op."""
        ...

    def get(self, digest: str) -> bytes:
        """The bytes for ``digest``, verified; raises ArtifactNotFoundError or CorruptArtifactError."""
        ...

    def has(self, digest: str) -> bool:
        """True when a blob named ``digest`` is present (not verified)."""
        ...

    def path(self, digest: str) -> Path:
        """Where the blob lives (present or not); for serving files without copying.

        A store with local copies of another store fills the copy first; a store with no
        local files (a bare bucket) raises TypeError.
        """
        ...

    def local_file(self, digest: str) -> str | None:
        """The blob's file on this machine as a string (present or not), never filled from elsewhere.

        None for a store that keeps no local files. For hot paths that only look at the
        file (``os.stat``): no pathlib object, no round trip.
        """
        ...

    def delete(self, digest: str) -> bool:
        """Remove a blob; True if it was there."""
        ...

    def digests(self) -> Iterator[str]:
        """Every published digest (staging files never appear)."""
        ...

    def blob_info(self, digest: str) -> BlobInfo | None:
        """The blob's size and last write time, without reading it; None when it is absent."""
        ...

    def collect_many(
        self,
        digests: Sequence[str],
        older_than: float,
        named: NamedNow,
        *,
        dry_run: bool = False,
    ) -> Collected:
        """Delete the blobs among ``digests`` that no row names and nobody stored since ``older_than``.

        Garbage collection and eviction both come here. ``named`` is asked once per
        batch of :data:`COLLECT_BATCH` blobs, just before they go (a row committed since
        the caller chose them keeps its blob), so a batch costs one query however many
        blobs it holds. A writer publishes a blob before it commits the row that names
        it; a blob that may have been stored at or after ``older_than`` is kept and
        reported young (:class:`Collected`), and how a backend tells (a file's mtime,
        an object's ``Last-Modified``, when it first found the blob unnamed) is its own
        business. ``dry_run`` removes nothing and reports what would go.
        """
        ...

    def sweep_leftovers(self, older_than: float, *, dry_run: bool = False) -> Leftovers:
        """Undo what killed processes left: set-aside blobs put back, staging files from before ``older_than`` removed.

        Nothing to do for a backend whose writes leave nothing behind (a bucket's
        single PUT). ``dry_run`` restores and removes nothing and counts the files.
        """
        ...

    def probe(self) -> None:
        """Raise StoreUnavailableError when this store cannot take blobs now (the cheapest question it has).

        Only the store's own medium is asked (its directory, its bucket): what it keeps
        copies of (:attr:`remote`) is probed apart, because that may take a round trip.
        """
        ...

    @property
    def remote(self) -> ArtifactStore | None:
        """The store this one keeps bounded local copies of, if any (the truth behind them)."""
        ...
