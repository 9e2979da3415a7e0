"""A small thread-safe LRU bounded by total size, for hot blobs and hot recipe keys."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class Lru(Generic[K, V]):
    """Keeps the most recently used items while their total ``size`` stays under ``capacity``."""

    def __init__(self, capacity: int, size: Callable[[V], int] = lambda _: 1) -> None:
        self.capacity = capacity
        self._size = size
        self._items: OrderedDict[K, V] = OrderedDict()
        self._total = 0
        self._lock = threading.Lock()

    def get(self, key: K) -> V | None:
        """The value, marked as recently used, or None."""
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def put(self, key: K, value: V) -> None:
        """Insert, evicting the least recently used items as needed (items over capacity are skipped)."""
        size = self._size(value)
        if size > self.capacity:
            return
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._total -= self._size(old)
            self._items[key] = value
            self._total += size
            while self._total > self.capacity:
                _, evicted = self._items.popitem(last=False)
                self._total -= self._size(evicted)

    def discard(self, key: K) -> None:
        """Drop ``key`` if present."""
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._total -= self._size(old)
