"""kcache.lru.LruCache: both bounds, recency order, replacement, and consistency under threads."""

from __future__ import annotations

import threading

import pytest

from kcache.lru import LruCache


def test_the_byte_bound_evicts_the_least_recently_used() -> None:
    cache: LruCache[str, bytes] = LruCache(max_bytes=10, size=len)
    cache.put("a", b"aaaa")
    cache.put("b", b"bbbb")
    assert cache.get("a") == b"aaaa"  # "a" is now the most recent
    cache.put("c", b"cccc")  # 12 bytes: "b", the least recent, goes
    assert cache.get("b") is None
    assert cache.get("a") == b"aaaa" and cache.get("c") == b"cccc"
    assert cache.total_bytes == 8 and len(cache) == 2


def test_the_entry_bound_evicts_the_least_recently_used() -> None:
    cache: LruCache[int, str] = LruCache(max_entries=3)
    for i in range(3):
        cache.put(i, str(i))
    cache.get(0)
    cache.put(3, "3")
    assert [cache.get(i) for i in range(4)] == ["0", None, "2", "3"]
    assert len(cache) == 3 and cache.total_bytes == 0


def test_both_bounds_hold_at_once() -> None:
    cache: LruCache[int, bytes] = LruCache(max_bytes=100, max_entries=2, size=len)
    for i in range(5):
        cache.put(i, b"x")
    assert len(cache) == 2 and [cache.get(3), cache.get(4)] == [b"x", b"x"]
    cache.put(5, b"y" * 100)  # fits the bytes alone: the other two go
    assert len(cache) == 1 and cache.total_bytes == 100


def test_replacing_a_key_counts_its_new_size_only() -> None:
    cache: LruCache[str, bytes] = LruCache(max_bytes=10, size=len)
    cache.put("a", b"12345678")
    cache.put("a", b"12")
    cache.put("b", b"12345678")
    assert cache.get("a") == b"12" and cache.total_bytes == 10


def test_a_value_over_the_byte_bound_is_not_kept_and_replaces_nothing_stale() -> None:
    cache: LruCache[str, bytes] = LruCache(max_bytes=4, size=len)
    cache.put("a", b"old")
    cache.put("b", b"b")
    cache.put("a", b"far too large")
    assert cache.get("a") is None  # never the stale value for a key just replaced
    assert cache.get("b") == b"b" and cache.total_bytes == 1


def test_discard_and_clear() -> None:
    cache: LruCache[str, bytes] = LruCache(max_bytes=100, size=len)
    cache.put("a", b"aa")
    cache.put("b", b"bbb")
    cache.discard("a")
    cache.discard("missing")
    assert cache.get("a") is None and cache.total_bytes == 3
    cache.clear()
    assert len(cache) == 0 and cache.total_bytes == 0 and cache.get("b") is None


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="size function"):
        LruCache(max_bytes=10)
    with pytest.raises(ValueError, match="at least 0"):
        LruCache(max_entries=-1)


def test_threads_leave_it_consistent() -> None:
    cache: LruCache[int, bytes] = LruCache(max_bytes=4096, max_entries=50, size=len)
    start = threading.Barrier(4)

    def work(seed: int) -> None:
        start.wait()
        for i in range(5000):
            key = (i * 7919 + seed) % 200
            if i % 3:
                cache.put(key, b"x" * (key % 64 + 1))
            elif i % 7 == 0:
                cache.discard(key)
            else:
                value = cache.get(key)
                assert value is None or len(value) == key % 64 + 1

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    kept = [cache.get(k) for k in range(200)]
    present = [v for v in kept if v is not None]
    assert len(present) == len(cache) <= 50
    assert sum(map(len, present)) == cache.total_bytes <= 4096
