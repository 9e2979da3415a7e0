"""``FileIndex``: the index as JSON files, for the CLI's data directory and the client's node tier.

Layout under ``<root>/index/``: ``recipes/ab/<recipe_key>.json`` (alias, with a copy
of the artifact's metadata so a hit reads one small file, or a negative entry),
``artifacts/ab/<digest>.json`` (metadata), ``manifests/ab/<base_key>.json``; in a flat
cache directory (:func:`kcache.dirs.cache_layout`) the same names without the ``ab/``.
Every file is published atomically (temp, fsync, rename), and the alias is written
last, so a crash leaves at worst an unreferenced artifact record. A cache may open
the index with ``durable=False`` (no fsync, manifests updated without their lock,
the alias written first): then a power loss may leave any file empty or garbage,
and every read treats such a file as absent.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import filelock

from kcache.artifact import ArtifactMeta, CompileFailure, ManifestEntry
from kcache.fsutil import UnsafeFileError, atomic_write, make_dirs, read_file, regular_files
from kcache.index.base import MANIFEST_LIMIT
from kcache.keys import is_hex_key, require_hex_key

__all__ = ["MAX_ENTRY_BYTES", "FileIndex"]

#: The largest index file read: an alias or record is a few KB (a dependency list of a
#: thousand headers about 100 KB); anything larger was not written by kcache.
MAX_ENTRY_BYTES = 4 << 20


class FileIndex:
    """An :class:`~kcache.index.base.Index` over a directory of JSON files."""

    def __init__(
        self, root: str | os.PathLike[str], *, durable: bool = True, flat: bool = False
    ) -> None:
        """The index under ``root/index``; ``durable=False`` writes without fsync (caches only).

        Without fsync a power loss may leave any file empty or garbage; every read
        here treats such a file as absent, so a cache (the client's node tier) refetches
        instead of answering wrongly. See :func:`kcache.fsutil.atomic_write`. ``flat``
        keeps each kind's files in one directory, without fan-out directories.
        """
        self.root = Path(root) / "index"
        self.durable = durable
        self.flat = flat
        self._root_str = str(self.root)
        for sub in ("recipes", "artifacts", "manifests", ".locks"):
            make_dirs(f"{self._root_str}/{sub}")

    def _path(self, kind: str, key: str) -> Path:
        return Path(self._path_str(kind, key))

    def _path_str(self, kind: str, key: str) -> str:
        # String joins: pathlib costs tens of microseconds on a node-tier hit.
        require_hex_key(key, "key")
        if self.flat:
            return f"{self._root_str}/{kind}/{key}.json"
        return f"{self._root_str}/{kind}/{key[:2]}/{key}.json"

    def files(self, kind: str) -> Iterator[Path]:
        """Every file of ``kind`` (``recipes``, ``artifacts`` or ``manifests``), named ``<key>.json``."""
        for entry in regular_files(self.root / kind, 0 if self.flat else 1):
            name = entry.name
            if name.endswith(".json") and is_hex_key(name[:-5]):  # not a staging file
                yield Path(entry.path)

    def _read(self, kind: str, key: str) -> Any:
        try:
            return json.loads(read_file(self._path_str(kind, key), MAX_ENTRY_BYTES))
        except (FileNotFoundError, UnsafeFileError):
            # Absent, or a link, FIFO or oversized file planted in a directory others write.
            return None
        except ValueError:
            # Garbage or empty: a file published without fsync (durable=False) before a
            # power loss, or a damaged disk. Absent, never a wrong answer.
            return None

    def _write(self, kind: str, key: str, value: Any) -> None:
        atomic_write(
            self._path_str(kind, key),
            json.dumps(value, sort_keys=True).encode(),
            durable=self.durable,
        )

    def lookup(self, recipe_key: str) -> ArtifactMeta | CompileFailure | None:
        """Follow the alias to the artifact metadata, or return the negative entry.

        An alias that parses as JSON but is not a well-formed entry reads as absent too,
        and so does one that names another recipe key (or metadata of another digest):
        a filesystem that lost unsynced data can show a file with another file's old
        blocks. Every entry names its own key; in a non-durable index one that does not
        (written before entries did) is absent as well, since nothing vouches for it.
        """
        try:
            raw = read_file(self.alias_path(recipe_key), MAX_ENTRY_BYTES)
        except (FileNotFoundError, UnsafeFileError):
            return None
        return self.parse_alias(recipe_key, raw)

    def alias_path(self, recipe_key: str) -> str:
        """Where the alias (or negative entry) of ``recipe_key`` lives."""
        return self._path_str("recipes", recipe_key)

    def parse_alias(self, recipe_key: str, raw: bytes) -> ArtifactMeta | CompileFailure | None:
        """What an alias file's bytes say for ``recipe_key``: :meth:`lookup` after its read.

        For a caller that reads the file itself (the node tier, which also learns the
        file's identity from the same read).
        """
        return self.parse_signed_alias(recipe_key, raw)[0]

    def parse_signed_alias(
        self, recipe_key: str, raw: bytes
    ) -> tuple[ArtifactMeta | CompileFailure | None, Any]:
        """:meth:`parse_alias`, and the signature stored with it (unparsed; None if none)."""
        try:
            entry = json.loads(raw)
            return self._entry(recipe_key, entry), entry.get("signature")
        except (KeyError, TypeError, ValueError, AttributeError):
            return None, None

    def _entry(self, recipe_key: str, entry: Any) -> ArtifactMeta | CompileFailure | None:
        if not isinstance(entry, dict):
            return None
        if "failure" in entry:
            failure = CompileFailure.from_dict(entry["failure"])
            return None if failure.expired() or failure.recipe_key != recipe_key else failure
        owner = entry.get("recipe_key")
        if owner != recipe_key and (owner is not None or not self.durable):
            return None
        digest = entry["digest"]
        if "artifact" in entry:
            meta = ArtifactMeta.from_dict(entry["artifact"])
            return meta if meta.digest == digest else None
        return self.artifact(digest)

    def artifact(self, digest: str) -> ArtifactMeta | None:
        """Metadata by digest."""
        data = self._read("artifacts", digest)
        if not isinstance(data, dict) or not data:
            return None
        try:
            meta = ArtifactMeta.from_dict(data)
        except (KeyError, TypeError, ValueError, AttributeError):
            return None  # well-formed JSON, malformed record: absent (see _read)
        return meta if meta.digest == digest else None  # another record's old blocks

    def manifest(self, base_key: str) -> list[ManifestEntry]:
        """Entries newest first (none when the file is absent or malformed)."""
        data = self._read("manifests", base_key)
        if not isinstance(data, list):
            return []
        try:
            return [ManifestEntry.from_dict(e) for e in data]
        except (KeyError, TypeError, ValueError, AttributeError):
            return []

    def record_artifact(self, recipe_key: str, base_key: str, meta: ArtifactMeta) -> None:
        """The artifact's metadata record, its manifest entry and the recipe's alias.

        A durable index writes the alias last, as the commit point: a crash leaves at
        worst an unreferenced record. A cache (``durable=False``, the node tier) writes
        it first, so that processes waiting for the entry need not wait for the rest:
        the alias carries the metadata a hit reads, and a record or manifest entry lost
        to a crash costs at most an offline manifest match (a compile) and an eviction
        that dates the entry by its blob. Without fsync the order holds only while the
        machine runs anyway. A cache may also write the two parts itself, the second
        later (:meth:`write_alias`, then :meth:`record_metadata`).
        """
        if not self.durable:
            self.write_alias(recipe_key, meta)
        self.record_metadata(base_key, meta)
        if self.durable:
            self.write_alias(recipe_key, meta)

    def write_alias(
        self, recipe_key: str, meta: ArtifactMeta, signature: dict[str, str] | None = None
    ) -> None:
        """``recipe_key`` -> the artifact, with its metadata (what a hit reads) and the
        server's signature of the two when there is one (:mod:`kcache.signing`)."""
        alias: dict[str, Any] = {
            "recipe_key": recipe_key,
            "digest": meta.digest,
            "artifact": meta.to_dict(),
        }
        if signature is not None:
            alias["signature"] = signature
        self._write("recipes", recipe_key, alias)

    def record_metadata(self, base_key: str, meta: ArtifactMeta) -> None:
        """The artifact's record (unless there is one as well proven) and its entry in ``base_key``'s manifest."""
        known = self.artifact(meta.digest)
        if known is None or known.dependency_check < meta.dependency_check:
            self._write("artifacts", meta.digest, meta.to_dict())
        entry = ManifestEntry(
            meta.digest, meta.dependencies, dependency_check=meta.dependency_check
        )
        if self.durable:
            # The lock only keeps concurrent writers from dropping each other's entries;
            # a lost entry would cost a recompile, never a wrong result.
            with filelock.FileLock(f"{self._root_str}/.locks/{base_key}.lock", timeout=60):
                self._add_to_manifest(base_key, entry)
        else:
            # A cache goes without: two processes adding entries under one base key at
            # the same moment (the same source, other header texts) may lose one, which
            # costs at most a compile an offline manifest match would have spared; a
            # lock per publish was a good part of a cold rank's time.
            self._add_to_manifest(base_key, entry)

    def _add_to_manifest(self, base_key: str, entry: ManifestEntry) -> None:
        entries = [e for e in self.manifest(base_key) if e.dependencies != entry.dependencies]
        entries = [entry, *entries][:MANIFEST_LIMIT]
        self._write("manifests", base_key, [e.to_dict() for e in entries])

    def record_alias(self, recipe_key: str, digest: str) -> None:
        """``recipe_key`` -> ``digest`` (with the artifact's metadata when it is recorded)."""
        meta = self.artifact(digest)
        self._write(
            "recipes",
            recipe_key,
            {
                "recipe_key": recipe_key,
                "digest": digest,
                **({"artifact": meta.to_dict()} if meta else {}),
            },
        )

    def record_failure(self, failure: CompileFailure) -> None:
        """A negative entry under the failed recipe's key."""
        self._write("recipes", failure.recipe_key, {"failure": failure.to_dict()})

    def forget(self, recipe_key: str) -> None:
        """Remove the alias or negative entry."""
        self._path("recipes", recipe_key).unlink(missing_ok=True)
