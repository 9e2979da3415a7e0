"""The sections of ``/v1/stats`` that sum the window: totals, reporters, groups, series, store.

The requests of each (every lookup, repeats included) are one ``GROUP BY`` over the
window's relation (:func:`~kcache_server.auditing.window_source.source`: count rows
where they can answer, raw events elsewhere), plus a job's ranks and world sizes read
by key (``group_by=job``) and the store's size with the window's evictions; a group's,
a rank's and a bucket's kernel lookups (the hit rate) are read beside them from
``audit_lookups`` (:mod:`~kcache_server.auditing.lookup_stats`). The sections that need
single events (the top missed kernels, rank divergence) have modules of their own;
:func:`~kcache_server.auditing.stats.compute_stats` reads them all.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import sqlalchemy as sa

from kcache.outcomes import OUTCOMES, SERVER_OUTCOMES
from kcache_server.auditing.counts import LEVELS, decode
from kcache_server.auditing.lookup_stats import (
    Figures,
    read_lookup_groups,
    read_lookup_ranks,
    read_lookup_series,
)
from kcache_server.auditing.stats_models import (
    GROUP_BY,
    REPORTED_OUTCOMES,
    SERVER_TIER,
    GroupStats,
    RankStats,
    ReportedBy,
    SeriesPoint,
    StatsQuery,
    StoreStats,
    outcome_fields,
)
from kcache_server.auditing.window_source import Present, epoch, extent, filters, keyed, source
from kcache_server.auditing.windows import DAY, epoch_of
from kcache_server.index import SqlIndex
from kcache_server.models import audit_counts_table as _counts_t
from kcache_server.models import evictions_table as _evictions

__all__ = [
    "read_groups",
    "read_reporters",
    "read_series",
    "read_store",
    "read_totals",
    "reported_by_rows",
]

# Chart bucket widths: a handful of round numbers reads better than 37-second steps.
_STEPS_S = (1, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400)


def _step(span_s: float, buckets: int) -> int:
    want = max(span_s / max(buckets, 1), 1.0)
    return next((s for s in _STEPS_S if s >= want), math.ceil(want / 86400) * 86400)


def read_totals(
    conn: sa.Connection, query: StatsQuery
) -> tuple[dict[str, int], dict[str, int], dict[str, dict[str, int]], float, float]:
    """Server-observed totals, client-reported ones, counts by tier, and the two savings."""
    src = source(query, "all")
    rows = conn.execute(
        sa.select(
            src.c.outcome, src.c.tier, sa.func.sum(src.c.n), sa.func.sum(src.c.saved)
        ).group_by(src.c.outcome, src.c.tier)
    ).all()
    totals: dict[str, int] = dict.fromkeys(SERVER_OUTCOMES, 0)
    reported: dict[str, int] = dict.fromkeys(REPORTED_OUTCOMES, 0)
    by_tier: dict[str, dict[str, int]] = {}
    saved = reported_saved = 0.0
    for outcome, tier, n, s in rows:
        if not n:  # nothing of it in the window: a day's row less its hours (source)
            continue
        side = totals if tier == SERVER_TIER else reported
        side[outcome] = side.get(outcome, 0) + int(n)
        by_tier.setdefault(tier, dict.fromkeys(OUTCOMES, 0))
        by_tier[tier][outcome] = by_tier[tier].get(outcome, 0) + int(n)
        if tier == SERVER_TIER:
            saved += float(s or 0.0)
        else:
            reported_saved += float(s or 0.0)
    return totals, reported, by_tier, saved, reported_saved


def read_reporters(conn: sa.Connection, query: StatsQuery) -> list[tuple[str, int, float]]:
    """(reporter, lookups, compile seconds saved) of the window's client reports that name one.

    From the counts' ``reporter`` dimension (raw events where counts cannot answer), which
    holds reported events only; reports from before 0013 name none, and are left for
    the caller to show as unattributed.
    """
    src = source(query, "reporter")
    rows = conn.execute(
        sa.select(src.c.reporter, sa.func.sum(src.c.n), sa.func.sum(src.c.saved))
        .where(src.c.tier != SERVER_TIER, src.c.reporter.is_not(None))
        .group_by(src.c.reporter)
        # 0: nothing of it in the window, a day's row less its hours (source)
        .having(sa.func.sum(src.c.n) != 0)
    ).all()
    return [(str(r), int(n), float(saved or 0.0)) for r, n, saved in rows]


def reported_by_rows(
    named: list[tuple[str, int, float]],
    reported: int,
    saved: dict[str | None, float],
    lookups: int,
    limit: int,
) -> list[ReportedBy]:
    """``named`` most first, with what no reporter is named for (reports before 0013) as ``None``.

    ``saved``: the compile time each reporter's kernel lookups avoided
    (:func:`~kcache_server.auditing.lookup_stats.read_reporter_savings`).
    """
    rows: list[tuple[str | None, int]] = [(r, n) for r, n, _ in named]
    attributed = sum(n for _, n, _ in named)
    if reported > attributed:
        rows.append((None, reported - attributed))
    ranked = sorted(rows, key=lambda r: (-r[1], r[0] is None, r[0] or ""))[:limit]
    return [
        ReportedBy(
            reporter=r,
            lookups=n,
            share=n / lookups if lookups else 0.0,
            compile_seconds_saved=saved.get(r, 0.0),
        )
        for r, n in ranked
    ]


def read_groups(conn: sa.Connection, query: StatsQuery, present: Present) -> list[GroupStats]:
    if query.group_by is None:
        return []
    src = source(query, query.group_by)
    col = src.c[GROUP_BY[query.group_by]]
    rows = conn.execute(
        sa.select(col, src.c.outcome, sa.func.sum(src.c.n), sa.func.sum(src.c.saved))
        .group_by(col, src.c.outcome)
        # 0: nothing of it in the window, a day's row less its hours (source)
        .having(sa.func.sum(src.c.n) != 0)
    ).all()
    outcomes: dict[Any, dict[str, int]] = defaultdict(dict)
    for key, outcome, n, _ in rows:
        outcomes[key][outcome] = int(n)
    figures = read_lookup_groups(conn, query)
    empty = Figures()

    def order(k: Any) -> tuple[int, int, str]:
        return (-figures.get(k, empty).lookups, -sum(outcomes.get(k, {}).values()), str(k))

    keys = sorted(set(outcomes) | set(figures), key=order)[: query.limit]
    groups = [
        GroupStats(key=k, **outcome_fields(outcomes.get(k, {})), **figures.get(k, empty).fields())
        for k in keys
    ]
    if query.group_by == "job":
        _add_ranks(conn, query, groups, present)
    return groups


def _add_ranks(
    conn: sa.Connection, query: StatsQuery, groups: list[GroupStats], present: Present
) -> None:
    jobs = [g.key for g in groups if g.key is not None]
    if not jobs:
        return
    src = source(query, "job_rank", keys=jobs, present=present)
    rows = conn.execute(
        sa.select(src.c.job_id, src.c.rank, src.c.outcome, sa.func.sum(src.c.n))
        .where(src.c.job_id.in_(jobs))
        .group_by(src.c.job_id, src.c.rank, src.c.outcome)
    ).all()
    per: dict[Any, dict[Any, dict[str, int]]] = defaultdict(lambda: defaultdict(dict))
    for job, rank, outcome, n in rows:
        if n:  # 0: nothing of it in the window, a day's row less its hours (source)
            per[job][rank][outcome] = int(n)
    lookups = read_lookup_ranks(conn, query, jobs)
    for job, rank in lookups:
        per[job].setdefault(rank, {})
    empty = Figures()
    c = _counts_t.c
    sizes = dict(
        conn.execute(
            sa.select(decode(c.key), sa.func.max(c.world_size))
            .where(
                c.dim == "job",
                c.level == DAY,
                keyed(c, DAY, (None, None), present.get(("job", DAY)), jobs),
            )
            .group_by(c.key)
        ).all()
    )
    for group in groups:
        if group.key is None:
            continue
        ranks = per.get(group.key, {})
        group.ranks = [
            RankStats(
                rank=r,
                **outcome_fields(ranks[r]),
                **lookups.get((group.key, r), empty).fields(),
            )
            for r in sorted(ranks, key=lambda r: (r is None, r or 0))
        ]
        group.world_size = sizes.get(group.key)


def read_series(conn: sa.Connection, query: StatsQuery) -> tuple[int, list[SeriesPoint]]:
    """The bucket width and the chart's buckets over the window (its events' extent where open)."""
    dialect = conn.dialect.name
    lo: float | None = epoch_of(query.since)
    hi: float | None = epoch_of(query.until)
    if lo is None or hi is None:
        found = extent(conn, query)
        if found is None:
            return 0, []
        lo = found[0] if lo is None else lo
        hi = found[1] + 1 if hi is None else hi
    step = _step(max(hi - lo, 1.0), query.buckets)
    # Count rows of a level that divides the step lie in one bucket each.
    levels = tuple(lv for lv in LEVELS["all"] if step % lv == 0)
    src = source(query, "all", levels, subtract=False)
    seconds = epoch(dialect, src.c.at)
    # Integer floor division in SQL (SQLAlchemy's "/" is true division): rows of one
    # bucket must group together.
    bucket = (
        (sa.cast(seconds, sa.BigInteger) // step).label("b")
        if dialect == "sqlite"
        else sa.func.floor(seconds / step).label("b")
    )
    rows = conn.execute(
        sa.select(bucket, src.c.outcome, sa.func.sum(src.c.n)).group_by(bucket, src.c.outcome)
    ).all()
    per: dict[int, dict[str, int]] = defaultdict(dict)
    for b, outcome, n in rows:
        per[int(b)][outcome] = per[int(b)].get(outcome, 0) + int(n)
    first_b, last_b = int(lo // step), math.ceil(hi / step) - 1
    lookups = read_lookup_series(conn, query, step)
    empty = Figures()
    points = [
        SeriesPoint(
            t=float(b * step), **outcome_fields(per.get(b, {})), **lookups.get(b, empty).fields()
        )
        for b in range(first_b, max(last_b, first_b) + 1)
    ]
    return step, points


def read_store(
    engine: sa.Engine, conn: sa.Connection, query: StatsQuery, cap: int | None
) -> StoreStats:
    usage = SqlIndex(engine).usage()
    evicted, freed = conn.execute(
        sa.select(sa.func.count(), sa.func.coalesce(sa.func.sum(_evictions.c.size), 0)).where(
            *filters(StatsQuery(since=query.since, until=query.until), {}, _evictions.c.at)
        )
    ).one()
    return StoreStats(
        bytes_used=usage.bytes,
        bytes_cap=cap or None,
        artifacts=usage.artifacts,
        pinned_artifacts=usage.pinned_artifacts,
        pinned_bytes=usage.pinned_bytes,
        evictions=int(evicted),
        bytes_freed=int(freed),
    )
