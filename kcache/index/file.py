"""``FileIndex``: the index as JSON files, for the CLI's data directory and the client's node tier.

Layout under ``<root>/index/``: ``recipes/ab/<recipe_key>.json`` (alias or negative
entry), ``artifacts/ab/<digest>.json`` (metadata), ``manifests/ab/<base_key>.json``.
Every file is published atomically (temp, fsync, rename), and the alias is written
last, so a crash leaves at worst an unreferenced artifact record.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import filelock

from kcache._fsutil import atomic_write
from kcache.artifact import ArtifactMeta, CompileFailure, ManifestEntry
from kcache.index.base import MANIFEST_LIMIT
from kcache.keys import is_hex_key

__all__ = ["FileIndex"]


class FileIndex:
    """An :class:`~kcache.index.base.Index` over a directory of JSON files."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root) / "index"
        for sub in ("recipes", "artifacts", "manifests", ".locks"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)

    def _path(self, kind: str, key: str) -> Path:
        if not is_hex_key(key):
            raise ValueError(f"{key!r} is not a sha256 key")
        return self.root / kind / key[:2] / f"{key}.json"

    def _read(self, kind: str, key: str) -> Any:
        try:
            return json.loads(self._path(kind, key).read_text())
        except FileNotFoundError:
            return None
        except ValueError:
            return None  # a torn file cannot exist (atomic writes); treat garbage as absent

    def _write(self, kind: str, key: str, value: Any) -> None:
        atomic_write(self._path(kind, key), json.dumps(value, sort_keys=True).encode())

    def lookup(self, recipe_key: str) -> ArtifactMeta | CompileFailure | None:
        """Follow the alias to the artifact metadata, or return the negative entry."""
        entry = self._read("recipes", recipe_key)
        if entry is None:
            return None
        if "failure" in entry:
            return CompileFailure.from_dict(entry["failure"])
        return self.artifact(entry["digest"])

    def artifact(self, digest: str) -> ArtifactMeta | None:
        """Metadata by digest."""
        data = self._read("artifacts", digest)
        return ArtifactMeta.from_dict(data) if data else None

    def manifest(self, base_key: str) -> list[ManifestEntry]:
        """Entries newest first."""
        return [ManifestEntry.from_dict(e) for e in self._read("manifests", base_key) or []]

    def record_artifact(self, recipe_key: str, base_key: str, meta: ArtifactMeta) -> None:
        """Artifact metadata, then the manifest entry, then the alias (the commit point)."""
        if self.artifact(meta.digest) is None:
            self._write("artifacts", meta.digest, meta.to_dict())
        entry = ManifestEntry(meta.digest, meta.dependencies)
        # The lock only keeps concurrent writers from dropping each other's entries;
        # a lost entry would cost a recompile, never a wrong result.
        with filelock.FileLock(str(self.root / ".locks" / f"{base_key}.lock"), timeout=60):
            entries = [e for e in self.manifest(base_key) if e.dependencies != entry.dependencies]
            entries = [entry, *entries][:MANIFEST_LIMIT]
            self._write("manifests", base_key, [e.to_dict() for e in entries])
        self.record_alias(recipe_key, meta.digest)

    def record_alias(self, recipe_key: str, digest: str) -> None:
        """``recipe_key`` -> ``digest``."""
        self._write("recipes", recipe_key, {"digest": digest})

    def record_failure(self, failure: CompileFailure) -> None:
        """A negative entry under the failed recipe's key."""
        self._write("recipes", failure.recipe_key, {"failure": failure.to_dict()})

    def forget(self, recipe_key: str) -> None:
        """Remove the alias or negative entry."""
        self._path("recipes", recipe_key).unlink(missing_ok=True)
