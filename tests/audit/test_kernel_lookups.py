"""Kernel lookups as the writer records them (:mod:`kcache_server.auditing.lookups`), on SQLite and PostgreSQL.

Events go in through :func:`~kcache_server.auditing.counts.write_events`, the path the
audit writer and ``POST /v1/events`` take; what ``audit_lookups`` holds afterwards, and
what ``/v1/stats`` makes of it, is checked against the definition: one kernel lookup per
process and recipe, a hit only when nothing was compiled for it anywhere in its job, a
compile avoided at most once per process and kernel, a reason for every miss.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import itertools
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import sqlalchemy as sa
from kcache_server import migrate
from kcache_server.auditing.counts import write_events
from kcache_server.auditing.stats import compute_stats
from kcache_server.auditing.stats_models import StatsQuery
from kcache_server.db import open_database
from kcache_server.models import Artifact, AuditJobBuild, AuditLookup

NOW = datetime.now(timezone.utc).replace(microsecond=0) - timedelta(minutes=30)
_clock = itertools.count()
KEY = {name: f"{i:x}" * 64 for i, name in enumerate(("k1", "k2", "k3", "h1", "h2"), start=1)}
BASE_H = "c" * 64  # the h kernels: one base key, two header texts
DIGEST = "d" * 64
CS = 2.5  # the artifact's compile seconds


def _event(outcome: str, name: str, *, pid: int | None = 1, **fields: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "at": NOW + timedelta(seconds=next(_clock)),
        "outcome": outcome,
        "tier": "server",
        "route": "resolve",
        "recipe_key": KEY[name],
        "base_key": BASE_H if name.startswith("h") else hashlib.sha256(name.encode()).hexdigest(),
        "digest": DIGEST if outcome in ("hit", "local_hit", "compiled", "waited") else None,
        "kernel": name,
        "target": "sm_80",
        "toolchain": None,
        "error": None,
        "client_id": None,
        "host": "n1" if pid is not None else None,
        "pid": pid,
        "job_id": "job" if pid is not None else None,
        "rank": 0 if pid is not None else None,
        "world_size": None,
        "latency_ms": 1.0,
        "compile_seconds_saved": CS if outcome in ("hit", "local_hit") else 0.0,
        "count": 1,
        "reporter": None,
        "miss_reason": None,
    }
    row.update(fields)
    return row


def _write(engine: sa.Engine, *rows: dict[str, Any]) -> list[dict[str, Any]]:
    with engine.begin() as conn:
        return write_events(conn, list(rows))


def _lookups(engine: sa.Engine) -> list[dict[str, Any]]:
    c = AuditLookup.__table__.c  # type: ignore[attr-defined]
    with engine.connect() as conn:
        rows = conn.execute(sa.select(AuditLookup.__table__).order_by(c.at, c.id)).all()
    return [dict(r._mapping) for r in rows]


@pytest.fixture
def known(engine: sa.Engine) -> sa.Engine:
    """The database, its index holding the artifact of ``DIGEST``."""
    with engine.begin() as conn:
        conn.execute(
            sa.insert(Artifact.__table__).values(
                digest=DIGEST,
                kind="cubin",
                size=10,
                target="sm_80",
                toolchain="t",
                kernel="k1",
                lowered_names={},
                compile_seconds=CS,
                dependencies=[],
                dependencies_exact=True,
                created_at=NOW,
                last_used_at=NOW,
            )
        )
    return engine


def test_one_lookup_per_process_and_recipe(known: sa.Engine) -> None:
    """Repeats, memory re-reads and late notes start none; a process's count is one lookup."""
    new = _write(
        known,
        _event("hit", "k1"),
        _event("hit", "k1", count=40, compile_seconds_saved=40 * CS),  # tallied repeats
        _event("local_hit", "k1", tier="memory", count=1000, compile_seconds_saved=1000 * CS),
        _event("late", "k2", tier="node", digest=None, compile_seconds_saved=0.0),
        _event("local_hit", "k2", pid=2, tier="node", count=7, compile_seconds_saved=7 * CS),
    )
    assert [(r["kernel"], r["outcome"], r["count"], r["saved"]) for r in new] == [
        ("k1", "hit", 1, CS),
        ("k2", "local_hit", 1, CS),  # one process's 7 node hits: one compile avoided
    ]
    assert _write(known, _event("hit", "k1", count=3)) == []  # the same process again: nothing
    stats = compute_stats(known, StatsQuery())
    assert (stats.kernel_lookups, stats.kernel_hits, stats.compiles_avoided) == (2, 2, 2)
    assert stats.compile_seconds_saved == pytest.approx(2 * CS)
    assert stats.lookups == 1 + 40 + 1000 + 1 + 7 + 3  # requests, every one


