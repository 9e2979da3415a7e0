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
after all (:meth:`LocalArtifactStore.collect`).
"""

from __future__ import annotations

import hashlib
import os
import secrets
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from kcache.errors import ArtifactNotFoundError, CorruptArtifactError
from kcache.fsutil import (
    TMP_PREFIX,
    UnsafeFileError,
    atomic_write,
    fsync_dir,
    read_file,
    regular_files,
)
from kcache.keys import is_hex_key, require_hex_key

__all__ = ["SET_ASIDE_PREFIX", "LocalArtifactStore"]

#: Blobs being garbage-collected are renamed to this prefix first; listings skip them.
SET_ASIDE_PREFIX = ".gc-"


class LocalArtifactStore:
    """An :class:`~kcache.store.base.ArtifactStore` over a directory."""

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
        self.blobs.mkdir(parents=True, exist_ok=True)
        self._blobs_str = str(self.blobs)
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

    def collect(
        self, digest: str, older_than: float, still_referenced: Callable[[str], bool]
    ) -> int | None:
        """Delete an unreferenced blob unless it is young or named after all; the bytes freed, or None.

        Safe against a writer reusing the blob at the same moment: the blob is renamed
        aside first (a writer that comes later finds no blob and publishes a fresh
        copy), then its mtime is read again (a writer that came earlier refreshed it)
        and ``still_referenced(digest)`` asks the index once more (a row committed
        since the caller's snapshot). If either says keep, it is renamed back.
        """
        path = self.path(digest)
        try:
            if os.lstat(path).st_mtime >= older_than:
                return None
            aside = path.with_name(
                f"{SET_ASIDE_PREFIX}{digest}-{os.getpid()}-{secrets.token_hex(4)}"
            )
            os.rename(path, aside)
        except FileNotFoundError:
            return None
        try:
            st = os.lstat(aside)
            keep = st.st_mtime >= older_than or still_referenced(digest)
        except BaseException:
            os.replace(aside, path)
            raise
        if keep:
            os.replace(aside, path)  # a fresh copy published meanwhile has the same bytes
            return None
        aside.unlink()
        return st.st_size

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

    def digests(self) -> Iterator[str]:
        """Published digests; staging files (``.tmp-*``), links and anything irregular are skipped."""
        for entry in regular_files(self.blobs, self._depth):
            if is_hex_key(entry.name):
                yield entry.name

    def stale_temp_files(self, older_than_s: float = 3600.0) -> list[Path]:
        """Staging files left by killed writers (never visible as blobs; ``gc`` removes them)."""
        cutoff = time.time() - older_than_s
        return [
            Path(entry.path)
            for entry in regular_files(self.blobs, self._depth)
            if entry.name.startswith(TMP_PREFIX)
            and entry.stat(follow_symlinks=False).st_mtime < cutoff
        ]
