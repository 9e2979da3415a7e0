"""The one LRU policy (kcache.eviction.least_recently_used): the tier, a replica's local
copies and the server's SQL index all choose through it, the SQL only fetching candidates
(tests/server/test_sql_index.py)."""

from __future__ import annotations

from collections.abc import Iterator

from kcache.eviction import LruCandidate, least_recently_used


def test_the_oldest_go_first_until_enough_is_freed() -> None:
    candidates = [
        LruCandidate("c", 10, 3.0),
        LruCandidate("a", 10, 1.0),
        LruCandidate("b2", 10, 2.0),
        LruCandidate("b1", 10, 2.0),  # same stamp: by name
    ]
    assert [c.name for c in least_recently_used(candidates, 25)] == ["a", "b1", "b2"]
    assert [c.name for c in least_recently_used(candidates, 0)] == []
    assert len(list(least_recently_used(candidates, 10**9))) == 4  # all there is


def test_candidates_in_order_are_read_no_further_than_the_choice() -> None:
    """A query's rows in the policy's order: the stream stops where the choice does."""
    pulled: list[int] = []

    def rows() -> Iterator[LruCandidate]:
        for i in range(1_000_000):
            pulled.append(i)
            yield LruCandidate(f"{i:07d}", 100, float(i))

    chosen = list(least_recently_used(rows(), 1_000, in_order=True))
    assert [c.name for c in chosen] == [f"{i:07d}" for i in range(10)]
    assert len(pulled) <= 11
