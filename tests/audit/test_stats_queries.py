"""``GET /v1/stats`` issues a constant number of SQL statements, however many kernels and jobs.

Each case seeds its own job with ``n`` missed kernels (cycling through every reason a miss
can have: first build, evicted, headers changed, compile error, ``compile=false``, only
rolled-up misses; each event a process of its own, so each is a kernel lookup of its own)
and ``n`` divergent recipes, then counts the statements one
``/v1/stats?group_by=job`` call sends to the real database. A per-kernel or per-recipe
query loop (an N+1) makes the count grow with ``n``. The answers are checked too, on
SQLite and PostgreSQL, so a set-based rewrite cannot trade correctness for the count.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from tests.support import ServerThread, pg_database

NOW = datetime.now(timezone.utc).replace(microsecond=0)
REASONS = (
    "first build of this recipe",
    "served before, then evicted or garbage-collected",
    "header contents changed since an earlier build",
    "compile error",
    "not cached, and the caller did not ask to compile",
    "rolled up",
)


@pytest.fixture(
    scope="module", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerThread]:
    """A real server on a migrated database of each kind, keeping every event raw."""
    from kcache_server import Settings, migrate

    data = tmp_path_factory.mktemp("stats-queries") / "data"
    with pg_database() if request.param == "postgres" else _sqlite(data) as url:
        migrate.upgrade(url)
        settings = Settings(
            data_dir=data, db_url=url, compile_workers=1, audit={"retention_days": 0}
        )
        thread = ServerThread(settings)
        try:
            yield thread
        finally:
            thread.stop()


class _sqlite:
    """The SQLite URL in ``data`` as a context manager, like :func:`pg_database`."""

    def __init__(self, data: Path) -> None:
        data.mkdir(parents=True)
        self.url = f"sqlite:///{data / 'kcache.db'}"

    def __enter__(self) -> str:
        return self.url

    def __exit__(self, *exc: object) -> None:
        return None


def _hex(*parts: object) -> str:
    import hashlib

    return hashlib.sha256(repr(parts).encode()).hexdigest()


def _seed(db: sa.Engine, job: str, n: int) -> None:
    """``n`` missed kernels and ``n`` divergent recipes in ``job`` (events one second apart)."""
    from kcache_server.auditing.counts import write_events
    from kcache_server.models import AuditRollup

    events: list[dict[str, Any]] = []
    rollups: list[dict[str, Any]] = []
    clock = iter(range(10_000))

    def event(outcome: str, kernel: str, **fields: Any) -> None:
        events.append(
            {
                "at": NOW - timedelta(hours=1) + timedelta(seconds=next(clock)),
                "outcome": outcome,
                "tier": "server",
                "route": "resolve",
                "kernel": kernel,
                "job_id": job,
                "target": "sm_80",
                "latency_ms": 1.0,
                "compile_seconds_saved": 0.0,
                "count": 1,
                "pid": next(clock),  # each event its own process: its own kernel lookup
                # executemany wants every row to name the same columns
                **dict.fromkeys(("recipe_key", "base_key", "digest", "error", "rank")),
                "world_size": None,
                **fields,
            }
        )

    for i in range(n):
        kernel, pattern = f"{job}-k{i:03d}", i % len(REASONS)
        key, base = _hex(job, i, "key"), _hex(job, i, "base")
        digest = _hex(job, i, "digest")
        common = {"recipe_key": key, "base_key": base, "rank": 0, "world_size": 2}
        if pattern == 0:
            event("compiled", kernel, digest=digest, **common)
        elif pattern == 1:  # served, then compiled again: it was evicted in between
            event("compiled", kernel, digest=digest, **common)
            event("hit", kernel, digest=digest, **common)
            event("compiled", kernel, digest=digest, **common)
        elif pattern == 2:  # a sibling recipe (other headers) was built before, elsewhere
            sibling = {**common, "recipe_key": _hex(key), "job_id": f"{job}-earlier"}
            event("compiled", kernel, digest=_hex(digest), **sibling)
            event("compiled", kernel, digest=digest, **common)
        elif pattern == 3:
            event("error", kernel, error="compile_error", **common)
        elif pattern == 4:
            event("compiled", kernel, digest=digest, **common)
            event("miss", kernel, **common)
        else:
            rollups.append(
                {
                    "bucket": NOW - timedelta(hours=2),
                    "outcome": "compiled",
                    "tier": "server",
                    "kernel": kernel,
                    "target": "sm_80",
                    "job_id": job,
                    "rank": 0,
                    "count": 1,
                    "latency_ms_sum": 1.0,
                    "compile_seconds_saved": 0.0,
                    "last_at": NOW - timedelta(hours=2),
                    "last_error": None,
                }
            )
        # Divergence: ranks 0 and 1 of the job got different bytes for one recipe.
        for rank in (0, 1):
            event(
                "hit",
                f"{job}-d{i:03d}",
                recipe_key=_hex(job, i, "dkey"),
                base_key=_hex(job, i, "dbase"),
                digest=_hex(job, i, "ddigest", rank),
                rank=rank,
                world_size=2,
            )
    with db.begin() as conn:
        write_events(conn, events)  # the writer's own path: events and their counts
        if rollups:
            conn.execute(sa.insert(AuditRollup.__table__), rollups)


def _counted_stats(server: ServerThread, job: str) -> tuple[int, dict[str, Any]]:
    """How many reads of the audit tables one ``/v1/stats`` for ``job`` sent, and its answer."""
    db: sa.Engine = server.state.backends.db
    statements: list[str] = []
    lock = threading.Lock()

    def count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        # Reads of the audit tables: what could loop per kernel, job or recipe. The
        # server's own timers (the eviction log, token checks) read other tables.
        if statement.lstrip().upper().startswith(("SELECT", "WITH")) and (
            "audit_events" in statement or "audit_rollups" in statement
        ):
            with lock:
                statements.append(statement)

    sa.event.listen(db, "before_cursor_execute", count)
    try:
        with server.client() as http:
            r = http.get(
                "/v1/stats",
                params={"job_id": job, "group_by": "job", "top": "100", "limit": "1000"},
            )
    finally:
        sa.event.remove(db, "before_cursor_execute", count)
    assert r.status_code == 200, r.text
    return len(statements), r.json()


def _check_answer(body: dict[str, Any], job: str, n: int) -> None:
    missed = {m["kernel"]: m for m in body["top_missed"]}
    rolled = sum(1 for i in range(n) if i % len(REASONS) == 5)
    assert len(missed) == n - rolled
    for i in range(n):
        pattern = i % len(REASONS)
        if pattern == 5:  # only the hour's roll-up knows this miss: no kernel lookup is left
            assert f"{job}-k{i:03d}" not in missed
            continue
        item = missed[f"{job}-k{i:03d}"]
        # Missed kernel lookups: pattern 1's hit came after its job compiled the recipe (a
        # miss: built by the job); pattern 2's sibling was built by another job (not this one's).
        expected = {0: 1, 1: 3, 2: 1, 3: 1, 4: 2}[pattern]
        assert item["misses"] == expected, item
        assert item["last_miss_reason"] == REASONS[pattern], item
        assert item["recipe_key"] == _hex(job, i, "key")
        assert item["errors"] == (1 if pattern == 3 else 0)
    divergent = {d["kernel"]: d for d in body["divergence"]}
    assert len(divergent) == n
    for i in range(n):
        row = divergent[f"{job}-d{i:03d}"]
        assert row["ranks"] == {str(r): _hex(job, i, "ddigest", r) for r in (0, 1)}
        assert row["digests"] == sorted(row["ranks"].values())
        assert row["reported"] is False
    (group,) = body["groups"]
    assert group["key"] == job and group["divergent"] is True and group["world_size"] == 2


def test_stats_query_count_does_not_grow_with_kernels_or_divergences(
    server: ServerThread,
) -> None:
    db = server.state.backends.db
    counts = {}
    for n in (6, 60):
        job = f"job-{n}"
        _seed(db, job, n)
        counts[n], body = _counted_stats(server, job)
        _check_answer(body, job, n)
    assert counts[6] == counts[60], counts
    # And few: a statement per piece of the answer, not per row of it.
    assert counts[6] <= 12, counts
