"""Artifact stores: the ``ArtifactStore`` seam and its backends."""

from kcache.store.base import ArtifactStore
from kcache.store.local import LocalArtifactStore

__all__ = ["ArtifactStore", "LocalArtifactStore"]
