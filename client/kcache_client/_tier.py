"""The node-local tier: the core's store, index and locks in one directory per node.

Every process of a node (every rank, every job) opens the same directory. Blobs
are published by the core's atomic write under their digest, index entries by
atomic rename, so readers never see half a file and two processes that download
the same blob agree. A per-key lock makes the node download a blob once, not once per
rank, and nothing is fsynced (:mod:`kcache_client._tier_publish`). What a reader trusts is
checked on every read that could see a new file: a blob must hash to its digest (the name
it was asked for by), an alias must parse, name its own recipe key and carry metadata of
the digest it names. A write that a crash or power loss cut short fails those checks and
reads as absent.

A process checks each file once, not at every read (:mod:`kcache_client._tier_reads`): a
blob's bytes are hashed, and an alias parsed and judged, once per file it read (known by
its identity), and every process and every new file is checked at least once.

The tier is bounded: the least recently used entries are evicted when a publish takes it
past its cap (:mod:`kcache_client._tier_size`, which also lists and removes entries), and
eviction never hands a reader wrong or partial bytes. Who else could have written the tier
decides what of it is used (:mod:`kcache_client._tier_standing`): all of a private tier
(this user's), only entries signed by a key this client trusts from any other, and nothing
is written into one it cannot trust. An entry's signature is checked once per alias file
this process reads (the file's identity, as above), so a repeated hit pays nothing for it.
The notes kept beside the kernels (a server's facts, a prefetch's completeness markers) are
:mod:`kcache_client._tier_notes`'s.

A prefetch keeps its bundle whole, as one pack under ``packs/``
(:mod:`kcache_client._packs`): a lookup finds a key there first, then by its alias; a
pack's entries are checked as an alias's are (their digest on every read, their signature
once per pack file this process indexed, where the standing asks for signed entries: a
pack replaced under the same name is another file, judged again).

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
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from kcache.artifact import ArtifactMeta
from kcache.dirs import cache_dir, cache_layout, damaged_cache_dir_message, mark_cache_dir
from kcache.errors import ArtifactNotFoundError, CorruptArtifactError, KCacheError
from kcache.eviction import WaterMarks, default_tier_cap
from kcache.fsutil import (
    FileIdentity,
    atomic_write,
    identity,
)
from kcache.index.file import FileIndex
from kcache.keys import sha256_hex
from kcache.locks import FileKeyLock, SingleFlight
from kcache.lru import LruCache
from kcache.signing import Signature
from kcache.standing import Standing
from kcache.store.local import LocalArtifactStore
from kcache_client import _tier_notes
from kcache_client._disk_full import refuse_full
from kcache_client._packs import PACKS_DIR, TierPacks
from kcache_client._tier_reads import alias_entry, blob_bytes, pack_entry
from kcache_client._tier_standing import share_dirs, tier_standing
from kcache_client._trust import ACCEPTED, Trust, Verdict
from kcache_client._withdrawals import Withdrawals

if TYPE_CHECKING:  # made at first use: a process that only reads never imports them
    from kcache_client._tier_publish import TierPublisher
    from kcache_client._tier_size import TierEntry, TierRemoval, TierSize, TierUsage

__all__ = ["NodeTier", "default_cache_dir"]

T = TypeVar("T")

_log = logging.getLogger("kcache_client")
#: Entries refused here are warned about once each, up to this many per process.
_WARNED_MAX = 10_000

# A lookup refreshes an entry's access stamp at most this often per process (one utime).
_TOUCH_EVERY_S = 5.0
# Parsed aliases kept per process (each a few KB of metadata).
_PARSED_ENTRIES = 4096


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
        try:
            self.store = LocalArtifactStore(self.root, durable=False, flat=flat)
            self.index = FileIndex(self.root, durable=False, flat=flat)
            self.lock = SingleFlight(FileKeyLock(self.root))
        except (NotADirectoryError, FileExistsError) as exc:  # a file where index/ or locks/ goes
            raise KCacheError(damaged_cache_dir_message(self.root, str(exc.filename))) from None
        #: Bundles kept whole (kcache_client._packs): what a prefetch writes. Each entry's
        #: verdict is kept with the pack file it judged (PackEntry.verdict).
        self.packs = TierPacks(self.root)
        self.lock_timeout = lock_timeout
        self._max_bytes = max_bytes
        # digest -> when this process last stamped it; bounded, the oldest forgotten first.
        self._touched: LruCache[str, float] = LruCache(max_entries=100_000)
        #: digest -> the identity of the blob file whose bytes this process verified.
        self.verified_blobs: LruCache[str, FileIdentity] = LruCache(max_entries=100_000)
        #: recipe key -> an alias file's identity and what it said (metadata is a few KB).
        self.parsed_aliases: LruCache[str, tuple[FileIdentity, ArtifactMeta, Signature | None]] = (
            LruCache(max_entries=_PARSED_ENTRIES)
        )
        # Made at their first use (publisher, size): a process that only reads makes neither.
        self._publisher: TierPublisher | None = None
        self._size: TierSize | None = None
        self._made_lock = threading.Lock()
        self._warned: LruCache[str, bool] = LruCache(max_entries=_WARNED_MAX)
        if not read_only:
            share_dirs(self.root)
        #: Who else could have written the tier (module docstring), as found at open.
        self.standing: Standing = self.check_standing()
        # A private tier's packs carry their index beside them (only this user writes them).
        self.packs.sidecars = self.standing.kind == "private" and not read_only
        if self.standing.kind != "private" and not read_only:
            # A shared tier is a team's, as its owner meant it: said at INFO (every rank of
            # every job opens it). An untrusted one is a mistake to mend: a warning.
            _log.log(
                logging.WARNING if self.standing.kind == "untrusted" else logging.INFO,
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

    @property
    def publisher(self) -> TierPublisher:
        """The tier's per-key lock and publishes (:mod:`kcache_client._tier_publish`)."""
        if self._publisher is None:
            from kcache_client._tier_publish import TierPublisher

            with self._made_lock:
                if self._publisher is None:
                    self._publisher = TierPublisher(self)
        return self._publisher

    @property
    def size(self) -> TierSize:
        """The tier's bounded size (:mod:`kcache_client._tier_size`)."""
        if self._size is None:
            from kcache_client._tier_size import TierSize

            with self._made_lock:
                if self._size is None:
                    self._size = TierSize(self)
        return self._size

    def check_standing(self) -> Standing:
        """The tier's standing now (:func:`~kcache_client._tier_standing.tier_standing`)."""
        return tier_standing(self.root, self.read_only)

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
        found = alias_entry(self, recipe_key)
        if found is None:
            return self._from_pack(recipe_key) if self.packs.refresh() else None
        entry, signature = found
        try:
            data = blob_bytes(self, entry.digest, entry.size)
        except CorruptArtifactError:
            self._forget(recipe_key)
            return None
        except ArtifactNotFoundError:
            # Metadata without a blob: evicted by another process a moment ago, gc, a manual delete.
            self._forget(recipe_key)
            return None
        self._touch(entry.digest)
        return entry, data, signature

    def _from_pack(self, recipe_key: str) -> tuple[ArtifactMeta, bytes, Signature] | None:
        found = pack_entry(self, recipe_key)
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
            if self.verified_blobs.get(digest) == identity(os.lstat(location)):
                return location
            if blob_bytes(self, digest, len(data)) == data:
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

    def refuse(self, what: str, problem: str) -> None:
        """Warn once per entry that it is not used (or published)."""
        if self._warned.get(what) is None:
            self._warned.put(what, True)
            _log.warning(
                "kcache: not using %s from the %s node tier %s: %s",
                what,
                self.standing.kind,
                self.root,
                problem,
            )

    def pack_verdict(
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

    def publish(
        self,
        recipe_key: str,
        base_key: str | None,
        meta: ArtifactMeta,
        data: bytes,
        signature: Signature | None = None,
    ) -> Path | None:
        """Store verified bytes and the recipe's alias now, the rest later; where the blob is,
        or None when nothing was published (:meth:`TierPublisher.publish
        <kcache_client._tier_publish.TierPublisher.publish>`)."""
        return self.publisher.publish(recipe_key, base_key, meta, data, signature)

    def flush(self) -> None:
        """Write the records and manifest entries of this process's pending publishes; may evict."""
        if self._publisher is not None:
            self._publisher.flush()

    def record_path(self, digest: str) -> str:
        """Where the artifact record of ``digest`` is (its mtime: the entry's last use)."""
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
            os.utime(self.record_path(digest), follow_symlinks=False)

    def stored(self, nbytes: int) -> None:
        """Note ``nbytes`` just stored in the tier (by :meth:`publish`, or a local compile); may
        evict (:meth:`TierSize.stored <kcache_client._tier_size.TierSize.stored>`)."""
        self.size.stored(nbytes)

    def evict(self) -> TierRemoval | None:
        """Evict least recently used entries down to the low-water mark if over the high one.

        None when another process is evicting already (it does the work).
        """
        self.flush()  # this process's own publishes count
        return self.size.evict()

    def entries(self) -> list[TierEntry]:
        """Every stored artifact, most recently used first, with its recipe keys and metadata."""
        self.flush()
        return self.size.entries()

    def usage(self) -> TierUsage:
        """Bytes used of the cap, entries, oldest and newest use."""
        self.flush()
        return self.size.usage()

    def remove(self, keys: Iterable[str], *, wait_s: float = 60.0) -> TierRemoval:
        """Remove the entries ``keys`` name (recipe keys or digests) now."""
        self.flush()
        return self.size.remove(keys, wait_s=wait_s)

    def clear(self, *, wait_s: float = 60.0) -> TierRemoval:
        """Remove every entry."""
        self.flush()
        return self.size.clear(wait_s=wait_s)

    def path(self, digest: str) -> Path:
        """Where the blob lives."""
        return self.store.path(digest)

    def location(self, digest: str) -> str:
        """:meth:`path` as a string (pathlib costs microseconds a node-tier hit notices)."""
        return self.store._path_str(digest)  # the store's own layout

    def hold(self, recipe_key: str) -> contextlib.AbstractContextManager[bool]:
        """The per-key download lock; yields True when another process or thread had it first."""
        return self.publisher.hold(recipe_key)

    def hold_unless(
        self, recipe_key: str, published: Callable[[], T | None], *, follows: bool = False
    ) -> contextlib.AbstractContextManager[T | None]:
        """The per-key download lock, unless another process publishes the key meanwhile
        (:meth:`TierPublisher.hold_unless <kcache_client._tier_publish.TierPublisher.hold_unless>`)."""
        return self.publisher.hold_unless(recipe_key, published, follows=follows)

    # ---------------------------------------------------------------- notes (_tier_notes)
    def save_server_facts(self, url: str, facts: dict[str, Any]) -> None:
        """Remember what a server said (its default toolchain), so keys can be computed offline."""
        _tier_notes.save_server_facts(self.root, self.standing, url, facts)

    def load_server_facts(self, url: str) -> dict[str, Any] | None:
        """The last facts saved for ``url``, or None."""
        return _tier_notes.load_server_facts(self.root, url)

    def mark_complete(self, manifest_digest: str, entries: Iterable[tuple[str, str]]) -> None:
        """Note that the tiers held every recipe key of manifest ``manifest_digest``, as the
        (recipe key, digest) ``entries``, each verified (digest and signature)."""
        if not self.read_only:
            _tier_notes.mark_complete(self.root, self.standing, manifest_digest, entries)

    def marked(self, manifest_digest: str) -> list[tuple[str, str]] | None:
        """The entries :meth:`mark_complete` noted for the manifest, or None (no readable marker)."""
        return _tier_notes.marked(self.root, manifest_digest)

    # ---------------------------------------------------------------- manifests held
    def held_digest(self, recipe_key: str) -> str | None:
        """The digest of the entry this tier may use for ``recipe_key`` when its blob is here.

        The alias is parsed and its signature checked (once per alias file, as for a
        lookup); the blob is only ``stat``-ed: a lookup verifies its bytes when it reads them.
        """
        packed = pack_entry(self, recipe_key)
        if packed is not None:
            return packed.meta.digest
        found = alias_entry(self, recipe_key)
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
        packed = pack_entry(self, recipe_key)
        if packed is not None and packed.meta.digest == digest:
            return True
        found = alias_entry(self, recipe_key)
        return (
            found is not None
            and found[0].digest == digest
            and os.path.isfile(self.location(digest))
        )
