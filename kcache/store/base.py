"""The ``ArtifactStore`` seam: blobs addressed by the sha256 of their bytes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Protocol, runtime_checkable

__all__ = ["ArtifactStore"]


@runtime_checkable
class ArtifactStore(Protocol):
    """Content-addressed bytes. Publishing is atomic and idempotent; reads verify digests."""

    def put(self, data: bytes) -> str:
        """Publish ``data`` and return its sha256 digest; storing the same bytes twice is a no-op."""
        ...

    def get(self, digest: str) -> bytes:
        """The bytes for ``digest``, verified; raises ArtifactNotFoundError or CorruptArtifactError."""
        ...

    def has(self, digest: str) -> bool:
        """True when a blob named ``digest`` is present (not verified)."""
        ...

    def path(self, digest: str) -> Path:
        """Where the blob lives (present or not); for serving files without copying."""
        ...

    def delete(self, digest: str) -> bool:
        """Remove a blob; True if it was there."""
        ...

    def digests(self) -> Iterator[str]:
        """Every published digest (staging files never appear)."""
        ...
