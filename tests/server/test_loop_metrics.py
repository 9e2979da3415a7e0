"""Counts kept without locks by the fast paths (LoopCounter, LoopHistogram) reach /metrics exactly."""

from __future__ import annotations

import re

from kcache_server.metrics import ServerMetrics


def _samples(text: str, name: str) -> dict[str, float]:
    """``series -> value`` of every line of ``name`` (its buckets, sum and count included)."""
    found = {}
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            found[series] = float(value)
    return found


def test_a_loop_histogram_exposes_what_direct_observations_do() -> None:
    direct, deferred = ServerMetrics(), ServerMetrics()
    child = direct.request_seconds.labels(route="/r")
    loop = deferred.loop_histogram(deferred.request_seconds.labels(route="/r"))
    # Every bucket edge exactly, either side of it, past the last bound, and zero.
    values = [0.0, 0.001, 0.0010001, 0.0025, 0.003, 0.05, 0.99, 1.0, 60.0, 61.0, 1e9]
    for rounds in range(3):  # flushed between rounds: each adds only what is new
        for value in values[rounds:]:
            child.observe(value)
            loop.observe(value)
        name = "kcache_http_request_duration_seconds"
        want = _samples(direct.render().decode(), name)
        got = _samples(deferred.render().decode(), name)
        got = {k: v for k, v in got.items() if "_created" not in k}
        want = {k: v for k, v in want.items() if "_created" not in k}
        assert got == want and len(got) > 10


def test_a_loop_counter_adds_what_it_counted_at_each_scrape() -> None:
    metrics = ServerMetrics()
    child = metrics.requests.labels(route="/r", method="GET", status="200")
    counter = metrics.loop_counter(child)
    child.inc(2)  # counted directly elsewhere (the framework's middleware): both add up
    for _ in range(5):
        counter.inc()
    text = metrics.render().decode()
    assert re.search(
        r'kcache_http_requests_total\{method="GET",route="/r",status="200"\} 7\.0', text
    )
    counter.inc()
    text = metrics.render().decode()
    assert re.search(
        r'kcache_http_requests_total\{method="GET",route="/r",status="200"\} 8\.0', text
    )
