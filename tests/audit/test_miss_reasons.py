"""The last miss's reason for a caller that joined another request's compile (issue 31).

A client sends a resolve that compiles, and is interrupted (Ctrl-C, a killed job)
while the server compiles; the compile goes on and is recorded as ``compiled`` when it
ends. The client's rerun asks for the same recipe meanwhile, joins that compile, and
is recorded as ``waited``. The compile it joined ended after the waiter started
waiting, so it is no history of the recipe: the waited miss was explained as "served
before, then evicted or garbage-collected" because the joined compile's own row came
first. Its reason is now the compile it joined and why that compile was needed,
read from what happened before the waiter started.
"""

from __future__ import annotations

import itertools
from datetime import datetime, timedelta, timezone
from typing import Any

import sqlalchemy as sa
from kcache_server.auditing.counts import write_events
from kcache_server.auditing.stats import compute_stats
from kcache_server.auditing.stats_models import StatsQuery

NOW = datetime.now(timezone.utc).replace(microsecond=0)
JOINED = "joined a compile another request had started"
#: Each row a process of its own (as the story's client and its rerun are): its own kernel lookup.
_PIDS = itertools.count(1000)


def _row(
    kernel: str, outcome: str, at: datetime, latency_ms: float, **fields: Any
) -> dict[str, Any]:
    return {
        "at": at,
        "outcome": outcome,
        "tier": "server",
        "route": "resolve",
        "recipe_key": fields.pop("recipe_key", kernel[-1] * 64),
        "base_key": f"b{kernel[-1]}" * 32,  # a recipe of its own per kernel
        "digest": "d" * 64,
        "kernel": kernel,
        "target": "sm_80",
        "job_id": "job",
        "rank": 0,
        "pid": next(_PIDS),
        "latency_ms": latency_ms,
        "compile_seconds_saved": 0.0,
        "count": 1,
        **fields,
    }


def _reasons(engine: sa.Engine) -> dict[str, str | None]:
    stats = compute_stats(engine, StatsQuery(top=50))
    return {m.kernel or "": m.last_miss_reason for m in stats.top_missed}


def test_a_caller_that_joined_an_interrupted_clients_compile_says_so(engine: sa.Engine) -> None:
    start = NOW - timedelta(minutes=10)
    rows = [
        # k1: the interrupted client's compile ran 3 s and was recorded when it ended; its
        # rerun arrived 1 s in and waited 2.1 s for it. Nothing was built before.
        _row("k1", "compiled", start + timedelta(seconds=3), 3000.0),
        _row("k1", "waited", start + timedelta(seconds=3.1), 2100.0),
        # k2: served an hour earlier, evicted since, then compiled and joined as for k1.
        _row("k2", "hit", start - timedelta(hours=1), 1.0),
        _row("k2", "compiled", start + timedelta(seconds=3), 3000.0),
        _row("k2", "waited", start + timedelta(seconds=3.1), 2100.0),
        # k3: the waiter's row was written first (the writer's race): the same answer.
        _row("k3", "waited", start + timedelta(seconds=3.1), 2100.0),
        _row("k3", "compiled", start + timedelta(seconds=3), 3000.0),
        # k4: only another header set of the recipe was built before.
        _row("k4", "compiled", start - timedelta(hours=1), 900.0, recipe_key="e" * 64),
        _row("k4", "compiled", start + timedelta(seconds=3), 3000.0),
        _row("k4", "waited", start + timedelta(seconds=3.1), 2100.0),
    ]
    with engine.begin() as conn:
        write_events(conn, rows)
    reasons = _reasons(engine)
    assert reasons["k1"] == f"{JOINED}: first build of this recipe"
    assert reasons["k2"] == f"{JOINED}: served before, then evicted or garbage-collected"
    assert reasons["k3"] == f"{JOINED}: first build of this recipe"
    assert reasons["k4"] == f"{JOINED}: header contents changed since an earlier build"


def test_a_compile_after_an_eviction_keeps_its_reason(engine: sa.Engine) -> None:
    """The reasons of compiles themselves are as before."""
    start = NOW - timedelta(minutes=10)
    rows = [
        _row("k5", "compiled", start, 500.0),
        _row("k6", "hit", start - timedelta(hours=1), 1.0),
        _row("k6", "compiled", start, 500.0),
    ]
    with engine.begin() as conn:
        write_events(conn, rows)
    reasons = _reasons(engine)
    assert reasons["k5"] == "first build of this recipe"
    assert reasons["k6"] == "served before, then evicted or garbage-collected"
