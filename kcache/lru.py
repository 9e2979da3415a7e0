"""A thread-safe least-recently-used map bounded by total bytes and/or entry count.

The one in-memory LRU of kcache: the server's blob and recipe-metadata caches, the fast
path's encoded headers, the client's in-process artifacts and the other memos that
must not grow with what callers send. Reads are on hot paths (a warm fetch, a client
memory hit), so :meth:`LruCache.get` is one dict lookup and one ``move_to_end`` under
an uncontended lock.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["LruCache"]

K = TypeVar("K")
V = TypeVar("V")


class LruCache(Generic[K, V]):
    """Keeps the most recently used items within ``max_bytes`` (as ``size`` measures them) and ``max_entries``.

    Either bound may be None (unbounded on that axis); ``size`` is required with
    ``max_bytes``. A value larger than ``max_bytes`` by itself is not kept. Values are
    never None (``get`` answers None for a missing key).
    """

    def __init__(
        self,
        *,
        max_bytes: int | None = None,
        max_entries: int | None = None,
        size: Callable[[V], int] | None = None,
    ) -> None:
        if max_bytes is not None and size is None:
            raise ValueError("an LruCache bounded by max_bytes needs a size function")
        if (max_bytes is not None and max_bytes < 0) or (
            max_entries is not None and max_entries < 0
        ):
            raise ValueError("max_bytes and max_entries must be at least 0")
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self._size = size
        # key -> (value, its size): the size is measured once, on the way in.
        self._items: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: K) -> V | None:
        """The value for ``key``, now the most recently used, or None."""
        with self._lock:
            entry = self._items.get(key)
            if entry is None:
                return None
            self._items.move_to_end(key)
        return entry[0]

    def put(self, key: K, value: V) -> None:
        """Insert or replace ``key``, evicting the least recently used items beyond the bounds."""
        size = self._size(value) if self._size is not None else 0
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
            if self.max_bytes is not None and size > self.max_bytes:
                return  # would evict everything else and still not fit
            self._items[key] = (value, size)
            self._bytes += size
            while (self.max_bytes is not None and self._bytes > self.max_bytes) or (
                self.max_entries is not None and len(self._items) > self.max_entries
            ):
                _, (_, evicted) = self._items.popitem(last=False)
                self._bytes -= evicted

    def discard(self, key: K) -> None:
        """Drop ``key`` if present."""
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._bytes -= old[1]

    def clear(self) -> None:
        """Drop everything."""
        with self._lock:
            self._items.clear()
            self._bytes = 0

    def __len__(self) -> int:
        """How many items are kept."""
        return len(self._items)

    @property
    def total_bytes(self) -> int:
        """The sum of the kept items' sizes (0 without a ``size`` function)."""
        return self._bytes
