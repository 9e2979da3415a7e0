"""One pack file: how it is written, indexed, and indexed from the index kept beside it.

A pack is a bundle answer (:mod:`kcache.bundle_format`) kept whole in a node tier:
``<tier>/packs/<id>.kcb``, 32 hex digits and the suffix. :class:`PackWriter` writes it
under a staging name (``TMP_PREFIX``, which the tier's listings ignore) as the entries
arrive and renames it into place at the end; nothing ever writes a pack in place (removing
entries writes a new pack and renames it over). Which packs a tier holds, how a lookup
reads them and which entries it may use is :mod:`kcache_client._packs`'s part.

A prefetch's pack keeps, in its trailer, the server's signature over all of its entries
(the bundle's, which the prefetch verified), so that a shared tier can judge the whole pack
with that one verification (:func:`index_file` reads it back). A private tier's pack carries
its index beside it (``<pack>.idx``, bound to the pack file's inode and size:
:func:`write_sidecar`, :func:`read_sidecar`), so that the node's other processes index it
with one parse instead of one header line and one metadata check per entry; a shared tier
never writes or reads one (another user could write it).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import secrets
from typing import Any, BinaryIO

from kcache.artifact import ArtifactMeta
from kcache.bundle_format import (
    IndexedEntry,
    end_line,
    entry_head,
    header_line,
    index_bundle,
)
from kcache.deps import Dependency
from kcache.fsutil import TMP_PREFIX, UnsafeFileError, atomic_write, read_file_identified
from kcache.signing import Signature, SignatureError

__all__ = [
    "PACK_SUFFIX",
    "SIDECAR_SUFFIX",
    "PackWriter",
    "index_file",
    "pack_name",
    "read_sidecar",
    "write_sidecar",
]

#: A pack file's suffix (its name: 32 hex digits, then this).
PACK_SUFFIX = ".kcb"
#: A pack's index beside it (a private tier's: :func:`write_sidecar`), its format, its bound.
SIDECAR_SUFFIX = ".idx"
_SIDECAR_FORMAT = "kcache-pack-index/1"
_SIDECAR_MAX_BYTES = 256 << 20
# A pack's entries are bounded as the server's answers are (the bundle reader's check).
_MAX_ENTRY_BYTES = 1 << 30
# A pack up to this size is indexed from one read of it (index_file).
_READ_WHOLE_BYTES = 64 << 20


def pack_name(file_name: str) -> str | None:
    """The pack id of a file name in the packs directory (32 hex and the suffix), or None."""
    stem = file_name[: -len(PACK_SUFFIX)]
    if not file_name.endswith(PACK_SUFFIX) or len(stem) != 32:
        return None
    try:
        int(stem, 16)
    except ValueError:
        return None
    return stem if stem == stem.lower() else None


class PackWriter:
    """A pack being written: entries (checked by the caller) added in order, then committed.

    The file is written beside its final name (a staging name the tier's listings
    ignore) and renamed into place by :meth:`commit`, or thrown away by :meth:`abandon`
    (what leaving a ``with`` block by an exception does).
    """

    def __init__(self, directory: str, *, sidecar: bool = False) -> None:
        os.makedirs(directory, exist_ok=True)
        self.name = secrets.token_hex(16)
        self.path = os.path.join(directory, f"{self.name}{PACK_SUFFIX}")
        #: Whether :meth:`commit` writes the pack's index beside it (a private tier's packs:
        #: :func:`write_sidecar`).
        self.sidecar = sidecar
        self._partial = os.path.join(directory, f"{TMP_PREFIX}{self.name}{PACK_SUFFIX}")
        fd = os.open(self._partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        self._out: BinaryIO = os.fdopen(fd, "wb", buffering=1 << 20)
        first = header_line()
        self._out.write(first)
        self._size = len(first)
        #: Where each entry's bytes lie, as an index of the file would find them.
        self.index: list[IndexedEntry] = []
        #: The signature over every entry that :meth:`commit` put in the trailer.
        self.signature: Signature | None = None
        self.bytes = 0
        self._closed = False

    @property
    def count(self) -> int:
        return len(self.index)

    @property
    def file_size(self) -> int:
        """The pack file's length as written so far (all of it once committed)."""
        return self._size

    def add(
        self,
        recipe_key: str,
        meta: ArtifactMeta,
        data: bytes,
        signature: Signature,
        head_line: bytes = b"",
    ) -> None:
        """Append one entry (its bytes verified against ``meta`` by the caller).

        ``head_line``: the entry's header line as a bundle reader read and checked it
        (:attr:`~kcache.bundle_format.BundleEntry.head`), copied rather than encoded again.
        """
        head = head_line + b"\n" if head_line else entry_head(recipe_key, meta, signature)
        self._out.write(head)
        self._out.write(data)
        self._out.write(b"\n")
        self.index.append(IndexedEntry(recipe_key, meta, signature, self._size + len(head)))
        self._size += len(head) + len(data) + 1
        self.bytes += len(data)

    def commit(self, signature: Signature | None = None) -> str | None:
        """Put the pack in place (not synced: the tier is a cache); its name, or None if empty."""
        if self._closed:
            return self.name if self.count else None
        self._closed = True
        try:
            if self.count:
                trailer = end_line(self.count, 0, signature)
                self.signature = signature
                self._out.write(trailer)
                self._size += len(trailer)
            self._out.close()
            if self.count:
                os.rename(self._partial, self.path)
                if self.sidecar:
                    with contextlib.suppress(OSError):
                        write_sidecar(self.path, self.index, self.signature)
                return self.name
            return None
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._partial)

    def abandon(self) -> None:
        """Throw the pack away (nothing of it is used)."""
        if not self._closed:
            self._closed = True
            with contextlib.suppress(OSError):
                self._out.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._partial)

    def __enter__(self) -> PackWriter:
        return self

    def __exit__(self, kind: object, *rest: object) -> None:
        if kind is not None:
            self.abandon()
            return
        try:
            self.commit()
        except OSError:
            self.abandon()
            raise