def test_a_lookup_that_names_no_process_counts_each_time(known: sa.Engine) -> None:
    """A fetch by key from an old client, a line of nginx's edge log: no process to dedupe by."""
    anonymous = {"route": "fetch", "count": 5, "compile_seconds_saved": 5 * CS}
    _write(known, _event("hit", "k1", pid=None, **anonymous), _event("hit", "k1", pid=None))
    (first, second) = _lookups(known)
    assert (first["process"], first["count"], first["saved"]) == (None, 5, 5 * CS)
    assert (second["count"], second["saved"]) == (1, CS)
    assert compute_stats(known, StatsQuery()).kernel_lookups == 6


def test_a_hit_on_what_the_job_compiled_needed_that_compile(known: sa.Engine) -> None:
    """Rank 0 compiles, rank 1 reads it from the node tier: rank 1 needed the compile (a miss)
    but avoided compiling itself; another job's later hit needed no compile of its own."""
    before = _event("hit", "k1", pid=9)  # found before the job compiled anything: a hit
    _write(known, before)
    _write(
        known,
        _event("compiled", "k2", pid=10),
        _event("local_hit", "k2", pid=11, tier="node", rank=1),
        _event("hit", "k2", pid=12, job_id="other-job"),
        _event("waited", "k3", pid=13),
        _event("hit", "k3", pid=14),
    )
    rows = {(r["kernel"], r["job_id"], r["outcome"]): r for r in _lookups(known)}
    assert rows[("k1", "job", "hit")]["hit"] is True
    assert rows[("k2", "job", "compiled")]["reason"] == "first_build"
    built = rows[("k2", "job", "local_hit")]
    assert (built["hit"], built["reason"], built["saved"]) == (False, "built_by_job", CS)
    assert rows[("k2", "other-job", "hit")]["hit"] is True  # another job: found it built
    assert rows[("k3", "job", "waited")]["reason"] == "joined_compile"
    assert rows[("k3", "job", "hit")]["reason"] == "built_by_job"  # a joined compile counts
    with known.connect() as conn:
        builds = conn.execute(sa.select(AuditJobBuild.__table__.c.identity)).scalars().all()
    assert sorted(builds) == sorted([KEY["k2"], KEY["k3"]])
    job = compute_stats(known, StatsQuery(job_id="job"))
    assert (job.kernel_lookups, job.kernel_hits, job.compiles_avoided) == (5, 1, 3)


def test_a_report_of_bytes_the_index_never_stored_is_no_lookup(known: sa.Engine) -> None:
    reported = {"tier": "node", "reporter": "token:t", "route": "events"}
    _write(
        known,
        _event("local_hit", "k1", pid=20, digest="e" * 64, compile_seconds_saved=0.0, **reported),
        _event("local_hit", "k2", pid=21, **reported),
    )
    assert [r["kernel"] for r in _lookups(known)] == ["k2"]
    stats = compute_stats(known, StatsQuery())
    assert (stats.reported_hits, stats.reported_compile_seconds_saved) == (1, CS)
    (by,) = stats.reported_by
    assert by.reporter == "token:t" and by.compile_seconds_saved == CS


