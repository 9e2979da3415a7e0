"""Retention: old events become hourly roll-ups, and every request count in ``/v1/stats`` survives.

Kernel lookups (the hit rate, the compile time saved, the missed kernels) cover the
retention window: a roll-up drops those first made before its cutoff, as it drops the
raw events they were made from.

Runs on SQLite and, where it is running, PostgreSQL (the series bucketing and the
DELETE ... RETURNING differ between them).
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import sqlalchemy as sa
from kcache_server.auditing import StatsQuery, compute_stats, roll_up
from kcache_server.auditing.retention import RetentionWorker
from kcache_server.auditing.writer import AuditLog, AuditRecord

from tests.support import wait_until

NOW = datetime.now(timezone.utc).replace(microsecond=0)
# On the hour, so events at +0 and +10 minutes share an hourly bucket at any time of day.
OLD = (NOW - timedelta(days=3)).replace(minute=0, second=0)
D1, D2 = "1" * 64, "2" * 64
BASE = "b" * 64


def _seed(db: sa.Engine) -> None:
    log = AuditLog(db)
    old_minutes = [OLD + timedelta(minutes=m) for m in (0, 10, 70, 130)]
    for i, at in enumerate(old_minutes):
        log.record(
            AuditRecord(
                "hit",
                "resolve",
                1.0,
                kernel="k1",
                job_id="j-old",
                rank=i % 2,
                digest=D1,
                compile_seconds_saved=0.5,
                at=at,
            )
        )
        log.record(
            AuditRecord(
                "compiled",
                "resolve",
                200.0,
                kernel="k2",
                job_id="j-old",
                rank=0,
                digest=D1,
                base_key=BASE,
                target="sm_80",
                at=at,
            )
        )
    log.record(
        AuditRecord(
            "error",
            "resolve",
            50.0,
            kernel="k3",
            error="compile_timeout",
            job_id="j-old",
            rank=1,
            at=OLD + timedelta(minutes=5),
        )
    )
    # Old divergence (it is lost by the roll-up: digests are not kept).
    log.record(
        AuditRecord(
            "hit",
            "resolve",
            1.0,
            kernel="k2",
            job_id="j-old",
            rank=1,
            digest=D2,
            base_key=BASE,
            target="sm_80",
            at=OLD,
        )
    )
    # Recent events, kept as they are, with a divergence of their own.
    for rank, digest in ((0, D1), (1, D2)):
        log.record(
            AuditRecord(
                "hit",
                "resolve",
                1.0,
                kernel="k2",
                job_id="j-new",
                rank=rank,
                digest=digest,
                base_key=BASE,
                target="sm_80",
                compile_seconds_saved=0.25,
                at=NOW - timedelta(minutes=5),
            )
        )
    log.record(
        AuditRecord(
            "local_hit",
            "events",
            0.1,
            tier="node",
            kernel="k1",
            job_id="j-new",
            rank=0,
            digest=D1,
            at=NOW - timedelta(minutes=1),
        )
    )
    assert log.flush() == 13


def _summary(db: sa.Engine, **kw: object) -> dict:
    out = {}
    for group_by in (None, "job", "kernel", "rank"):
        stats = compute_stats(db, StatsQuery(group_by=group_by, **kw)).model_dump()  # type: ignore[arg-type]
        out[group_by] = {
            "totals": stats["totals"],
            "by_tier": stats["by_tier"],
            # In any order: groups come most kernel lookups first, which the roll-up drops.
            "groups": sorted(
                (
                    (
                        g["key"],
                        g["outcomes"],
                        [(r["rank"], r["outcomes"]) for r in g["ranks"] or []],
                    )
                    for g in stats["groups"]
                ),
                key=repr,
            ),
            "series": sum(p["total"] for p in stats["series"]),
        }
    return out


def test_roll_up_keeps_every_count(engine: sa.Engine) -> None:
    _seed(engine)
    window = {"since": NOW - timedelta(days=7), "until": NOW + timedelta(hours=1)}
    before = _summary(engine, **window)
    assert before[None]["totals"]["hit"] == 7 and before[None]["series"] == 13
    lookups_before = compute_stats(engine, StatsQuery(**window))
    # One process per (job, rank) here: j-old's k1 by ranks 0 and 1, k2 by ranks 0 and 1,
    # k3 by rank 1; j-new's k2 by ranks 0 and 1 (its reported k1 names a digest no artifact
    # has: the client's word alone, no kernel lookup).
    assert lookups_before.kernel_lookups == 7
    assert {m.kernel for m in lookups_before.top_missed} == {"k2", "k3"}
    divergent_before = compute_stats(engine, StatsQuery(**window)).divergence
    assert {d.job_id for d in divergent_before} == {"j-old", "j-new"}

    assert roll_up(engine, NOW - timedelta(days=1)) == 10
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM audit_events")).scalar_one() == 3
        # Per hour and per (outcome, tier, kernel, target, client, job, rank): fewer rows than events.
        assert conn.execute(sa.text("SELECT count(*) FROM audit_rollups")).scalar_one() < 10

    assert _summary(engine, **window) == before
    # Divergence needs single events: only the recent job is still reported.
    assert [d.job_id for d in compute_stats(engine, StatsQuery(**window)).divergence] == ["j-new"]
    # Kernel lookups first made before the cutoff went with their events: the recent
    # job's two are left, and k3, whose misses are all rolled up, is no missed kernel.
    after = compute_stats(engine, StatsQuery(**window))
    assert after.kernel_lookups == 2 and after.totals["error"] == 1
    assert "k3" not in {m.kernel for m in after.top_missed}

    # Rolling up again changes nothing, and the window still filters rolled-up hours.
    assert roll_up(engine, NOW - timedelta(days=1)) == 0
    assert _summary(engine, **window) == before
    recent = compute_stats(engine, StatsQuery(since=NOW - timedelta(hours=1)))
    assert recent.lookups == 3


def test_the_worker_rolls_up_on_its_own(engine: sa.Engine) -> None:
    _seed(engine)
    worker = RetentionWorker(engine, retention_days=1, interval_s=3600)
    worker.start()
    try:
        wait_until(lambda: worker.rolled_up >= 10, "the worker's first roll-up", timeout=20)
    finally:
        worker.close()
    assert worker.rolled_up == 10
