"""Audit events of tier hits: a hit whose event is still queued is counted into it, nothing lost."""

from __future__ import annotations

from pathlib import Path

from client_harness import Proxy, Scripted, Seen, json_response, kernels
from kcache_client import ClientSettings, EventSink, KernelCache
from kcache_client._events import tally_key
from kcache_client._http import Transport

from kcache import Recipe
from tests.support import FAST


def _posted(proxy: Proxy) -> list[dict[str, object]]:
    return [e for s in proxy.seen if s.path == "/v1/events" for e in s.json()["events"]]


def test_repeated_hits_are_one_whole_event_with_their_count(proxy: Proxy, tmp_path: Path) -> None:
    (recipe,) = kernels(1, "tally")
    settings = ClientSettings.from_env(auto_target="sm_80", retry=FAST, job_id="job-tally")
    with KernelCache(proxy.url, cache_dir=tmp_path, settings=settings) as cache:
        art = cache.get(recipe)  # compiled by the server: its own audit row, no event here
        hits = [cache.get(recipe) for _ in range(3)]
        hits.append(cache.get(Recipe(source=recipe.source, target=recipe.target)))  # equal, new
        assert {h.origin for h in hits} == {"memory"}
    posted = _posted(proxy)  # closing the cache delivered them
    assert sum(int(e["count"]) for e in posted) == 4  # type: ignore[call-overload]
    for event in posted:  # tallied or not, every event carries every field
        assert event["outcome"] == "local_hit" and event["tier"] == "memory"
        assert event["recipe_key"] == art.recipe_key and event["digest"] == art.digest
        assert event["kernel"] == art.metadata.kernel and event["target"] == "sm_80"
        assert event["toolchain"] == art.metadata.toolchain
        assert event["job_id"] == "job-tally" and event["client_id"] == cache.client_id
        assert isinstance(event["time"], float) and float(event["latency_ms"]) >= 0  # type: ignore[arg-type]


def test_tally_counts_into_the_queued_event_of_its_key_only() -> None:
    def route(seen: Seen) -> tuple[int, dict[str, str], bytes]:
        return json_response(202, {})

    server = Scripted(route)
    try:
        sink = EventSink(Transport(server.url, retry=FAST), interval_s=60)
        key = tally_key("a" * 64, "b" * 64, "memory", "local_hit")
        assert not sink.tally(key, 1.0, 10.0)  # nothing queued: the caller records the event
        sink.record(
            {
                "outcome": "local_hit",
                "tier": "memory",
                "recipe_key": "a" * 64,
                "digest": "b" * 64,
                "time": 5.0,
                "latency_ms": 3.0,
            }
        )
        assert sink.tally(key, 1.0, 10.0)
        assert not sink.tally(tally_key("a" * 64, "b" * 64, "node", "local_hit"), 1.0, 10.0)
        assert sink.pending() == 2
        (event,) = sink._pending
        assert (event["count"], event["latency_ms"], event["time"]) == (2, 2.0, 10.0)
        sink.close(timeout=10)
        assert not sink.tally(key, 1.0, 11.0)  # closed: counts nothing
        assert sink.sent == 2
    finally:
        server.close()