def test_every_miss_has_its_reason(known: sa.Engine) -> None:
    _write(known, _event("compiled", "k1", pid=30), _event("compiled", "h1", pid=30))
    _write(
        known,
        _event("compiled", "k1", pid=31, job_id="rerun"),  # served before: evicted since
        _event("compiled", "h2", pid=31, job_id="rerun"),  # a sibling recipe built before
        _event("miss", "k2", pid=31, job_id="rerun", error="not_found"),
        _event("miss", "k3", pid=31, job_id="rerun", error="set_aside"),
        _event("error", "k3", pid=32, job_id="rerun", error="compile_timeout"),
        _event("bypass", "k2", pid=33, tier="library", recipe_key=None, base_key=None, error="ptx"),
    )
    reasons = {r["reason"]: r["kernel_lookups"] for r in _reasons(known)}
    assert reasons == {
        "first_build": 2,
        "evicted": 1,
        "headers_changed": 1,
        "not_cached": 1,
        "miss:set_aside": 1,
        "error:compile_timeout": 1,
        "bypass:ptx": 1,
    }
    texts = {r["reason"]: r["text"] for r in _reasons(known)}
    assert texts["error:compile_timeout"] == "compile timed out"
    assert texts["bypass:ptx"] == "compiled by the library outside kcache (ptx)"


def _reasons(engine: sa.Engine) -> list[dict[str, Any]]:
    return [r.model_dump() for r in compute_stats(engine, StatsQuery()).miss_reasons]


def test_two_writers_record_a_lookup_once(known: sa.Engine) -> None:
    """Two replicas writing the same process's first lookup: the unique index keeps one."""
    row = _event("hit", "k1", pid=40)
    assert len(_write(known, row)) == 1
    assert _write(known, dict(row)) == []
    assert len(_lookups(known)) == 1


def _frozen_backfill() -> Any:
    """Migration 0016's own copy of the writer's decisions (migrations never import live code)."""
    path = migrate.migrations_dir() / "versions" / "0016_kernel_lookups.py"
    spec = importlib.util.spec_from_file_location("kcache_migration_0016", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module._backfill


def test_no_migration_imports_live_code() -> None:
    """A revision does what it did when written: it carries frozen copies, never imports kcache."""
    for path in sorted((migrate.migrations_dir() / "versions").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                assert not any(n.split(".")[0].startswith("kcache") for n in names), path.name


def test_the_backfill_records_what_the_writer_did(known: sa.Engine) -> None:
    """0016's upgrade: the same decisions as the writer's, from the raw events already written."""
    backfill = _frozen_backfill()
    _write(
        known,
        _event("compiled", "k1", pid=50),
        _event("local_hit", "k1", pid=51, tier="node"),
        _event("hit", "k2", pid=52, count=3, compile_seconds_saved=3 * CS),
        _event("error", "k3", pid=52, error="compile_error"),
        _event("hit", "k2", pid=None),
    )
    written = [{k: v for k, v in r.items() if k != "id"} for r in _lookups(known)]
    with known.begin() as conn:
        conn.execute(sa.delete(AuditLookup.__table__))
        conn.execute(sa.delete(AuditJobBuild.__table__))
        assert backfill(conn, chunk=2) == 5
    assert [{k: v for k, v in r.items() if k != "id"} for r in _lookups(known)] == written


def test_an_upgrade_from_0015_records_the_lookups_already_there(url: str) -> None:
    migrate.upgrade(url, "0015")
    db = open_database(url)
    try:
        with db.begin() as conn:
            events = sa.Table("audit_events", sa.MetaData(), autoload_with=conn)
            conn.execute(
                sa.insert(events),
                [
                    {k: v for k, v in _event(o, n, pid=p).items() if k in events.c}
                    for o, n, p in (("compiled", "k1", 60), ("hit", "k1", 61), ("hit", "k1", 61))
                ],
            )
    finally:
        db.dispose()
    migrate.upgrade(url)
    db = open_database(url)
    try:
        stats = compute_stats(db, StatsQuery())
        # pid 60 compiled k1; pid 61 read it twice after its job compiled it: one miss.
        assert (stats.kernel_lookups, stats.kernel_hits) == (2, 0)
        assert {r.reason: r.kernel_lookups for r in stats.miss_reasons} == {
            "first_build": 1,
            "built_by_job": 1,
        }
    finally:
        db.dispose()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def url(request: pytest.FixtureRequest, tmp_path: Any) -> str:
    """An empty database of each kind, not yet migrated."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'upgrade.db'}"
    pg: str = request.getfixturevalue("pg_url")
    return pg
