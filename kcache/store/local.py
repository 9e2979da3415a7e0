"""``LocalArtifactStore``: blobs in a directory (local disk or a shared POSIX filesystem).

Layout: ``<root>/blobs/ab/cd/<digest>`` (``<root>/blobs/<digest>`` in a flat cache
directory, :func:`kcache.dirs.cache_layout`), ``<root>/quarantine/<digest>.<time>``.
A blob is published by writing a uniquely named temp file in its own directory,
fsyncing it, checking its digest, renaming it into place and fsyncing the
directory; readers therefore see no blob or a whole one. Two writers of the same
bytes agree on the name, so no lock is needed for correctness.

Garbage collection and reuse meet safely without a lock either: publishing bytes
that are already stored refreshes the blob's mtime (so the collector's grace period
covers a blob that was an orphan until now), and the collector sets a blob aside
by rename before deleting it, keeping it when it turns out to be young or named
after all (:meth:`LocalArtifactStore.collect_many`, batched: one question to the
index per thousand blobs). A collector killed between the rename and the delete
leaves ``.gc-`` files that :meth:`LocalArtifactStore.sweep_leftovers` puts back.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import stat
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from kcache.errors import ArtifactNotFoundError, CorruptArtifactError, StoreUnavailableError
from kcache.fsutil import (
    TMP_PREFIX,
    UnsafeFileError,
    atomic_write,
    fsync_dir,
    make_dirs,
    read_file,
    regular_files,
)
from kcache.keys import is_hex_key, require_hex_key
from kcache.store.base import COLLECT_BATCH, ArtifactStore, BlobInfo, Collected, Leftovers, NamedNow

__all__ = ["SET_ASIDE_PREFIX", "LocalArtifactStore"]

#: Blobs being garbage-collected are renamed to this prefix first; listings skip them.
SET_ASIDE_PREFIX = ".gc-"


class LocalArtifactStore:
    """An :class:`~kcache.store.base.ArtifactStore` over a directory."""

    #: A directory is the truth for its blobs: it keeps copies of no other store.
    remote: ArtifactStore | None = None

    def __init__(
        self, root: str | os.PathLike[str], *, durable: bool = True, flat: bool = False
    ) -> None:
        """Blobs under ``root``; ``durable=False`` publishes without fsync or read-back (caches only).

        Only a cache whose readers verify every blob's digest (they do: :meth:`get`)
        and refetch what is missing or wrong may pass ``durable=False``; see
        :func:`kcache.fsutil.atomic_write`. A source of truth keeps the default.
        ``flat`` keeps every blob in ``blobs/`` itself, without fan-out directories
        (a cache directory's layout says which: :func:`kcache.dirs.cache_layout`).
        """
        self.root = Path(root)
        self.durable = durable
        self.flat = flat
        self.blobs = self.root / "blobs"
        self.quarantine_dir = self.root / "quarantine"
        self._blobs_str = str(self.blobs)
        make_dirs(self._blobs_str)
        # Where a blob's name goes, below blobs/: the glob that lists blobs and staging files.
        self._below = "" if flat else "*/*/"
        self._depth = 0 if flat else 2  # directory levels below blobs/ (regular_files)

    def _path_str(self, digest: str) -> str:
        # String joins: pathlib costs tens of microseconds on a node-tier hit.
        require_hex_key(digest, "digest")
        if self.flat:
            return f"{self._blobs_str}/{digest}"
        return f"{self._blobs_str}/{digest[:2]}/{digest[2:4]}/{digest}"

    def path(self, digest: str) -> Path:
        """``blobs/ab/cd/<digest>`` (flat: ``blobs/<digest>``); the digest is validated, never a client path."""
        return Path(self._path_str(digest))

    def local_file(self, digest: str) -> str | None:
        """The blob's file, as :meth:`path` names it, as a string (the digest validated)."""
        return self._path_str(digest)

    def has(self, digest: str) -> bool:
        """True when the blob file exists."""
        # A string path: pathlib costs several microseconds, and every resolve hit asks.
        return os.path.isfile(self._path_str(digest))

    def put(self, data: bytes) -> str:
        """Publish ``data`` under its sha256; idempotent."""
        digest = hashlib.sha256(data).hexdigest()
        dest = self._path_str(digest)
        try:
            if os.stat(dest).st_size == len(data):
                # Same name, same size: the same bytes (reads verify anyway). Touch it: the
                # blob may be an old orphan that a row is about to name, and the mtime is
                # what garbage collection's grace period looks at.
                os.utime(dest)
                return digest
        except FileNotFoundError:
            pass  # absent, or set aside by the collector a moment ago: publish a fresh copy
        # A durable store reads the file back before it is visible (a short write on a
        # flaky filesystem); a cache's readers verify every blob's digest instead, so it
        # skips the read (a cold node tier publishes a few hundred files).
        atomic_write(dest, data, verify=data if self.durable else None, durable=self.durable)
        return digest

    def get(self, digest: str) -> bytes:
        """Read and verify; a mismatching blob is moved to quarantine and reported.

        So is anything at the blob's name that is not a regular file (a link, a FIFO:
        :class:`~kcache.fsutil.UnsafeFileError`), which is never read.
        """
        path = self._path_str(digest)
        try:
            data = read_file(path)
        except FileNotFoundError:
            raise ArtifactNotFoundError(f"no blob {digest} in {self.blobs}") from None
        except UnsafeFileError as exc:
            raise CorruptArtifactError(
                digest, exc.reason, self._quarantine(Path(path), digest)
            ) from None
        actual = hashlib.sha256(data).hexdigest()
        if actual != digest:
            raise CorruptArtifactError(digest, actual, self._quarantine(Path(path), digest))
        return data

    def _quarantine(self, path: Path, digest: str) -> str | None:
        self.quarantine_dir.mkdir(parents=True, exist_ok=True)
        dest = self.quarantine_dir / f"{digest}.{time.time_ns()}"
        try:
            os.replace(path, dest)  # a link is moved itself, never what it points at
        except FileNotFoundError:
            return None  # another reader quarantined it first
        except PermissionError:
            return None  # another user's file in a shared (sticky) directory: left in place
        fsync_dir(path.parent)
        return str(dest)

    def delete(self, digest: str) -> bool:
        """Remove a blob (garbage collection)."""
        try:
            self.path(digest).unlink()
        except FileNotFoundError:
            return False
        return True

    def blob_info(self, digest: str) -> BlobInfo | None:
        """The file's size and mtime (a link or anything irregular counts as absent)."""
        try:
            st = os.lstat(self._path_str(digest))
        except FileNotFoundError:
            return None
        if not stat.S_ISREG(st.st_mode):
            return None
        return BlobInfo(st.st_size, st.st_mtime)

    def collect(
        self, digest: str, older_than: float, still_referenced: Callable[[str], bool]
    ) -> int | None:
        """:meth:`collect_many` of one blob, asking ``still_referenced(digest)``; the bytes freed, or None."""
        done = self._collect_files(
            [digest],
            older_than,
            lambda digests: [d for d in digests if still_referenced(d)],
            dry_run=False,
        )
        return done.freed.get(digest)

    def collect_many(
        self,
        digests: Sequence[str],
        older_than: float,
        named: NamedNow,
        *,
        dry_run: bool = False,
    ) -> Collected:
        """Delete the unnamed blobs among ``digests`` whose mtime is before ``older_than``.

        Safe against a writer reusing a blob at the same moment: each blob of a batch is
        renamed aside first (a writer that comes later finds no blob and publishes a
        fresh copy), then ``named`` is asked once for the whole batch (a row committed
        since the caller's snapshot) and each set-aside file's mtime is read again (a
        writer that came earlier refreshed it). A blob either says to keep is renamed
        back; the rest are unlinked. Young blobs are reported with their mtime.
        """
        return self._collect_files(digests, older_than, named, dry_run=dry_run)

    def _collect_files(
        self,
        digests: Sequence[str],
        older_than: float,
        named: NamedNow,
        *,
        dry_run: bool,
    ) -> Collected:
        """:meth:`collect_many` on this directory's files (a cached store's local copies too)."""
        done = Collected()
        # Unique to this call, as set-aside names must be; strings: pathlib costs per blob here.
        suffix = f"{os.getpid()}-{secrets.token_hex(4)}"
        for start in range(0, len(digests), COLLECT_BATCH):
            aside: list[tuple[str, str, str]] = []  # (digest, its path, where it was set aside)
            for digest in digests[start : start + COLLECT_BATCH]:
                path = self._path_str(digest)
                try:
                    st = os.lstat(path)
                    if st.st_mtime >= older_than:
                        done.young[digest] = st.st_mtime
                        continue
                    moved = path if dry_run else self._set_aside_name(path, digest, suffix)
                    if not dry_run:
                        os.rename(path, moved)
                except FileNotFoundError:
                    continue
                aside.append((digest, path, moved))
            if not aside:
                continue
            try:
                still = named([digest for digest, _, _ in aside])
                for digest, path, moved in aside:
                    st = os.lstat(moved)
                    young = st.st_mtime >= older_than  # stored again just before the rename
                    if young and digest not in still:
                        done.young[digest] = st.st_mtime
                    if young or digest in still:
                        if not dry_run:  # a fresh copy published meanwhile has the same bytes
                            os.replace(moved, path)
                        continue
                    if not dry_run:
                        os.unlink(moved)
                    done.freed[digest] = st.st_size
            except BaseException:
                if not dry_run:
                    for _, path, moved in aside:
                        with contextlib.suppress(FileNotFoundError):
                            os.replace(moved, path)
                raise
        return done

    def _set_aside_name(self, path: str, digest: str, suffix: str) -> str:
        return f"{os.path.dirname(path)}/{SET_ASIDE_PREFIX}{digest}-{suffix}"

    def restore_set_aside(self) -> int:
        """Put back blobs a collector set aside and never finished with (it was killed); how many."""
        restored = 0
        for entry in regular_files(self.blobs, self._depth):
            if not entry.name.startswith(SET_ASIDE_PREFIX):
                continue
            aside = Path(entry.path)
            digest = aside.name[len(SET_ASIDE_PREFIX) :].split("-", 1)[0]
            if not is_hex_key(digest):
                continue
            try:
                os.replace(aside, aside.with_name(digest))
            except FileNotFoundError:
                continue
            restored += 1
        return restored

    def sweep_leftovers(self, older_than: float, *, dry_run: bool = False) -> Leftovers:
        """:meth:`restore_set_aside`, then remove staging files (``.tmp-*``) last written before ``older_than``."""
        restored = 0 if dry_run else self.restore_set_aside()
        files = size = 0
        for entry in regular_files(self.blobs, self._depth):
            if not entry.name.startswith(TMP_PREFIX):
                continue
            try:
                st = entry.stat(follow_symlinks=False)
                if st.st_mtime >= older_than:
                    continue
                if not dry_run:
                    os.unlink(entry.path)
            except FileNotFoundError:
                continue
            files += 1
            size += st.st_size
        return Leftovers(restored, files, size)

    def probe(self) -> None:
        """Raise StoreUnavailableError unless ``blobs/`` is a directory this process may write."""
        if not (self.blobs.is_dir() and os.access(self.blobs, os.W_OK)):
            raise StoreUnavailableError(str(self.blobs), "the blob directory is not writable")

    def digests(self) -> Iterator[str]:
        """Published digests; staging files (``.tmp-*``), links and anything irregular are skipped."""
        for entry in regular_files(self.blobs, self._depth):
            if is_hex_key(entry.name):
                yield entry.name
