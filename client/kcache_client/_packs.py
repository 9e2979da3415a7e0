"""Packs: bundles a node tier keeps whole, one file each, not a file or four per kernel.

A prefetch (:mod:`kcache_client._bundle`) writes the bundle answer it checks into
``<tier>/packs/<id>.kcb`` as the entries arrive and renames it into place at the end
(:class:`~kcache_client._pack_file.PackWriter`): one file per node and manifest.
Publishing each kernel as a blob, an alias and a record was most of a cold node's prefetch,
and reading those files back most of every rank's time after it (B12).
Every process of the node finds the kernels there: it indexes a pack once (the entry
header lines; the bytes are skipped), and a lookup reads an entry's bytes with one
``pread`` and checks their digest before handing them out.

Safety, as for the tier's other files: a pack is opened ``O_NOFOLLOW | O_NONBLOCK``, a
regular file only; its bytes are read, never mapped (a file truncated under a mapping
kills the reader with SIGBUS); a short read or bytes that do not hash to their digest
read as absent, and the pack is not used again by this process. A pack is never written
in place: removing entries writes a new pack and renames it over. The descriptor is
kept, so a pack evicted by another process stays readable here until the next
:meth:`TierPacks.refresh` (as an unlinked blob stays readable by whoever opened it).
Which entries may be used (signatures where the tier's standing asks for them) is the
tier's check (:class:`~kcache_client._tier.NodeTier`), made once per entry of each pack
*file* this process indexed: a pack is known by its file's identity (device, inode, size,
mtime, ctime), its verdicts are kept with it and dropped with it, and a refresh that finds
another file under a pack's name (deleted and written again, renamed over, written into)
indexes that file afresh and judges its entries again. The bytes an entry hands out are
read from the descriptor of the file that was judged, once, and checked against the
digest its judged header names (:meth:`TierPacks.read`).

The file itself (how a pack is written and indexed, the trailer signature by which a shared
tier judges a prefetch's whole pack with one verification, the index a private tier keeps
beside each pack) is :mod:`kcache_client._pack_file`'s; this module holds the tier's set of
packs as this process indexed them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from kcache.artifact import ArtifactMeta
from kcache.bundle_format import BundleError, IndexedEntry
from kcache.fsutil import (
    TMP_PREFIX,
    FileIdentity,
    UnsafeFileError,
    identity,
    open_regular,
    regular_files,
)
from kcache.keys import sha256_hex
from kcache.signing import Signature
from kcache_client._pack_file import (
    PACK_SUFFIX,
    SIDECAR_SUFFIX,
    PackWriter,
    index_file,
    pack_name,
    read_sidecar,
)
from kcache_client._trust import Verdict

# PackWriter is _pack_file's, handed on here: what a prefetch writes through (TierPacks.writer).
__all__ = ["PACKS_DIR", "PackEntry", "PackFile", "PackWriter", "TierPacks"]

_log = logging.getLogger("kcache_client")

#: The packs' directory under the tier's root.
PACKS_DIR = "packs"
# A refusal that is not lasting (a key not pinned yet) is reused this long, then judged again.
_TRANSIENT_S = 1.0
# A directory changed this recently may change again within its mtime's tick: listed anyway.
_RACY_NS = 2_000_000_000


@dataclass
class _Pack:
    name: str
    path: str
    fd: int
    entries: dict[str, IndexedEntry]
    #: The identity of the file ``fd`` opened (what a refresh compares the name's file with).
    identity: FileIdentity
    #: recipe key -> whether its entry may be used here: judged once for this file (a verdict
    #: that is not lasting, a key not trusted *yet*, is judged again at the next use).
    verdicts: dict[str, Verdict] = field(default_factory=dict)
    #: The signer's signature over every entry's binding, in file order (the bundle's, kept
    #: in the trailer by the prefetch that wrote the pack); None: each entry's own decides.
    signature: Signature | None = None
    #: Whether :attr:`signature` was tried (it is, once: a verdict for every entry at once).
    tried_whole: bool = False
    #: Every entry in file order, as the trailer's signature covers them (duplicates too).
    order: list[IndexedEntry] = field(default_factory=list)
    #: recipe key -> (when, a verdict that is not lasting): reused for :data:`_TRANSIENT_S`
    #: only (a pin may come any moment; judging again each lookup read the pin file twice).
    transient: dict[str, tuple[float, Verdict]] = field(default_factory=dict)


@dataclass(frozen=True)
class PackEntry:
    """One entry of one indexed pack file: what its header says, where its bytes lie, and
    the verdict remembered for it (kept with that file's pack, dropped with it)."""

    pack: _Pack
    indexed: IndexedEntry

    @property
    def name(self) -> str:
        return self.pack.name

    @property
    def recipe_key(self) -> str:
        return self.indexed.recipe_key

    @property
    def meta(self) -> ArtifactMeta:
        return self.indexed.meta

    @property
    def signature(self) -> Signature:
        return self.indexed.signature

    def verdict(
        self,
        judge: Callable[[str, ArtifactMeta, Signature], Verdict],
        judge_whole: Callable[[list[tuple[str, ArtifactMeta]], Signature], Verdict] | None = None,
    ) -> Verdict:
        """Whether this entry may be used (``judge(recipe_key, meta, signature)``, asked once
        per pack file; a refusal that is not lasting is not kept).

        ``judge_whole(bindings, signature)``, where given, is asked first, once per pack
        file with a trailer signature: accepted, it is every entry's verdict at once (one
        verification for the pack, not one per entry); refused, each entry's own decides.
        """
        head = self.indexed
        pack = self.pack
        verdicts = pack.verdicts
        found = verdicts.get(head.recipe_key)
        if found is not None:
            return found
        if judge_whole is not None and pack.signature is not None and not pack.tried_whole:
            whole = judge_whole([(e.recipe_key, e.meta) for e in pack.order], pack.signature)
            if whole.ok:
                for key in pack.entries:
                    verdicts[key] = whole
                pack.tried_whole = True
                return whole
            pack.tried_whole = whole.lasting  # a key not trusted yet: tried again later
        recent = pack.transient.get(head.recipe_key)
        now = time.monotonic()
        if recent is not None and now - recent[0] < _TRANSIENT_S:
            return recent[1]
        found = judge(head.recipe_key, head.meta, head.signature)
        if found.lasting:
            verdicts[head.recipe_key] = found
            pack.transient.pop(head.recipe_key, None)
        else:
            pack.transient[head.recipe_key] = (now, found)
        return found


@dataclass(frozen=True)
class PackFile:
    """One pack as listed for eviction and ``kcache cache info``."""

    name: str
    path: str
    size: int
    mtime: float
    entries: dict[str, ArtifactMeta]


class TierPacks:
    """The packs of one tier directory, as this process has indexed them (module docstring)."""

    def __init__(self, root: Path, *, sidecars: bool = False) -> None:
        self.directory = str(root / PACKS_DIR)
        #: Whether packs carry their index beside them, written and read (a private tier:
        #: only this user wrote either file; :func:`~kcache_client._pack_file.read_sidecar`).
        self.sidecars = sidecars
        self._packs: dict[str, _Pack] = {}
        #: recipe key -> the pack whose entry of it is found first (the entry is the pack's:
        #: no object more per entry for the collector to walk, B12).
        self._by_key: dict[str, _Pack] = {}
        self._refused: set[tuple[str, int, int]] = set()  # (name, inode, size) not indexable
        self._seen_ns = -1  # the directory's mtime when last listed
        self._lock = threading.Lock()

    def __contains__(self, recipe_key: str) -> bool:
        return recipe_key in self._by_key

    def writer(self) -> PackWriter:
        """A new pack in this tier (:class:`PackWriter`)."""
        return PackWriter(self.directory, sidecar=self.sidecars)

    def refresh(self) -> bool:
        """Index the packs that appeared since the last look, forget those gone; whether any changed.

        One ``stat`` when the directory has not changed since it was listed (and did not
        change within the last two seconds, its mtime's tick).
        """
        try:
            mtime_ns = os.stat(self.directory).st_mtime_ns
        except OSError:
            mtime_ns = -2
        if mtime_ns == self._seen_ns and time.time_ns() - mtime_ns >= _RACY_NS:
            return False
        with self._lock:
            self._seen_ns = mtime_ns
            names = {}
            replaced = []
            for entry in regular_files(self.directory):
                name = pack_name(entry.name)
                if name is None:
                    continue
                names[name] = entry.path
                held = self._packs.get(name)
                if held is not None and not _same_file(entry.path, held.identity):
                    replaced.append(name)  # another file under the name: indexed and judged afresh
            changed = False
            for gone in (self._packs.keys() - names.keys()) | set(replaced):
                self._drop(gone)
                changed = True
            for name in sorted(names.keys() - self._packs.keys()):
                pack = self._index(name, names[name])
                if pack is not None:
                    self._packs[name] = pack
                    for key in pack.entries:
                        self._by_key.setdefault(key, pack)
                    changed = True
            return changed

    def adopt(self, written: PackWriter) -> None:
        """Use a pack this process just committed, from what its writer noted (not read back)."""
        try:
            fd, st = open_regular(written.path)
        except OSError:
            return
        if st.st_size != written.file_size:  # not the file written (replaced meanwhile): read it
            os.close(fd)
            self.refresh()
            return
        pack = _Pack(
            written.name,
            written.path,
            fd,
            {e.recipe_key: e for e in written.index},
            identity(st),
            signature=written.signature,
            order=list(written.index),
        )
        with self._lock:
            self._packs[pack.name] = pack
            for key in pack.entries:
                self._by_key.setdefault(key, pack)

    def _index(self, name: str, path: str) -> _Pack | None:
        try:
            fd, st = open_regular(path)
        except FileNotFoundError:
            return None
        except UnsafeFileError as exc:
            _log.warning("kcache: not using the pack %s: %s", path, exc.reason)
            return None
        marker = (name, st.st_ino, st.st_size)
        if marker in self._refused:
            os.close(fd)
            return None
        try:
            known = read_sidecar(path, st) if self.sidecars else None
            found, signature = known if known is not None else index_file(fd, st.st_size, path)
        except (BundleError, OSError) as exc:
            os.close(fd)
            self._refused.add(marker)
            _log.warning("kcache: not using the pack %s: %s", path, exc)
            return None
        return _Pack(
            name,
            path,
            fd,
            {e.recipe_key: e for e in found},
            identity(st),
            signature=signature,
            order=found,
        )

    def _drop(self, name: str) -> None:
        pack = self._packs.pop(name, None)
        if pack is None:
            return
        for key in pack.entries:
            if self._by_key.get(key) is pack:
                del self._by_key[key]
                for other in self._packs.values():  # another pack may hold the key too
                    if key in other.entries:
                        self._by_key[key] = other
                        break
        with contextlib.suppress(OSError):
            os.close(pack.fd)

    def entry(self, recipe_key: str) -> PackEntry | None:
        """The entry of ``recipe_key`` in the pack holding it; nothing is read. None also
        when another thread set the entry aside (damaged) since the pack was looked up."""
        pack = self._by_key.get(recipe_key)
        if pack is None:
            return None
        indexed = pack.entries.get(recipe_key)
        return None if indexed is None else PackEntry(pack, indexed)

    def entries(self, recipe_key: str) -> Iterator[PackEntry]:
        """Every indexed pack's entry of ``recipe_key``, :meth:`entry`'s first: a caller that
        may not use the first (signed by a key not trusted here: another user's prefetch
        through another server) finds the one its own prefetch wrote."""
        first = self.entry(recipe_key)
        if first is None:
            return
        yield first
        for pack in list(self._packs.values()):
            indexed = pack.entries.get(recipe_key)
            if pack is not first.pack and indexed is not None:
                yield PackEntry(pack, indexed)

    def read(self, found: PackEntry) -> bytes | None:
        """The bytes of entry ``found`` (of the pack file it was found in, not whatever holds
        its recipe key now), read once and checked against its digest; None when they
        cannot be had."""
        pack, entry = found.pack, found.indexed
        recipe_key = found.recipe_key
        size = entry.size
        try:
            data = os.pread(pack.fd, size, entry.offset)
        except OSError:
            data = b""
        if len(data) != size:  # the file is shorter than when indexed: none of it is used
            with self._lock:
                if self._packs.get(pack.name) is not pack:
                    return None  # dropped meanwhile (replaced, removed): not this file's fault
                _log.warning("kcache: not using the pack %s: it was cut short", pack.path)
                self._drop(pack.name)
            return None
        if sha256_hex(data) != entry.meta.digest:  # this entry's bytes, not the others'
            _log.warning(
                "kcache: not using the entry of recipe %s in the pack %s: its bytes do not hash "
                "to its digest (damaged)",
                recipe_key,
                pack.path,
            )
            with self._lock:
                pack.entries.pop(recipe_key, None)
                if self._by_key.get(recipe_key) is pack:
                    del self._by_key[recipe_key]
            return None
        return data

    def files(self) -> list[PackFile]:
        """Every pack file of the directory, with its size, mtime and (when it could be indexed)
        its entries: a damaged pack is listed too, without entries, so that it is evicted."""
        self.refresh()
        listed = []
        for found in regular_files(self.directory):
            name = pack_name(found.name)
            if name is None:
                continue
            try:
                st = found.stat(follow_symlinks=False)
            except OSError:
                continue
            pack = self._packs.get(name)
            metas = {} if pack is None else {k: e.meta for k, e in pack.entries.items()}
            size = st.st_size
            with contextlib.suppress(OSError):  # its index beside it goes with it (remove)
                size += os.stat(found.path + SIDECAR_SUFFIX, follow_symlinks=False).st_size
            listed.append(PackFile(name, found.path, size, st.st_mtime, metas))
        return listed

    def sweep_partials(self, older_than: float) -> int:
        """Remove packs a writer left half written (it died) last written before ``older_than``
        (epoch seconds); how many. A live writer writes its file as the bundle arrives."""
        swept = 0
        for found in regular_files(self.directory):
            if not (found.name.startswith(TMP_PREFIX) and found.name.endswith(PACK_SUFFIX)):
                continue
            with contextlib.suppress(OSError):
                if found.stat(follow_symlinks=False).st_mtime < older_than:
                    os.unlink(found.path)
                    swept += 1
        return swept

    def touch(self, name: str) -> None:
        """Mark the pack used now (its mtime: the tier's LRU stamp)."""
        pack = self._packs.get(name)
        if pack is not None:
            with contextlib.suppress(OSError):
                os.utime(pack.path, follow_symlinks=False)

    def remove(self, name: str) -> int:
        """Delete the pack; the bytes freed (0 when it was gone, or is not this user's to delete)."""
        path = os.path.join(self.directory, f"{name}{PACK_SUFFIX}")
        try:
            size = os.stat(path, follow_symlinks=False).st_size
            os.unlink(path)
        except FileNotFoundError:
            return 0
        except PermissionError:  # another user's pack in a shared tier: theirs to remove
            return 0
        with contextlib.suppress(OSError):
            size += os.stat(path + SIDECAR_SUFFIX, follow_symlinks=False).st_size
            os.unlink(path + SIDECAR_SUFFIX)
        with self._lock:
            self._drop(name)
        return size

    def without(self, name: str, keys: Iterable[str]) -> tuple[int, int]:
        """Rewrite the pack without ``keys``' entries: (entries removed, bytes freed).

        The kept entries are copied into a new pack (each checked again), which replaces
        the old one; a pack left with nothing is deleted.
        """
        pack = self._packs.get(name)
        if pack is None:
            return 0, 0
        dropped = set(keys) & pack.entries.keys()
        if not dropped:
            return 0, 0
        kept = [k for k in pack.entries if k not in dropped]
        freed = sum(pack.entries[k].size for k in dropped)
        replacement = None
        if kept:
            with self.writer() as out:
                for key, data in self._copies(pack, kept):
                    head = pack.entries[key]
                    out.add(key, head.meta, data, head.signature)
            replacement = out.name
        if not self.remove(name) and os.path.exists(pack.path):  # not ours to remove
            if replacement is not None:
                self.remove(replacement)
            return 0, 0
        self.refresh()
        return len(dropped), freed

    def _copies(self, pack: _Pack, keys: list[str]) -> Iterator[tuple[str, bytes]]:
        for key in keys:
            entry = pack.entries[key]
            data = os.pread(pack.fd, entry.size, entry.offset)
            if len(data) == entry.size and sha256_hex(data) == entry.meta.digest:
                yield key, data

    def close(self) -> None:
        """Let go of every descriptor (and with the packs, every verdict on their entries)."""
        with self._lock:
            for name in list(self._packs):
                self._drop(name)
            self._seen_ns = -1


def _same_file(path: str, known: FileIdentity) -> bool:
    """Whether ``path`` is still the file of identity ``known`` (not replaced, not written)."""
    try:
        return identity(os.stat(path, follow_symlinks=False)) == known
    except OSError:
        return False
