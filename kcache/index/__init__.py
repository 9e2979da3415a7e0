"""Indexes: the ``Index`` seam and the file backend (the SQL one lives in the server)."""

from kcache.index.base import MANIFEST_LIMIT, Index
from kcache.index.file import FileIndex

__all__ = ["MANIFEST_LIMIT", "FileIndex", "Index"]
