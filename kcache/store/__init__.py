"""Artifact stores: the ``ArtifactStore`` seam and its backends.

``LocalArtifactStore`` (a directory), ``S3ArtifactStore`` (an S3-compatible bucket; needs
the ``kcache-core[s3]`` extra when used) and ``CachedArtifactStore`` (a bounded local
directory in front of another store, for server replicas that share no filesystem).
Which backend a store URL names is :data:`STORE_URL_SCHEMES` (:mod:`kcache.store.urls`).
"""

from kcache.store.base import ArtifactStore, BlobInfo, Collected, Leftovers
from kcache.store.cached import CachedArtifactStore
from kcache.store.local import LocalArtifactStore
from kcache.store.s3 import S3ArtifactStore
from kcache.store.urls import STORE_URL_SCHEMES, UrlBackend, check_store_url, open_store_url

__all__ = [
    "STORE_URL_SCHEMES",
    "ArtifactStore",
    "BlobInfo",
    "CachedArtifactStore",
    "Collected",
    "Leftovers",
    "LocalArtifactStore",
    "S3ArtifactStore",
    "UrlBackend",
    "check_store_url",
    "open_store_url",
]
