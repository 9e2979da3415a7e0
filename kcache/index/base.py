"""The ``Index`` seam: recipe key -> artifact, manifests under base keys, negative entries."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from kcache.artifact import ArtifactMeta, CompileFailure, ManifestEntry

__all__ = ["MANIFEST_LIMIT", "Index"]

#: Manifest entries kept per base key, newest first; older ones fall off.
MANIFEST_LIMIT = 32


@runtime_checkable
class Index(Protocol):
    """Metadata about published artifacts. Every write is atomic; blobs are written first."""

    def lookup(self, recipe_key: str) -> ArtifactMeta | CompileFailure | None:
        """The artifact (or unexpired negative entry) recorded for ``recipe_key``, or None."""
        ...

    def artifact(self, digest: str) -> ArtifactMeta | None:
        """Metadata of the artifact with this digest, or None."""
        ...

    def manifest(self, base_key: str) -> list[ManifestEntry]:
        """Manifest entries under ``base_key``, newest first (at most MANIFEST_LIMIT)."""
        ...

    def record_artifact(self, recipe_key: str, base_key: str, meta: ArtifactMeta) -> None:
        """Record a freshly published artifact: its metadata, the alias and a manifest entry."""
        ...

    def record_alias(self, recipe_key: str, digest: str) -> None:
        """Point ``recipe_key`` at an existing artifact (after a manifest match)."""
        ...

    def record_failure(self, failure: CompileFailure) -> None:
        """Record a negative entry so the same broken recipe is not compiled again.

        It replaces an earlier one for the key; one with ``expires_at`` is no longer
        returned by :meth:`lookup` once that time has passed.
        """
        ...

    def forget(self, recipe_key: str) -> None:
        """Drop the alias or negative entry of ``recipe_key`` (its blob is gone or corrupt)."""
        ...
