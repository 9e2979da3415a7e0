"""Reading a node tier's entries, each file checked once: an alias, its blob, a pack's entry.

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

Whether the tier may use what it read (its standing, the trusted keys, the withdrawals) is
asked of the tier (:meth:`~kcache_client._tier.NodeTier.verdict`), once per alias file and
once per entry of each pack file; what it refuses reads as absent, with one warning.
These are functions of the tier, not a part it holds, so that a lookup (the hot path:
:meth:`~kcache_client._tier.NodeTier.lookup_signed`) makes no object and takes no step
more for them than it did as the tier's own methods.
"""

from __future__ import annotations

import os
import time
from typing import Protocol

from kcache.artifact import ArtifactMeta
from kcache.errors import ArtifactNotFoundError, CorruptArtifactError
from kcache.fsutil import FileIdentity, UnsafeFileError, identity, read_file_identified
from kcache.index.file import MAX_ENTRY_BYTES, FileIndex
from kcache.keys import sha256_hex
from kcache.lru import LruCache
from kcache.signing import Signature, SignatureError
from kcache.standing import Standing
from kcache.store.local import LocalArtifactStore
from kcache_client._packs import PackEntry, TierPacks
from kcache_client._trust import Verdict
from kcache_client._withdrawals import Withdrawals

__all__ = ["ReadTier", "alias_entry", "blob_bytes", "pack_entry", "withdrawn"]

# A file is known by its identity once its ctime is this old (coarse clocks: FAT's 2 s).
_SETTLED_NS = 2_000_000_000


class ReadTier(Protocol):
    """What the reads use of their node tier (a :class:`~kcache_client._tier.NodeTier`)."""

    @property
    def index(self) -> FileIndex: ...

    @property
    def store(self) -> LocalArtifactStore: ...

    @property
    def packs(self) -> TierPacks: ...

    @property
    def standing(self) -> Standing: ...

    @property
    def withdrawals(self) -> Withdrawals: ...

    @property
    def verified_blobs(self) -> LruCache[str, FileIdentity]: ...

    @property
    def parsed_aliases(
        self,
    ) -> LruCache[str, tuple[FileIdentity, ArtifactMeta, Signature | None]]: ...

    def location(self, digest: str) -> str: ...

    def verdict(
        self, recipe_key: str, entry: ArtifactMeta, signature: Signature | None
    ) -> Verdict: ...

    def pack_verdict(
        self, bindings: list[tuple[str, ArtifactMeta]], signature: Signature
    ) -> Verdict: ...

    def refuse(self, what: str, problem: str) -> None: ...


def alias_entry(tier: ReadTier, recipe_key: str) -> tuple[ArtifactMeta, Signature | None] | None:
    """The alias's artifact and signature, parsed and checked once per alias file this
    process read (module docstring).

    An alias parsed before is only ``stat``-ed: its file unchanged, what it said then
    stands, and its bytes need not be read again.
    """
    path = tier.index.alias_path(recipe_key)
    known = tier.parsed_aliases.get(recipe_key)
    try:
        if known is not None and identity(os.lstat(path)) == known[0]:
            return None if withdrawn(tier, recipe_key, known[1].digest) else known[1:]
        raw, alias = read_file_identified(path, MAX_ENTRY_BYTES)
    except FileNotFoundError:
        return None
    except UnsafeFileError as exc:
        tier.refuse(f"the entry {path}", exc.reason)
        return None
    entry, stored = tier.index.parse_signed_alias(recipe_key, raw)
    if not isinstance(entry, ArtifactMeta):
        return None
    signature = None
    if stored is not None:
        try:
            signature = Signature.from_dict(stored)
        except SignatureError as exc:
            tier.refuse(f"the entry {path}", str(exc))
            return None
    problem = tier.verdict(recipe_key, entry, signature).problem
    if problem is not None:
        tier.refuse(f"the entry {path}", problem)
        return None
    if withdrawn(tier, recipe_key, entry.digest):
        return None
    if _settled(alias, len(raw)):
        tier.parsed_aliases.put(recipe_key, (alias, entry, signature))
    return entry, signature


def withdrawn(tier: ReadTier, recipe_key: str, digest: str, where: str = "its alias") -> bool:
    """Whether ``recipe_key`` -> ``digest`` is withdrawn (warned about once): not answered."""
    if not tier.withdrawals.withdrawn(recipe_key, digest):
        return False
    tier.refuse(
        f"the entry of recipe {recipe_key} ({where})",
        f"the server withdrew its binding to {digest} (kcache_client._withdrawals)",
    )
    return True


def pack_entry(tier: ReadTier, recipe_key: str) -> PackEntry | None:
    """The pack entry of ``recipe_key`` this tier may use (its signature checked where the
    standing asks, once per entry of the pack file it is in), or None; its bytes are not
    read."""
    found = tier.packs.entry(recipe_key)
    if found is None:
        return None
    whole = tier.pack_verdict if tier.standing.signed_only else None
    first = found.verdict(tier.verdict, whole)
    first_pack = found.pack
    if first.ok:
        if withdrawn(tier, recipe_key, found.meta.digest, f"pack {found.name}"):
            return None
        return found
    for found in tier.packs.entries(recipe_key):  # another pack's, the first's refused
        verdict = first if found.pack is first_pack else found.verdict(tier.verdict, whole)
        if verdict.problem is not None:
            tier.refuse(f"the entry of recipe {recipe_key} in pack {found.name}", verdict.problem)
            continue
        if withdrawn(tier, recipe_key, found.meta.digest, f"pack {found.name}"):
            return None
        return found
    return None


def blob_bytes(tier: ReadTier, digest: str, size: int) -> bytes:
    """The verified bytes of ``digest`` (``size`` of them), hashed once per blob file read.

    Bytes that do not match go to the store's own read, which quarantines the file
    (CorruptArtifactError) unless it was replaced meanwhile. A file larger than
    ``size``, or not a regular file, is not read at all.
    """
    location = tier.location(digest)
    try:
        data, blob = read_file_identified(location, size)
    except FileNotFoundError:
        raise ArtifactNotFoundError(f"no blob {digest} in {tier.store.blobs}") from None
    except UnsafeFileError as exc:
        tier.refuse(f"the blob {location}", exc.reason)
        raise CorruptArtifactError(digest, exc.reason, None) from None
    if tier.verified_blobs.get(digest) == blob and len(data) == blob[2]:
        return data
    if sha256_hex(data) != digest:
        return tier.store.get(digest)
    if _settled(blob, len(data)):
        tier.verified_blobs.put(digest, blob)
    return data


def _settled(file: FileIdentity, nbytes: int) -> bool:
    """Whether a file read as ``nbytes`` may be known by its identity ``file`` from now on.

    The bytes must be the whole file of that identity (not one that grew or shrank
    while it was read), and its ctime at least :data:`_SETTLED_NS` old, so that a later
    write cannot share its timestamp (module docstring).
    """
    return nbytes == file[2] and time.time_ns() - file[4] >= _SETTLED_NS
