"""A foreign group in the node tier: one blob, so a reader finds all of it or none.

What :class:`~kcache_client._foreign.ForeignCache` reads before the server and what a
prefetch of a job's manifest writes (docs/design.md section 10) are the same entries:
the group packed into one blob (:func:`pack_group`), published under its binding key
with kind ``foreign``, unsigned (a foreign signature is not kcache's, and only the
user's private tier takes one: :func:`takes_foreign`).

A group an admin removed from the server is withdrawn by its binding key and content
digest (:func:`kcache.foreign.group_digest`; docs/design.md section 3, "What a binding
rests on"): :func:`withdrawn_group` is the verdict on a group held as bytes, which hashes
them only when some withdrawal names the key.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING

from kcache.artifact import ArtifactMeta
from kcache.foreign import group_digest, refs_of

if TYPE_CHECKING:
    from kcache_client._tier import NodeTier
    from kcache_client._withdrawals import Withdrawals

__all__ = [
    "content_digest",
    "group_meta",
    "keep_group",
    "pack_group",
    "read_group",
    "reinstate_group",
    "takes_foreign",
    "unpack_group",
    "withdrawn_group",
]

_MAGIC = b"kcache-foreign-group/1\n"


def pack_group(files: Mapping[str, bytes]) -> bytes:
    """A group as one blob: a header line naming each file and its size, then the bytes in order."""
    names = sorted(files)
    header = json.dumps([[n, len(files[n])] for n in names], separators=(",", ":"))
    return b"".join([_MAGIC, header.encode("utf-8"), b"\n", *(files[n] for n in names)])


def unpack_group(blob: bytes) -> dict[str, bytes] | None:
    """Inverse of :func:`pack_group`; None for a blob that is not one whole group."""
    if not blob.startswith(_MAGIC):
        return None
    end = blob.find(b"\n", len(_MAGIC))
    try:
        listed = json.loads(blob[len(_MAGIC) : end])
        offset, files = end + 1, {}
        for name, size in listed:
            if not isinstance(name, str) or type(size) is not int or size < 0:
                return None
            files[name] = blob[offset : offset + size]
            offset += size
    except (ValueError, TypeError):
        return None
    if (
        end < 0
        or offset != len(blob)
        or any(len(v) != s for v, (_, s) in zip(files.values(), listed, strict=True))
    ):
        return None
    return files


def takes_foreign(tier: NodeTier) -> bool:
    """Whether ``tier`` keeps foreign groups: the user's private, writable tier (a shared
    tier's entries need kcache's own signatures, which a foreign group has not)."""
    return not tier.standing.signed_only and not tier.read_only


def group_meta(name: tuple[str, str, str, str, str], blob: bytes) -> ArtifactMeta:
    """The tier's metadata of a group's blob under ``name`` (library, version, target, toolchain, key)."""
    library, version, target, toolchain, key = name
    return ArtifactMeta(
        digest=hashlib.sha256(blob).hexdigest(),
        size=len(blob),
        kind="foreign",
        target=target,
        toolchain=f"{library}-{version}/{toolchain}",
        kernel=f"foreign:{library}:{key}",
    )


def keep_group(
    tier: NodeTier, name: tuple[str, str, str, str, str], key: str, files: Mapping[str, bytes]
) -> str | None:
    """Keep the group in ``tier`` under binding key ``key``: the blob's digest, or None when
    the tier takes no foreign group or published nothing."""
    if not takes_foreign(tier):
        return None
    blob = pack_group(files)
    meta = group_meta(name, blob)
    return meta.digest if tier.publish(key, None, meta, blob) is not None else None


def read_group(tier: NodeTier, key: str) -> dict[str, bytes] | None:
    """The group ``tier`` holds under binding key ``key`` (file name -> bytes), or None."""
    if not takes_foreign(tier):
        return None
    hit = tier.lookup(key)
    if hit is None or hit[0].kind != "foreign":
        return None
    return unpack_group(hit[1])


def content_digest(files: Mapping[str, bytes]) -> str:
    """The content digest (:func:`kcache.foreign.group_digest`) of a group held as bytes."""
    return group_digest(refs_of(files))


def withdrawn_group(known: Withdrawals, key: str, files: Mapping[str, bytes]) -> bool:
    """Whether the group ``files`` under binding key ``key`` is withdrawn, as far as ``known`` says."""
    return known.names(key) and known.withdrawn(key, content_digest(files))


def reinstate_group(known: Withdrawals, key: str, files: Mapping[str, bytes]) -> None:
    """The group ``files`` under binding key ``key`` is someone's word now (the server's
    answer, this node's own compile): no longer refused here, whatever the feed said of the
    same bytes (:meth:`~kcache_client._withdrawals.Withdrawals.reinstate`). Hashes the
    bytes only when a withdrawal names the key."""
    if known.names(key):
        known.reinstate((key, content_digest(files)))
