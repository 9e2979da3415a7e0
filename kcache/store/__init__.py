"""Artifact stores: the ``ArtifactStore`` seam and its backends.

``LocalArtifactStore`` (a directory), ``S3ArtifactStore`` (an S3-compatible bucket; needs
the ``kcache-core[s3]`` extra when used) and ``CachedArtifactStore`` (a bounded local
directory in front of another store, for server replicas that share no filesystem).
"""

from kcache.store.base import ArtifactStore
from kcache.store.cached import CachedArtifactStore
from kcache.store.local import LocalArtifactStore
from kcache.store.s3 import S3ArtifactStore

__all__ = ["ArtifactStore", "CachedArtifactStore", "LocalArtifactStore", "S3ArtifactStore"]