def index_file(fd: int, size: int, path: str) -> tuple[list[IndexedEntry], Signature | None]:
    """The entries of the pack open at ``fd`` (:func:`~kcache.bundle_format.index_bundle`),
    and the signature its trailer carries over all of them (None when it has none).

    A pack of up to :data:`_READ_WHOLE_BYTES` is read with one ``pread`` and indexed in
    memory: indexing asks the position after every header line, which a buffered file
    answers with a system call each. A larger one is indexed from the file, its bytes skipped.
    """
    if size <= _READ_WHOLE_BYTES:
        whole = os.pread(fd, size + 1, 0)
        found = index_bundle(io.BytesIO(whole), max_entry_bytes=_MAX_ENTRY_BYTES, where=path)
    else:
        with os.fdopen(os.dup(fd), "rb", buffering=1 << 16) as handle:
            found = index_bundle(handle, max_entry_bytes=_MAX_ENTRY_BYTES, where=path)
        whole = b""
    if not found:
        return found, None
    start = found[-1].offset + found[-1].size + 1  # the trailer, checked by index_bundle
    trailer = whole[start:] if whole else os.pread(fd, min(size - start, 1 << 16), start)
    try:
        signed = json.loads(trailer).get("signature")
        return found, None if signed is None else Signature.from_dict(signed)
    except (ValueError, AttributeError, SignatureError):
        return found, None


def write_sidecar(path: str, index: list[IndexedEntry], signature: Signature | None) -> None:
    """Write the index of the pack at ``path`` (just put in place) beside it, ``<pack>.idx``:
    its entries' headers and offsets as one JSON document, and the pack file's inode and
    size, so that a process of a private tier indexes the pack with one parse of the
    document instead of one header line and one metadata check per entry (a rank's largest
    cost on a complete tier: 13 -> 5 ms at 800 entries, B12)."""
    st = os.stat(path, follow_symlinks=False)
    body = {
        "format": _SIDECAR_FORMAT,
        "pack": [st.st_ino, st.st_size],
        "signature": None if signature is None else signature.to_dict(),
        "entries": [
            [e.recipe_key, e.offset, e.meta.to_dict(), e.signature.to_dict()] for e in index
        ],
    }
    atomic_write(
        path + SIDECAR_SUFFIX, json.dumps(body, separators=(",", ":")).encode(), durable=False
    )


def read_sidecar(
    path: str, st: os.stat_result
) -> tuple[list[IndexedEntry], Signature | None] | None:
    """The index :func:`write_sidecar` wrote for the pack file ``st`` (its inode and size),
    or None (absent, another file's, damaged: the pack is indexed itself).

    Only a private tier reads it (``TierPacks.sidecars``): its writer is this user, as the
    pack's is, so its metadata is taken as the pack's headers would be, without checking
    each field again; the bytes an entry hands out are still checked against its digest."""
    try:
        raw, _ = read_file_identified(path + SIDECAR_SUFFIX, _SIDECAR_MAX_BYTES)
        body = json.loads(raw)
        if body.get("format") != _SIDECAR_FORMAT or body.get("pack") != [st.st_ino, st.st_size]:
            return None
        found = [
            IndexedEntry(key, _meta(meta), Signature(sig["key_id"], sig["signature"]), offset)
            for key, offset, meta, sig in body["entries"]
        ]
        signed = body.get("signature")
        return found, None if signed is None else Signature.from_dict(signed)
    except (OSError, UnsafeFileError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _meta(data: dict[str, Any]) -> ArtifactMeta:
    """Metadata as :meth:`ArtifactMeta.to_dict` wrote it (a private tier's own sidecar)."""
    return ArtifactMeta(
        digest=data["digest"],
        size=data["size"],
        kind=data["kind"],
        target=data["target"],
        toolchain=data["toolchain"],
        lowered_names=data["lowered_names"],
        compile_seconds=float(data["compile_seconds"]),
        log=data["log"],
        dependencies=tuple(Dependency(d["name"], d["sha256"]) for d in data["dependencies"]),
        dependencies_exact=data["dependencies_exact"],
        kernel=data["kernel"],
        created_at=float(data["created_at"]),
        dependency_check=data.get("dependency_check", 0),
    )
