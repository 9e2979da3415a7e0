"""``GET /v1/stats``: aggregates over audit events (and the hourly roll-ups of old ones).

The headline is the one hit rate (:mod:`~kcache_server.auditing.lookups`): the share of
kernel lookups (each process's first lookup of each recipe) that needed no compile
anywhere, in the answer and in every group, rank and series bucket, with the compiles
that avoided and their compile time. It is read from ``audit_lookups``
(:mod:`~kcache_server.auditing.lookup_stats`), decided as each lookup was written, the
figure ``/metrics`` counts. Its parts stay visible: the hits the server answered itself
(``observed_hits``, ``server_hit_rate``) and those clients reported (``reported_hits``,
``reported_compile_seconds_saved``, ``reported_by``: the tokens, each with its requests
and its share). A client report is one kernel lookup at most per process and recipe,
and only for a digest the index knows. Requests (every lookup, repeats included) are
the rest of the answer: ``lookups``, ``totals`` (the server's), ``reported`` (the
clients'), ``by_tier`` and each group's ``total`` and ``outcomes``. Rank divergence is a
row built from the server's events alone, or a row of its own marked ``reported`` that
names the tokens whose reports make it. Foreign lookups (``GET /v1/foreign/...``, kernel
lookups too) are also shown by library (``foreign_by_library``).

Requests come from the counts below; kernel lookups from their own table, one range
scan of its time index per section.

Counts come from ``audit_counts`` (:mod:`~kcache_server.auditing.counts`), kept by
every audit write per minute, hour and day and per dimension, so an unfiltered query
costs what the buckets of its window cost, not what its events do. Raw events (and
roll-ups, weighted by their ``count``) are read only where counts cannot answer
exactly, in one ``UNION ALL`` with the count rows: the partial hours at the edges of
a window (a window from 10:20 reads 10:20-11:00 raw, the full hours and days after it
from counts; or, where that reads fewer events, the 10:00 row less 10:00-10:20 raw,
and totals and the series the whole minutes from minute rows: see
:func:`~kcache_server.auditing.windows.plan`), a
series step under a minute, and queries filtered by job, client, kernel or target (the
counts have one dimension at a time). Whole hours of a partly
covered UTC day are that day's row less its hours outside the window where that reads
fewer rows (counts add up, so the sums stay exact; the last 24 h then read two or three
rows per key of today instead of one per hour); never for the series, whose buckets
must each hold only their own rows. What needs single
events reads raw events through index probes only: the last miss of each top kernel
(one backward probe per kernel on ``(kernel, at, id)``, and its reason on
``(base_key, target, recipe_key, id)``) and rank divergence (the recipes
``audit_divergences`` lists, confirmed digest by digest and rank by rank with
``LIMIT 1`` probes). Raw edges are one ``SELECT`` each, joined by ``UNION ALL``, so
each is a range scan of the time index. Each piece of the
answer is a fixed number of statements, never a query per kernel, job or recipe:
one ``/v1/stats`` sends the same number of statements at any size
(tests/audit/test_stats_queries.py counts them).

One figure differs from a scan of the raw events by design: a job's ``world_size``
is the largest in its counts, which keep events that retention rolled up.

This module reads one answer (:func:`compute_stats`); its parts live beside it:

- :mod:`~kcache_server.auditing.stats_models`: the query and the answer's models;
- :mod:`~kcache_server.auditing.windows`: a window as count spans and raw pieces;
- :mod:`~kcache_server.auditing.window_source`: that plan as one SQL relation;
- :mod:`~kcache_server.auditing.aggregates`: totals, reporters, groups, series, store;
- :mod:`~kcache_server.auditing.top_missed`: the top missed kernels and their last miss;
- :mod:`~kcache_server.auditing.divergence`: rank divergence.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

import sqlalchemy as sa

from kcache_server.auditing.aggregates import (
    read_groups,
    read_reporters,
    read_series,
    read_store,
    read_totals,
    reported_by_rows,
)
from kcache_server.auditing.divergence import read_divergence
from kcache_server.auditing.lookup_stats import (
    read_foreign_by_library,
    read_lookup_totals,
    read_reporter_savings,
)
from kcache_server.auditing.stats_models import ForeignLibrary, MissReason, Stats, StatsQuery
from kcache_server.auditing.top_missed import read_top_missed
from kcache_server.auditing.window_source import present_buckets
from kcache_server.auditing.windows import epoch_of

__all__ = ["compute_stats"]

_T = TypeVar("_T")


def _settle_in(conn: sa.Connection) -> None:
    """On PostgreSQL, settings for this read's transaction: aggregates over many count rows.

    No JIT: stats' aggregates are planned above PostgreSQL's JIT cost threshold yet run
    for a fraction of a second, and compiling each cost about 70 ms of it (EXPLAIN
    ANALYZE at 10M events, B10). 64 MB of ``work_mem`` keeps the hash or sort of a
    few hundred thousand count rows in memory instead of spilling to disk at 4 MB.
    Both last until the transaction ends (``set_config(..., true)``).
    """
    if conn.dialect.name == "postgresql":
        conn.exec_driver_sql(
            "SELECT set_config('jit', 'off', true), set_config('work_mem', '64MB', true)"
        )


#: Threads that read pieces of an answer beside the caller's own (see compute_stats).
_LANES = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kcache-stats")


def _beside(engine: sa.Engine, read: Callable[[sa.Connection], _T]) -> Future[_T]:
    """``read`` on a connection of its own, in a lane thread."""

    def run() -> _T:
        with engine.connect() as conn:
            _settle_in(conn)
            return read(conn)

    return _LANES.submit(run)


def compute_stats(engine: sa.Engine, query: StatsQuery, store_cap: int | None = None) -> Stats:
    """Everything ``GET /v1/stats`` answers, read in one snapshot-ish pass.

    The groups and the top missed kernels are read beside the rest, each on a
    connection of its own: the pieces are independent reads, so SQLite (which lets
    threads run while it reads) and PostgreSQL (a backend per connection) use more
    than one core for one answer. Each statement reads its own snapshot, as before.
    ``store_cap`` is the server's ``max_store_bytes`` (None: unbounded), reported with
    the store's size.
    """
    with engine.connect() as conn:
        _settle_in(conn)
        present = present_buckets(conn)
        groups_read = _beside(engine, lambda lane: read_groups(lane, query, present))
        top_read = _beside(engine, lambda lane: read_top_missed(lane, query))
        totals, reported, by_tier, _, _ = read_totals(conn, query)
        figures = read_lookup_totals(conn, query)
        foreign = read_foreign_by_library(conn, query)
        reporters = read_reporters(conn, query) if sum(reported.values()) else []
        savings = read_reporter_savings(conn, query) if reporters else {}
        divergence = read_divergence(conn, query, present)
        step, series = read_series(conn, query)
        store = read_store(engine, conn, query, store_cap)
        groups, top_missed = groups_read.result(), top_read.result()
    if query.group_by == "job":
        divergent_jobs = {d.job_id for d in divergence if not d.reported}
        for group in groups:
            group.divergent = group.key is not None and group.key in divergent_jobs
    requests = sum(totals.values()) + sum(reported.values())
    return Stats(
        since=epoch_of(query.since),
        until=epoch_of(query.until),
        hit_rate=figures.hit_rate,
        kernel_lookups=figures.lookups,
        kernel_hits=figures.hits,
        kernel_misses=figures.misses,
        observed_hits=figures.observed_hits,
        reported_hits=figures.reported_hits,
        server_hit_rate=figures.observed_hits / figures.observed if figures.observed else None,
        compiles_avoided=figures.avoided,
        compile_seconds_saved=figures.saved,
        reported_compile_seconds_saved=figures.reported_saved,
        miss_reasons=[MissReason(**r) for r in figures.miss_reasons()],
        lookups=requests,
        totals=totals,
        reported=reported,
        reported_by=reported_by_rows(
            reporters, sum(reported.values()), savings, requests, query.limit
        ),
        by_tier=by_tier,
        group_by=query.group_by,
        groups=groups,
        top_missed=top_missed,
        divergence=divergence,
        bucket_seconds=step,
        series=series,
        store=store,
        foreign_by_library=[
            ForeignLibrary(
                library=library,
                lookups=f.lookups,
                hits=f.hits,
                misses=f.misses,
                hit_rate=f.hit_rate,
            )
            for library, f in foreign.items()
        ],
    )
