"""The node-local tier: the core's store, index and locks in one directory per node.

Every process of a node (every rank, every job) opens the same directory. Blobs
are published by the core's atomic write under their digest, index entries by
atomic rename, so readers never see half a file and two processes that download
the same blob agree. The per-key lock (in-process single-flight around a record
file lock per key, :class:`~kcache.locks.FileKeyLock`) only makes the node
download a blob once instead of once per rank, and its holder lets go as soon as
the entry's alias is written. It guards no correctness: on a shared filesystem where
locks are advisory or granted to everyone, the worst is a duplicate download.

Nothing is fsynced (``durable=False``), and crash consistency holds without it.
What a reader trusts is checked on every read that could see a new file: a blob
must hash to its digest (the name it was asked for by), an alias must parse, name
its own recipe key and carry metadata of the digest it names. A write that a crash
or power loss cut short (a file empty, truncated, zeros, another file's old blocks)
fails those checks and reads as absent: the kernel is fetched again and its publish
replaces the file (``tests/client/test_tier_crash.py``). An fsync per file and
directory was most of a cold rank's fetch time (B8); it would only make the refetch
rarer.

A process hashes a blob once per file, not once per read: it remembers, per digest,
the identity (device, inode, size, mtime and ctime in ns, read from the descriptor
before the bytes) of the file it verified, and a later read of a file with that
identity hands out the bytes without hashing them again. Likewise an alias: what it
said stands while a ``stat`` shows the same file. That serves a process reading an
entry again (B3's node-tier hit); a process's first read of each file, what a fresh
rank does, is checked in full. Why it is safe: kcache never writes a published file
in place (every publish is a new file renamed over the old, a new inode), any write
into a file through the filesystem moves its mtime and ctime on (ctime cannot be set
from user space), and a truncation or growth changes its size. Timestamps can be
coarse (a clock tick, 2 s on FAT), so an identity is remembered only once the file's
ctime is at least 2 s older than the read (git's "racily clean" rule): a later write
then gets a later timestamp. What it cannot see: bytes changed below the filesystem
(failing media, a raw block device) after this process verified them, until the
file changes or another process reads it; a power loss ends the process and its
memory with it. Every process and every new file is verified at least once.

The tier is bounded (:mod:`kcache.eviction`): ``max_bytes`` (``KCACHE_CACHE_MAX_BYTES``,
default 10 GiB or 10 % of the tier's filesystem, whichever is smaller; 0 for none).
When a publish's bookkeeping (written when the process is idle, every 32 publishes, or
on demand: :meth:`NodeTier.publish`) takes the blobs past the high-water mark, the
least recently used are evicted down to the low-water mark, by one process at a time
(a file lock; the others skip their pass). Recency is the mtime of an entry's artifact record under
``index/artifacts/``, touched when a lookup reads the entry (at most once per
entry every few seconds per process), because atime is often off (``noatime``).

Eviction never hands a reader wrong or partial bytes: it removes an entry's
artifact record and recipe aliases first and its blob last; a reader that opened
the blob keeps reading it (an unlinked file lives on for open descriptors) and
verifies the digest; one that comes later finds no blob, drops the alias and
fetches again. A publisher that stored the same bytes again meanwhile keeps them:
the evictor re-checks the blob's mtime and the record after setting the blob aside.
A publish writes no record for a blob gone by then, and takes back one written as it
went, so no record names a missing blob.

Who else could have written the tier decides what of it is used
(:mod:`kcache.standing`, checked at open and again before anything is deleted): a
*private* tier (this user's, writable by no one else) is used as it is; from a
*shared* one (writable by others, sticky) only entries signed by a key this client
trusts (:mod:`~kcache_client._trust`) are used, and nothing unsigned is published
into it; an *untrusted* one (writable by others without the sticky bit, another
user's, a linked directory) is only read, for signed entries. One warning says so
at open, one per entry refused. Every file is read with ``O_NOFOLLOW``, only if it
is a regular file, and no further than expected (an alias by
:data:`~kcache.index.file.MAX_ENTRY_BYTES`, a blob by its size), and walks never
follow links (:mod:`kcache.fsutil`), so a FIFO, a device or a link planted in the
tier costs a refused entry, never a hang, an unbounded read or a deletion outside it.
An entry's signature is checked once per alias file this process reads (the file's
identity, as above), so a repeated hit pays nothing for it.

A prefetch keeps its bundle whole, as one pack under ``packs/``
(:mod:`kcache_client._packs`): a lookup finds a key there first, then by its alias; a
pack's entries are checked as an alias's are (their digest on every read, their signature
once per pack file this process indexed, where the standing asks for signed entries: a
pack replaced under the same name is another file, judged again); a pack is one unit of
the LRU (its mtime), and removing some of its entries writes a new pack without them.

A caller that wants a file rather than bytes (``Artifact.path``: the CuPy adapter loads
``RawModule(path=...)``) gets one holding the bytes that were checked
(:meth:`NodeTier.checked_file`): the blob of a private tier when it is the file this
process verified (else rewritten from the checked bytes), and otherwise a file written
from the checked bytes into this user's own private tier, never a file of a shared tier,
which its owner could rewrite between the check and the load.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from kcache.artifact import ArtifactMeta
from kcache.dirs import cache_dir, cache_layout, mark_cache_dir
from kcache.errors import (
    ArtifactNotFoundError,
    CorruptArtifactError,
    KCacheError,
    LockTimeoutError,
)
from kcache.eviction import LruCandidate, WaterMarks, default_tier_cap, least_recently_used
from kcache.fsutil import (
    FileIdentity,
    UnsafeFileError,
    atomic_write,
    identity,
    read_file_identified,
)
from kcache.index.file import MAX_ENTRY_BYTES, FileIndex
from kcache.keys import require_hex_key, sha256_hex
from kcache.locks import FileKeyLock, SingleFlight, try_file_lock
from kcache.lru import LruCache
from kcache.signing import Signature, SignatureError
from kcache.standing import Standing, directory_standing
from kcache.store.local import LocalArtifactStore
from kcache_client._disk_full import refuse_full, tolerate_full
from kcache_client._packs import PACKS_DIR, PackEntry, PackFile, TierPacks
from kcache_client._trust import ACCEPTED, Trust, Verdict
from kcache_client._withdrawals import Withdrawals

__all__ = ["NodeTier", "TierEntry", "TierRemoval", "TierUsage", "default_cache_dir"]

T = TypeVar("T")

_log = logging.getLogger("kcache_client")
#: The tier's own directories, whose standing is checked (kcache.standing).
_DIRS = (
    "blobs",
    "index",
    "index/recipes",
    "index/artifacts",
    "index/manifests",
    "index/complete",
    "locks",
    "packs",
)
#: The lock files under ``locks/`` made up front (the eviction lock; kcache.locks.FileKeyLock
#: makes a key's own while it is held, writable by all in a shared tier).
_LOCK_FILES = ("evict.lock",)
#: Where a server's facts are kept (its default toolchain, include sets' digests).
_SERVERS_DIR = "servers"
#: Entries refused here are warned about once each, up to this many per process.
_WARNED_MAX = 10_000

# A lookup refreshes an entry's access stamp at most this often per process (one utime).
_TOUCH_EVERY_S = 5.0
# Parsed aliases kept per process (each a few KB of metadata).
_PARSED_ENTRIES = 4096
# A file is known by its identity once its ctime is this old (coarse clocks: FAT's 2 s).
_SETTLED_NS = 2_000_000_000
# A pack half written this long ago was left by a writer that died (a prefetch takes seconds).
_PARTIAL_PACK_S = 3600.0
# Publishes whose record and manifest entry wait for a moment the process is idle, at most.
_PENDING_MAX = 32
# A process rescans the tier's size after a publish at least this often (or 20 scans' time).
_RESCAN_MIN_S = 1.0


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


def default_cache_dir() -> Path:
    """``$KCACHE_CACHE_DIR``, else ``$XDG_CACHE_HOME/kcache/client`` (``~/.cache/kcache/client``)."""
    return cache_dir()


class NodeTier:
    """Artifacts by recipe key in ``root``, shared by all processes that open ``root``."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        lock_timeout: float = 900.0,
        max_bytes: int | None = None,
        trust: Trust | None = None,
        read_only: bool = False,
    ) -> None:
        self.root = Path(root)
        #: A read-only layer (under a writable tier): only read, for signed entries; never
        #: written, touched or evicted, whoever owns it.
        self.read_only = read_only
        if read_only:
            if not self.root.is_dir():
                raise KCacheError(f"the read-only cache layer {self.root} is not a directory")
        else:
            mark_cache_dir(self.root)
        #: Whose signatures entries are checked against where only signed ones are used.
        self.trust = trust
        #: The withdrawn bindings no lookup answers (kcache_client._withdrawals): this
        #: tier's file, and what the process learnt (a cache gives its layers its tier's).
        self.withdrawals = Withdrawals(self)
        # No fsync on publish: the tier is a cache, not a source of truth. An fsync per
        # file and directory was most of a cold rank's fetch time (B8). Renames stay
        # atomic, so running readers never see part of a file; after a power loss a
        # file may be empty or garbage, which reads as absent (FileIndex) or fails the
        # blob's digest check (the store), and the kernel is fetched again.
        flat = cache_layout(self.root) == "flat"  # a new tier is flat, an old one keeps its fan-out
        self.store = LocalArtifactStore(self.root, durable=False, flat=flat)
        self.index = FileIndex(self.root, durable=False, flat=flat)
        self.lock = SingleFlight(FileKeyLock(self.root))
        #: Bundles kept whole (kcache_client._packs): what a prefetch writes. Each entry's
        #: verdict is kept with the pack file it judged (PackEntry.verdict).
        self.packs = TierPacks(self.root)
        self.lock_timeout = lock_timeout
        self._max_bytes = max_bytes
        self._evict_lock_path = self.root / "locks" / "evict.lock"
        # digest -> when this process last stamped it; bounded, the oldest forgotten first.
        self._touched: LruCache[str, float] = LruCache(max_entries=100_000)
        # digest -> the identity of the blob file whose bytes this process verified.
        self._verified: LruCache[str, FileIdentity] = LruCache(max_entries=100_000)
        # recipe key -> an alias file's identity and what it said (metadata is a few KB).
        self._parsed: LruCache[str, tuple[FileIdentity, ArtifactMeta, Signature | None]] = LruCache(
            max_entries=_PARSED_ENTRIES
        )
        self._size_lock = threading.Lock()
        # (base key, metadata, size) of publishes whose record is not written yet (flush).
        self._pending: list[tuple[str | None, ArtifactMeta, int]] = []
        self._pending_lock = threading.Lock()
        self._scanned_bytes: int | None = None  # the tier's size at this process's last scan
        self._since_scan = 0  # bytes this process published since
        self._scanned_at = float("-inf")
        self._rescan_s = _RESCAN_MIN_S
        self._warned: LruCache[str, bool] = LruCache(max_entries=_WARNED_MAX)
        if not read_only:
            self._share_dirs()
        #: Who else could have written the tier (module docstring), as found at open.
        self.standing = self.check_standing()
        # A private tier's packs carry their index beside them (only this user writes them).
        self.packs.sidecars = self.standing.kind == "private" and not read_only
        if self.standing.kind != "private" and not read_only:
            _log.warning(
                "kcache: the node tier %s is %s (%s): only entries signed by a trusted key are "
                "used%s",
                self.root,
                self.standing.kind,
                self.standing.reason,
                "" if self.standing.writable else ", and nothing is written into it or removed",
            )

    @functools.cached_property
    def marks(self) -> WaterMarks:
        """The cap and its water marks (``max_bytes`` None: the default, from the filesystem's
        size, read when first needed: a process that only reads never asks; 0: unbounded)."""
        cap = self._max_bytes
        return WaterMarks(default_tier_cap(self.root) if cap is None else cap)

    def check_standing(self) -> Standing:
        """The tier's standing now (:func:`kcache.standing.directory_standing`); a read-only
        layer's is untrusted whatever its directories say (signed entries only, no writes)."""
        found = directory_standing(self.root, _DIRS)
        if self.read_only and found.kind != "untrusted":
            return Standing("untrusted", f"{self.root} is a read-only layer")
        return found

    def _share_dirs(self) -> None:
        """Make the tier's directories now, with the tier's standing: in a shared tier (root
        sticky, writable by others) each gets the root's mode (``1777``, ``1775``), so the
        other users can publish into it too and find it shared, not another user's private
        directory (untrusted). A directory made later, on first use (``packs/`` by the first
        prefetch, ``index/complete/``, ``servers/``), made with the umask's ``0755``, turned
        the tier untrusted for every other user until its creator opened it again. This
        user's directories made before are given the mode too."""
        try:
            st = os.lstat(self.root)
        except OSError:
            return
        mode = st.st_mode & 0o7777
        if not (mode & 0o1000 and mode & 0o022):
            return  # not shared: a private tier makes its directories when it first needs them
        uid = os.geteuid()
        for sub in (*_DIRS, _SERVERS_DIR):
            path = self.root / sub
            with contextlib.suppress(OSError):
                with contextlib.suppress(FileExistsError):
                    os.mkdir(path)  # the umask's mode, then the root's below
                made = os.lstat(path)
                if made.st_uid == uid and made.st_mode & 0o7777 != mode:
                    os.chmod(path, mode, follow_symlinks=False)
        # The lock files every user's processes open for writing (the per-key download lock,
        # the eviction lock): made writable by all here, or the first user's 0644 files would
        # stop every other user's lookups (a sticky directory keeps them).
        for name in _LOCK_FILES:
            with contextlib.suppress(OSError):
                fd = os.open(
                    self.root / "locks" / name,
                    os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                    0o666,
                )
                try:
                    os.fchmod(fd, 0o666)
                finally:
                    os.close(fd)

    def lookup(self, recipe_key: str) -> tuple[ArtifactMeta, bytes] | None:
        """The artifact and its verified bytes, or None (:meth:`lookup_signed` without the signature)."""
        found = self.lookup_signed(recipe_key)
        return None if found is None else (found[0], found[1])

    def lookup_signed(self, recipe_key: str) -> tuple[ArtifactMeta, bytes, Signature | None] | None:
        """The artifact, its verified bytes and the signature stored with it, or None.

        A blob whose bytes no longer match its digest is quarantined by the store
        and its alias dropped, so the caller refetches instead of using it. A
        negative entry (a failed local compile) is not an answer here: the server
        may know better. Nor is an entry this tier's standing does not let it use
        (module docstring): it reads as absent, with a warning.
        """
        if recipe_key in self.packs:
            packed = self._from_pack(recipe_key)
            if packed is not None:
                return packed
        found = self._entry(recipe_key)
        if found is None:
            return self._from_pack(recipe_key) if self.packs.refresh() else None
        entry, signature = found
        try:
            data = self._blob(entry.digest, entry.size)
        except CorruptArtifactError:
            self._forget(recipe_key)
            return None
        except ArtifactNotFoundError:
            # Metadata without a blob: evicted by another process a moment ago, gc, a manual delete.
            self._forget(recipe_key)
            return None
        self._touch(entry.digest)
        return entry, data, signature

    def _pack_entry(self, recipe_key: str) -> PackEntry | None:
        """The pack entry of ``recipe_key`` this tier may use (its signature checked where the
        standing asks, once per entry of the pack file it is in), or None; its bytes are not
        read."""
        found = self.packs.entry(recipe_key)
        if found is None:
            return None
        whole = self._whole_pack_verdict if self.standing.signed_only else None
        first = found.verdict(self.verdict, whole)
        first_pack = found.pack
        if first.ok:
            if self._withdrawn(recipe_key, found.meta.digest, f"pack {found.name}"):
                return None
            return found
        for found in self.packs.entries(recipe_key):  # another pack's, the first's refused
            verdict = first if found.pack is first_pack else found.verdict(self.verdict, whole)
            if verdict.problem is not None:
                self._refuse(
                    f"the entry of recipe {recipe_key} in pack {found.name}", verdict.problem
                )
                continue
            if self._withdrawn(recipe_key, found.meta.digest, f"pack {found.name}"):
                return None
            return found
        return None

    def _from_pack(self, recipe_key: str) -> tuple[ArtifactMeta, bytes, Signature] | None:
        found = self._pack_entry(recipe_key)
        if found is None:
            return None
        data = self.packs.read(found)  # the judged entry's own bytes, checked by its digest
        if data is None:
            return None
        self._touch_pack(found.name)
        return found.meta, data, found.signature

    def _touch_pack(self, name: str) -> None:
        if self.read_only:
            return
        now = time.monotonic()
        stamp = f"{PACKS_DIR}/{name}"
        last = self._touched.get(stamp)
        if last is None or now - last >= _TOUCH_EVERY_S:
            self._touched.put(stamp, now)
            self.packs.touch(name)

    def checked_file(self, digest: str, data: bytes) -> str | None:
        """A file of this tier holding exactly ``data`` (checked bytes of ``digest``), for a
        caller that wants a path (``Artifact.path``); None where this tier cannot give one
        that stays what was checked (it is not private to this user, or a read-only layer).

        The blob at :meth:`location` is used when it is the file this process verified (its
        identity unchanged), or when it reads back as ``digest``; else (absent, damaged,
        not a regular file) it is written from ``data``.
        """
        if self.read_only or self.standing.kind != "private":
            return None
        if sha256_hex(data) != digest:  # a caller's mistake; never write such a file
            raise CorruptArtifactError(digest, sha256_hex(data), None)
        location = self.location(digest)
        try:
            if self._verified.get(digest) == identity(os.lstat(location)):
                return location
            if self._blob(digest, len(data)) == data:
                return location
        except (OSError, KCacheError):
            pass  # absent, quarantined, not a regular file: written afresh below
        with refuse_full(self.root, f"writing the kernel {digest} for its path"):
            atomic_write(location, data, durable=False)
        return location

    def close(self) -> None:
        """Let go of the descriptors of the packs this process read (and their verdicts)."""
        self.packs.close()

    def _forget(self, recipe_key: str) -> None:
        if self.standing.writable:
            with contextlib.suppress(PermissionError):  # another user's alias in a shared tier
                self.index.forget(recipe_key)

    def _refuse(self, what: str, problem: str) -> None:
        """Warn once per entry that it is not used."""
        if self._warned.get(what) is None:
            self._warned.put(what, True)
            _log.warning(
                "kcache: not using %s from the %s node tier %s: %s",
                what,
                self.standing.kind,
                self.root,
                problem,
            )

    def _entry(self, recipe_key: str) -> tuple[ArtifactMeta, Signature | None] | None:
        """The alias's artifact and signature, parsed and checked once per alias file this
        process read (module docstring).

        An alias parsed before is only ``stat``-ed: its file unchanged, what it said then
        stands, and its bytes need not be read again.
        """
        path = self.index.alias_path(recipe_key)
        known = self._parsed.get(recipe_key)
        try:
            if known is not None and identity(os.lstat(path)) == known[0]:
                return None if self._withdrawn(recipe_key, known[1].digest) else known[1:]
            raw, alias = read_file_identified(path, MAX_ENTRY_BYTES)
        except FileNotFoundError:
            return None
        except UnsafeFileError as exc:
            self._refuse(f"the entry {path}", exc.reason)
            return None
        entry, stored = self.index.parse_signed_alias(recipe_key, raw)
        if not isinstance(entry, ArtifactMeta):
            return None
        signature = None
        if stored is not None:
            try:
                signature = Signature.from_dict(stored)
            except SignatureError as exc:
                self._refuse(f"the entry {path}", str(exc))
                return None
        problem = self.verdict(recipe_key, entry, signature).problem
        if problem is not None:
            self._refuse(f"the entry {path}", problem)
            return None
        if self._withdrawn(recipe_key, entry.digest):
            return None
        if _settled(alias, len(raw)):
            self._parsed.put(recipe_key, (alias, entry, signature))
        return entry, signature

    def _withdrawn(self, recipe_key: str, digest: str, where: str = "its alias") -> bool:
        """Whether ``recipe_key`` -> ``digest`` is withdrawn (warned about once): not answered."""
        if not self.withdrawals.withdrawn(recipe_key, digest):
            return False
        self._refuse(
            f"the entry of recipe {recipe_key} ({where})",
            f"the server withdrew its binding to {digest} (kcache_client._withdrawals)",
        )
        return True

    def _whole_pack_verdict(
        self, bindings: list[tuple[str, ArtifactMeta]], signature: Signature
    ) -> Verdict:
        """Whether a pack's trailer signature (the bundle's, over every entry's binding in
        order) is by a key trusted here: one verification for all of its entries."""
        if self.trust is None:
            return Verdict("no trusted keys to check its signature by")
        return self.trust.bundle_verdict(bindings, signature)

    def verdict(self, recipe_key: str, entry: ArtifactMeta, signature: Signature | None) -> Verdict:
        """Whether this tier may use an entry (module docstring), judged once per file.

        Where only signed entries are used (a shared or untrusted tier, a layer), it must
        verify by a key trusted for this client's server (:meth:`Trust.entry_verdict`). A
        private tier's entries are this user's own: used as they are, with no signature
        checked and nothing imported for one (an unsigned entry is a local compile; a signed
        one was checked when this user's process stored it). Where keys are given
        (``KCACHE_TRUSTED_KEYS``, the fleet's), a signed entry's key must still be one of
        them, by its id (a set lookup): a key the fleet stopped trusting vouches for nothing.
        """
        trust = self.trust
        if self.standing.signed_only:
            if trust is None:
                return Verdict("no trusted keys to check its signature by")
            return trust.entry_verdict(recipe_key, entry, signature)
        if (
            signature is not None
            and trust is not None
            and trust.given
            and signature.key_id not in trust.given
        ):
            return Verdict(trust.foreign_key(signature.key_id))
        return ACCEPTED

    def _blob(self, digest: str, size: int) -> bytes:
        """The verified bytes of ``digest`` (``size`` of them), hashed once per blob file read.

        Bytes that do not match go to the store's own read, which quarantines the file
        (CorruptArtifactError) unless it was replaced meanwhile. A file larger than
        ``size``, or not a regular file, is not read at all.
        """
        location = self.location(digest)
        try:
            data, blob = read_file_identified(location, size)
        except FileNotFoundError:
            raise ArtifactNotFoundError(f"no blob {digest} in {self.store.blobs}") from None
        except UnsafeFileError as exc:
            self._refuse(f"the blob {location}", exc.reason)
            raise CorruptArtifactError(digest, exc.reason, None) from None
        if self._verified.get(digest) == blob and len(data) == blob[2]:
            return data
        if sha256_hex(data) != digest:
            return self.store.get(digest)
        if _settled(blob, len(data)):
            self._verified.put(digest, blob)
        return data

    def publish(
        self,
        recipe_key: str,
        base_key: str | None,
        meta: ArtifactMeta,
        data: bytes,
        signature: Signature | None = None,
    ) -> Path | None:
        """Store verified bytes and the recipe's alias (the blob first, as everywhere); the rest later.

        The alias is what a hit reads, and this thread's lock of the key is let go as
        soon as it is written: processes waiting for the key take the entry from there.
        The artifact record, the manifest entry and the size accounting (which may
        evict) wait in this process (:meth:`flush`) until it is idle anyway, waiting for
        another process's fetch (:meth:`hold_unless`), or until 32 publishes are pending,
        or until anything reads them here (listing, evicting, closing the cache). A
        rank fetching kernels one after another thus goes on to its next kernel at once
        (B8: eight ranks fetching the same kernels in turn). A record lost when a
        process ends without closing costs what a crash's would (module docstring).
        A thread of its own for that work cost a lone rank half as much time again (the
        GIL).

        ``signature`` (the server's, checked by the caller) is stored with the alias.
        Nothing is published (None) into a tier that is not writable here, nor an
        unsigned entry into one where only signed entries are used, nor where another
        user's file stands in the way in a shared tier.

        ``base_key`` None (an entry of a bundle, whose base key no signature covers): the
        entry is found by its recipe key only, and not offered to a local engine's
        manifest match under a base key it could not check.
        """
        if (
            not self.standing.writable
            or (signature is None and self.standing.signed_only)
            or self.withdrawals.withdrawn(recipe_key, meta.digest)
        ):
            self.lock.let_go(recipe_key)
            return None
        try:
            digest = self.store.put(data)
            if digest != meta.digest:  # the caller verified; this is a second line of defence
                raise CorruptArtifactError(meta.digest, digest, None)
            self.index.write_alias(
                recipe_key, meta, signature.to_dict() if signature is not None else None
            )
        except PermissionError as exc:
            if not self.standing.signed_only:
                raise
            # Another user's file (a stale or planted one) at this name in a shared tier.
            self.lock.let_go(recipe_key)
            self._refuse(f"the entry of recipe {recipe_key}", f"cannot be published: {exc}")
            return None
        except OSError:  # a full disk: the kernel is used from memory (kcache_client._disk_full)
            self.lock.let_go(recipe_key)
            with tolerate_full(self.root, "keeping a kernel"):
                raise
            return None
        self.lock.let_go(recipe_key)
        with self._pending_lock:
            self._pending.append((base_key, meta, len(data)))
            due = len(self._pending) >= _PENDING_MAX
        if due:
            self.flush()
        return self.store.path(digest)

    def flush(self) -> None:
        """Write the records and manifest entries of this process's pending publishes; may evict."""
        with self._pending_lock:
            pending, self._pending = self._pending, []
        for base_key, meta, size in pending:
            with tolerate_full(self.root, "recording a kernel"):
                self._record(base_key, meta, size)

    def _record(self, base_key: str | None, meta: ArtifactMeta, size: int) -> None:
        """A published entry's record and manifest entry; may evict.

        The blob may be gone by now (evicted by another process, which saw no record
        yet, removed by ``kcache cache clear``, quarantined as damaged): then nothing is
        recorded, and a record written as the blob went is taken back, so that no
        record names a missing blob. (Its alias, if still there, reads as absent.)
        """
        blob = self.location(meta.digest)
        if not os.path.isfile(blob):
            return
        if base_key is not None:
            self.index.record_metadata(base_key, meta)
        elif self.index.artifact(meta.digest) is None:  # the record alone (publish)
            self.index._write("artifacts", meta.digest, meta.to_dict())  # the index's own layout
        if not os.path.isfile(blob):
            with contextlib.suppress(OSError):
                os.unlink(self._record_path(meta.digest))
            return
        self.stored(size)

    # ---------------------------------------------------------------- bounded size
    def _record_path(self, digest: str) -> str:
        return self.index._path_str("artifacts", digest)  # the index's own layout

    def _touch(self, digest: str) -> None:
        """Mark ``digest`` used now: the access stamp LRU reads (cheap, and not on every hit)."""
        if self.read_only:
            return  # a layer's recency is not this tier's to keep (and never evicted)
        now = time.monotonic()
        last = self._touched.get(digest)
        if last is not None and now - last < _TOUCH_EVERY_S:
            return
        self._touched.put(digest, now)
        with contextlib.suppress(OSError):  # evicted meanwhile, or a read-only tier
            os.utime(self._record_path(digest), follow_symlinks=False)

    def stored(self, nbytes: int) -> None:
        """Note ``nbytes`` just stored in the tier (by :meth:`publish`, or a local compile); may evict.

        The tier's size is rescanned when this process's own publishes since its last
        scan could have taken it past the high-water mark, and at least every second
        or so (other processes publish too), never more often than 20 scans' time.
        """
        if not self.marks.bounded:
            return
        with self._size_lock:
            self._since_scan += nbytes
            estimate = (self._scanned_bytes or 0) + self._since_scan
            due = time.monotonic() - self._scanned_at >= self._rescan_s
            if self._scanned_bytes is not None and not due and not self.marks.over(estimate):
                return
        self._evict()

    def _scan(self) -> list[_Scanned]:
        started = time.monotonic()
        found = []
        for digest in self.store.digests():
            try:
                blob = os.stat(self.store.path(digest))
            except FileNotFoundError:
                continue
            try:
                used = os.stat(self._record_path(digest)).st_mtime
            except FileNotFoundError:
                used = blob.st_mtime  # no record (yet): as old as the blob
            found.append(_Scanned(digest, blob.st_size, used, blob.st_mtime))
        for pack in self.packs.files():
            found.append(
                _Scanned(f"{PACKS_DIR}/{pack.name}", pack.size, pack.mtime, pack.mtime, pack)
            )
        took = time.monotonic() - started
        with self._size_lock:
            self._scanned_bytes = sum(b.size for b in found)
            self._since_scan = 0
            self._scanned_at = time.monotonic()
            self._rescan_s = max(_RESCAN_MIN_S, 20 * took)
        return found

    @contextlib.contextmanager
    def _evicting(self, wait_s: float) -> Iterator[bool]:
        """The tier's one-evictor-at-a-time file lock; yields False when not had within ``wait_s``."""
        with try_file_lock(self._evict_lock_path, wait_s) as held:
            yield held

    def evict(self) -> TierRemoval | None:
        """Evict least recently used entries down to the low-water mark if over the high one.

        None when another process is evicting already (it does the work).
        """
        self.flush()  # this process's own publishes count
        return self._evict()

    def _evict(self) -> TierRemoval | None:
        if not self.standing.writable:
            return None  # nothing is removed from a tier others could have rearranged
        with self._evicting(0) as held:
            if not held:
                return None
            self.packs.sweep_partials(time.time() - _PARTIAL_PACK_S)
            scanned = self._scan()
            to_free = self.marks.to_free(sum(b.size for b in scanned))
            if to_free <= 0:
                return TierRemoval(0, 0)
            candidates = [LruCandidate(b.digest, b.size, b.last_used) for b in scanned]
            chosen = {c.name for c in least_recently_used(candidates, to_free)}
            return self._remove([b for b in scanned if b.digest in chosen])

    def _aliases(self) -> dict[str, list[Path]]:
        """digest -> the recipe alias files that name it (read only when removing)."""
        found: dict[str, list[Path]] = {}
        for path in self.index.files("recipes"):
            digest = _alias_digest(path)
            if digest is not None:
                found.setdefault(digest, []).append(path)
        return found

    def _remove(self, victims: Iterable[_Scanned]) -> TierRemoval:
        """Records and aliases first, blobs last (kept when republished since the scan).

        The tier's standing is checked again first: a directory swapped for a link since
        the tier was opened stops every deletion (nothing outside the tier is removed).
        """
        standing = self.check_standing()
        if not standing.writable:
            raise KCacheError(
                f"nothing removed from the node tier {self.root}: {standing.reason} "
                "(an untrusted tier is never written or cleaned)"
            )
        aliases = self._aliases()
        removed = freed = 0
        for victim in victims:
            if victim.pack is not None:  # a pack goes whole; its readers keep their descriptor
                gone_bytes = self.packs.remove(victim.pack.name)
                if gone_bytes:
                    removed += len(victim.pack.entries)
                    freed += gone_bytes
                continue
            Path(self._record_path(victim.digest)).unlink(missing_ok=True)
            for alias in aliases.get(victim.digest, ()):
                if _alias_digest(alias) == victim.digest:  # not re-pointed meanwhile
                    alias.unlink(missing_ok=True)
            gone = self.store.collect(
                victim.digest,
                # Kept if its mtime moved since the scan (stored again) or a record names it again.
                victim.blob_mtime + 1e-6,
                self._recorded,
            )
            if gone is not None:
                removed += 1
                freed += gone
        with self._size_lock:
            if self._scanned_bytes is not None:
                self._scanned_bytes -= freed
        return TierRemoval(removed, freed)

    def _recorded(self, digest: str) -> bool:
        return os.path.exists(self._record_path(digest))

    def entries(self) -> list[TierEntry]:
        """Every stored artifact, most recently used first, with its recipe keys and metadata."""
        self.flush()
        aliases = self._aliases()
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
            meta = self.index.artifact(blob.digest)
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
        self.flush()
        scanned = self._scan()
        stamps = [b.last_used for b in scanned]
        return TierUsage(
            self.root,
            sum(b.size for b in scanned),
            sum(b.entries for b in scanned),
            self.marks,
            min(stamps, default=None),
            max(stamps, default=None),
        )

    def remove(self, keys: Iterable[str], *, wait_s: float = 60.0) -> TierRemoval:
        """Remove the entries ``keys`` name (recipe keys or digests) now."""
        self.flush()
        wanted: dict[str, str] = {}
        unknown = []
        packs = self.packs.files()
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
            entry = self.index.lookup(key)
            if isinstance(entry, ArtifactMeta):
                wanted[entry.digest] = key
            elif self.store.has(key):
                wanted[key] = key
            elif not in_packs:
                unknown.append(key)
        with self._evicting(wait_s) as held:
            if not held:
                raise LockTimeoutError(
                    f"another process held {self._evict_lock_path} for {wait_s:.0f}s"
                )
            removal = self._remove([b for b in self._scan() if b.digest in wanted])
            removed, freed = removal.removed, removal.bytes_freed
            if packed and not self.check_standing().writable:
                raise KCacheError(f"nothing removed from the node tier {self.root}: not writable")
            for name, drop in packed.items():
                count, nbytes = self.packs.without(name, drop)
                removed += count
                freed += nbytes
        return TierRemoval(removed, freed, tuple(unknown))

    def clear(self, *, wait_s: float = 60.0) -> TierRemoval:
        """Remove every entry."""
        self.flush()
        with self._evicting(wait_s) as held:
            if not held:
                raise LockTimeoutError(
                    f"another process held {self._evict_lock_path} for {wait_s:.0f}s"
                )
            return self._remove(self._scan())

    def path(self, digest: str) -> Path:
        """Where the blob lives."""
        return self.store.path(digest)

    def location(self, digest: str) -> str:
        """:meth:`path` as a string (pathlib costs microseconds a node-tier hit notices)."""
        return self.store._path_str(digest)  # the store's own layout

    @contextlib.contextmanager
    def hold(self, recipe_key: str) -> Iterator[bool]:
        """The per-key download lock; yields True when another process or thread had it first."""
        with self.lock.hold(recipe_key, self.lock_timeout) as waited:
            yield waited

    @contextlib.contextmanager
    def hold_unless(self, recipe_key: str, published: Callable[[], T | None]) -> Iterator[T | None]:
        """The per-key download lock, unless another process publishes the key meanwhile.

        Yields None with the lock held, or what ``published()`` (a look in this tier)
        found while waiting, without ever taking the lock: reading the tier needs no
        lock (entries appear by atomic rename, blobs are verified), and ranks that
        each took the lock in turn only to read the entry made a convoy (B8).
        """

        def looked() -> T | None:
            # Asked first when this process is about to wait for another's fetch: the
            # moment for its own pending bookkeeping, which nothing waits for.
            if self._pending:
                self.flush()
            return published()

        with self.lock.hold_unless(recipe_key, self.lock_timeout, looked) as found:
            yield found

    # ---------------------------------------------------------------- server facts
    def _facts_path(self, url: str) -> Path:
        return self.root / _SERVERS_DIR / f"{sha256_hex(url)[:32]}.json"

    def save_server_facts(self, url: str, facts: dict[str, Any]) -> None:
        """Remember what a server said (its default toolchain), so keys can be computed offline."""
        if not self.standing.writable:
            return
        with contextlib.suppress(PermissionError), tolerate_full(self.root, "saving server facts"):
            atomic_write(  # another user's file in a shared tier: suppressed
                self._facts_path(url),
                json.dumps({"url": url, "saved_at": time.time(), **facts}).encode(),
                durable=False,  # a cache too: load_server_facts reads garbage as absent
            )

    def load_server_facts(self, url: str) -> dict[str, Any] | None:
        """The last facts saved for ``url``, or None."""
        try:
            data = json.loads(self._facts_path(url).read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    # ---------------------------------------------------------------- manifests held
    def held_digest(self, recipe_key: str) -> str | None:
        """The digest of the entry this tier may use for ``recipe_key`` when its blob is here.

        The alias is parsed and its signature checked (once per alias file, as for a
        lookup); the blob is only ``stat``-ed: a lookup verifies its bytes when it reads them.
        """
        packed = self._pack_entry(recipe_key)
        if packed is not None:
            return packed.meta.digest
        found = self._entry(recipe_key)
        if found is None or not os.path.isfile(self.location(found[0].digest)):
            return None
        return found[0].digest

    def present(self, recipe_key: str, digest: str) -> bool:
        """Whether this process may use the entry ``recipe_key`` -> ``digest`` here: a pack
        entry this tier accepts (its verdict kept with its pack file), or an alias it
        accepts (parsed and judged once per alias file) whose blob exists (a ``stat``: a
        lookup verifies the bytes when it reads them). What a prefetch asks of a completeness
        marker's entries: an entry this process cannot use (a key not trusted here) is not
        held, whatever another user's marker says. A withdrawn binding is not held."""
        packed = self._pack_entry(recipe_key)
        if packed is not None and packed.meta.digest == digest:
            return True
        found = self._entry(recipe_key)
        return (
            found is not None
            and found[0].digest == digest
            and os.path.isfile(self.location(digest))
        )

    def _complete_path(self, manifest_digest: str) -> Path:
        name = require_hex_key(manifest_digest, "manifest digest")
        return self.root / "index" / "complete" / f"{name}.json"

    def mark_complete(self, manifest_digest: str, entries: Iterable[tuple[str, str]]) -> None:
        """Note that the tiers held every recipe key of manifest ``manifest_digest``, as the
        (recipe key, digest) ``entries``, each verified (digest and signature)."""
        if not self.standing.writable or self.read_only:
            return
        body = {"manifest": manifest_digest, "at": time.time(), "kernels": sorted(entries)}
        with contextlib.suppress(PermissionError), tolerate_full(self.root, "marking a prefetch"):
            atomic_write(  # another user's marker in a shared tier: suppressed
                self._complete_path(manifest_digest), json.dumps(body).encode(), durable=False
            )

    def marked(self, manifest_digest: str) -> list[tuple[str, str]] | None:
        """The entries :meth:`mark_complete` noted for the manifest, or None (no readable marker)."""
        try:
            raw, _ = read_file_identified(
                str(self._complete_path(manifest_digest)), MAX_ENTRY_BYTES * 16
            )
            body = json.loads(raw)
        except (OSError, UnsafeFileError, ValueError):
            return None
        kernels = body.get("kernels") if isinstance(body, dict) else None
        if not isinstance(kernels, list):
            return None
        out = []
        for item in kernels:
            if not (
                isinstance(item, list) and len(item) == 2 and all(isinstance(v, str) for v in item)
            ):
                return None
            out.append((item[0], item[1]))
        return out


def _settled(file: FileIdentity, nbytes: int) -> bool:
    """Whether a file read as ``nbytes`` may be known by its identity ``file`` from now on.

    The bytes must be the whole file of that identity (not one that grew or shrank
    while it was read), and its ctime at least :data:`_SETTLED_NS` old, so that a later
    write cannot share its timestamp (module docstring).
    """
    return nbytes == file[2] and time.time_ns() - file[4] >= _SETTLED_NS


def _alias_digest(path: Path) -> str | None:
    """The digest a recipe alias file points at (None for a negative entry or an unreadable file)."""
    try:
        with open(path, "rb") as handle:
            entry = json.loads(handle.read())
    except (OSError, ValueError):
        return None
    digest = entry.get("digest") if isinstance(entry, dict) else None
    return digest if isinstance(digest, str) else None
