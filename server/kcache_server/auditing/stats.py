"""``GET /v1/stats``: aggregates over audit events (and the hourly roll-ups of old ones).

What the server observed itself (tier ``server``) and what clients reported through
``POST /v1/events`` (tiers ``memory`` and ``node``) are kept apart, so that no token can
move the fleet's headline: ``hit_rate`` (the answer's, and every group's, rank's and
series bucket's), ``totals`` and ``compile_seconds_saved`` are the server's own
figures; ``reported``, ``reported_compile_seconds_saved`` and ``reported_by`` (the
reporting tokens, each with its lookups and its share of all of them) the clients'
word, beside them; ``combined_hit_rate``, ``lookups`` and ``hits`` add both. Clients
report only ``local_hit``, which the server never records, so a group's outcomes tell
the two apart. Rank divergence is a row built from the server's events alone, or a
row of its own marked ``reported`` that names the tokens whose reports make it.

Counts come from ``audit_counts`` (:mod:`~kcache_server.auditing.counts`), kept by
every audit write per minute, hour and day and per dimension, so an unfiltered query
costs what the buckets of its window cost, not what its events do. Raw events (and
roll-ups, weighted by their ``count``) are read only where counts cannot answer
exactly, in one ``UNION ALL`` with the count rows: the partial hours at the edges of
a window (a window from 10:20 reads 10:20-11:00 raw, the full hours and days after it
from counts; or, where that reads fewer events, the 10:00 row less 10:00-10:20 raw,
and totals and the series the whole minutes from minute rows: see :func:`_edge`), a
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
"""

from __future__ import annotations

import itertools
import math
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Literal, NamedTuple, TypeVar, cast

import sqlalchemy as sa
from pydantic import BaseModel, Field

from kcache.outcomes import CLIENT_OUTCOMES, HIT_OUTCOMES, MISS_OUTCOMES, OUTCOMES, SERVER_OUTCOMES
from kcache_server.auditing.counts import DIMENSIONS, LEVELS, decode, encode
from kcache_server.auditing.events import CLIENT_TIERS
from kcache_server.auditing.query_times import (
    SPAN_PATTERN,
    UNIX_TIME_PATTERN,
    YEAR_PATTERN,
    parse_time,
)
from kcache_server.index import SqlIndex
from kcache_server.models import (
    AuditCount,
    AuditDigest,
    AuditDivergence,
    AuditEvent,
    AuditRollup,
    Eviction,
)

__all__ = [
    "GROUP_BY",
    "HIT_OUTCOMES",
    "MISS_OUTCOMES",
    "OUTCOMES",
    "REPORTED_OUTCOMES",
    "SERVER_OUTCOMES",
    "SERVER_TIER",
    "SPAN_PATTERN",
    "UNIX_TIME_PATTERN",
    "YEAR_PATTERN",
    "Divergence",
    "GroupStats",
    "MissedKernel",
    "ReportedBy",
    "SeriesPoint",
    "Stats",
    "StatsQuery",
    "StoreStats",
    "compute_stats",
    "parse_time",
]

# OUTCOMES, SERVER_OUTCOMES (tier ``server``), HIT_OUTCOMES and MISS_OUTCOMES come from
# kcache.outcomes, the one list, and are re-exported here for the stats' readers.
#: Outcomes only clients report (``POST /v1/events``).
REPORTED_OUTCOMES = CLIENT_OUTCOMES
#: The tier of the server's own events; every other tier is client-reported.
SERVER_TIER = "server"

GroupBy = Literal["kernel", "target", "client", "job", "rank"]
#: ``group_by`` value -> column of ``audit_events``.
GROUP_BY: dict[str, str] = {
    "kernel": "kernel",
    "target": "target",
    "client": "client_id",
    "job": "job_id",
    "rank": "rank",
}

_T = TypeVar("_T")
_events = cast(sa.Table, AuditEvent.__table__)
_rollups = cast(sa.Table, AuditRollup.__table__)
_counts_t = cast(sa.Table, AuditCount.__table__)
_digests = cast(sa.Table, AuditDigest.__table__)
_divergences = cast(sa.Table, AuditDivergence.__table__)
_evictions = cast(sa.Table, Eviction.__table__)
# Chart bucket widths: a handful of round numbers reads better than 37-second steps.
_STEPS_S = (1, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400)
_ERROR_REASONS = {
    "compile_error": "compile error",
    "compile_timeout": "compile timed out",
    "compiler_crashed": "compiler crashed",
    "overloaded": "server overloaded",
    "lock_timeout": "timed out waiting for another compile",
    "invalid_recipe": "invalid recipe",
    "store_full": "artifact store full",
    "quota_exceeded": "token's storage quota reached",
}


@dataclass(frozen=True)
class StatsQuery:
    """What ``/v1/stats`` is asked for."""

    since: datetime | None = None
    until: datetime | None = None
    job_id: str | None = None
    client_id: str | None = None
    kernel: str | None = None
    target: str | None = None
    group_by: GroupBy | None = None
    top: int = 10
    limit: int = 200
    buckets: int = 60


class OutcomeCounts(BaseModel):
    """Counts of one group (or bucket) by outcome, with its hit rate."""

    total: int = Field(default=0, description="lookups: server-observed plus client-reported")
    hits: int = Field(default=0, description="hit + local_hit")
    misses: int = 0
    reported: int = Field(default=0, description="client-reported lookups (local_hit)")
    hit_rate: float | None = Field(
        default=None,
        description="hit / server-observed lookups (no client-reported figure in it); null "
        "with none",
    )
    combined_hit_rate: float | None = Field(
        default=None, description="(hit + local_hit) / all lookups, client reports included"
    )
    outcomes: dict[str, int] = Field(default_factory=dict)


class RankStats(OutcomeCounts):
    """One rank of a job (``group_by=job``)."""

    rank: int | None


class GroupStats(OutcomeCounts):
    """One value of the ``group_by`` dimension."""

    key: str | int | None
    compile_seconds_saved: float = 0.0
    world_size: int | None = Field(
        default=None, description="group_by=job: the largest world size seen"
    )
    ranks: list[RankStats] | None = Field(default=None, description="group_by=job: per-rank counts")
    divergent: bool = Field(
        default=False, description="group_by=job: ranks resolved one recipe differently"
    )


class MissedKernel(BaseModel):
    """A kernel that missed often, and why it missed last."""

    kernel: str | None
    misses: int
    errors: int
    outcomes: dict[str, int]
    last_miss_at: float | None = Field(default=None, description="unix seconds")
    last_miss_outcome: str | None = None
    last_miss_reason: str | None = None
    last_miss_explanation: str | None = Field(
        default=None,
        description="what the last miss's recipe differs in from the nearest one seen before "
        '(nearest <key>: header a.cuh changed (..); flag -O3 added), or "never seen"',
    )
    target: str | None = None
    recipe_key: str | None = None


class Divergence(BaseModel):
    """Ranks of one job whose same recipe (base key and target) resolved to different digests."""

    job_id: str
    base_key: str
    target: str | None
    kernel: str | None
    digests: list[str]
    ranks: dict[str, str] = Field(description="rank -> the digest it got last")
    reported: bool = Field(
        default=False,
        description="false: the server's own events show the ranks disagreeing (digests and "
        "ranks from them alone); true: client reports name digests the server did not see, and "
        "this row holds their word too",
    )
    reported_by: list[str] = Field(
        default_factory=list,
        description="reported rows: the tokens (token:<name>, client:<address> on an open "
        "server) that reported the digests the server did not see",
    )


class ReportedBy(BaseModel):
    """The lookups one reporter (a token) reported in the window."""

    reporter: str | None = Field(
        description="token:<name>, or client:<address> on an open server; null: reported "
        "before reporters were recorded"
    )
    lookups: int
    share: float = Field(description="of all lookups in the window, server-observed included")
    compile_seconds_saved: float = Field(description="by its reported local hits")


class SeriesPoint(OutcomeCounts):
    """One chart bucket, starting at ``t`` (unix seconds)."""

    t: float


class StoreStats(BaseModel):
    """The store now (size, cap, pins) and what eviction did in the window."""

    bytes_used: int = Field(description="bytes of stored artifacts, pinned ones included")
    bytes_cap: int | None = Field(description="max_store_bytes; null when unbounded")
    artifacts: int
    pinned_artifacts: int
    pinned_bytes: int
    evictions: int = Field(description="artifacts evicted or removed in the window")
    bytes_freed: int = Field(description="bytes those evictions freed")


class Stats(BaseModel):
    """Body of ``GET /v1/stats``."""

    since: float | None
    until: float | None
    lookups: int = Field(description="all lookups: server-observed plus client-reported")
    hits: int = Field(description="hit + local_hit")
    totals: dict[str, int] = Field(description="server-observed: outcome -> count")
    reported: dict[str, int] = Field(
        description="client-reported (POST /v1/events): outcome -> count"
    )
    reported_by: list[ReportedBy] = Field(
        default_factory=list,
        description="who reported the client-reported lookups, most first (at most limit)",
    )
    by_tier: dict[str, dict[str, int]] = Field(description="tier -> outcome -> count")
    hit_rate: float | None = Field(
        description="the headline: hit / server-observed lookups (no client-reported figure in "
        "it, so no token moves it); null with none"
    )
    server_hit_rate: float | None = Field(description="the same as hit_rate (kept for old readers)")
    combined_hit_rate: float | None = Field(
        default=None,
        description="(hit + local_hit) / all lookups, client reports included (see reported_by)",
    )
    compile_seconds_saved: float = Field(description="by server-observed hits")
    reported_compile_seconds_saved: float = Field(description="by client-reported local hits")
    group_by: str | None
    groups: list[GroupStats]
    top_missed: list[MissedKernel]
    divergence: list[Divergence]
    bucket_seconds: int
    series: list[SeriesPoint]
    store: StoreStats | None = Field(default=None, description="the store's size and evictions")


# ---------------------------------------------------------------------- SQL pieces
Span = tuple[datetime | None, datetime | None]  # [start, end), None: unbounded
_HOUR = 3600
_DAY = 86400
_FILTERS = ("job_id", "client_id", "kernel", "target")


def _within(at: Any, span: Span) -> sa.ColumnElement[bool]:
    lo, hi = span
    return sa.and_(
        sa.true() if lo is None else at >= lo,
        sa.true() if hi is None else at < hi,
    )


def _filters(
    query: StatsQuery, cols: Any, at: sa.ColumnElement[Any], pieces: list[Span] | None = None
) -> list[sa.ColumnElement[bool]]:
    """The query's conditions on ``cols``; its window, or only ``pieces`` of it where given."""
    conds: list[sa.ColumnElement[bool]] = []
    if pieces is not None:
        conds.append(sa.or_(sa.false(), *(_within(at, p) for p in pieces)))
    else:
        if query.since is not None:
            conds.append(at >= query.since)
        if query.until is not None:
            conds.append(at < query.until)
    for name in _FILTERS:
        value = getattr(query, name)
        if value is not None:
            conds.append(cols[name] == value)
    return conds


_NAMES = ("outcome", "tier", "kernel", "target", "client_id", "job_id", "rank", "reporter")


def _counted(query: StatsQuery) -> bool:
    """Whether the counts can answer ``query``: they hold one dimension at a time, no filters."""
    return all(getattr(query, name) is None for name in _FILTERS)


_LATEST = datetime.max.replace(tzinfo=timezone.utc)


def _later(at: datetime, seconds: int) -> datetime:
    """``at`` plus ``seconds``, or the latest time there is (a query may name 9999-12-31)."""
    if at > _LATEST - timedelta(seconds=seconds):
        return _LATEST
    return at + timedelta(seconds=seconds)


def _ceil(at: datetime, level: int) -> datetime:
    floor = _floor(at, level)
    return floor if floor == at else _later(floor, level)


def _floor(at: datetime, level: int) -> datetime:
    seconds = math.floor(at.timestamp())
    return datetime.fromtimestamp(seconds - seconds % level, timezone.utc)


def _cover(
    lo: datetime | None, hi: datetime | None, levels: tuple[int, ...]
) -> tuple[list[tuple[int, Span]], list[Span]]:
    """``[lo, hi)`` as spans of count rows (coarsest level first), and what is left for raw."""
    if lo is not None and hi is not None and lo >= hi:
        return [], []
    if not levels:
        return [], [(lo, hi)]
    level, finer = levels[0], levels[1:]
    a = None if lo is None else _ceil(lo, level)
    b = None if hi is None else _floor(hi, level)
    if a is not None and b is not None and a >= b:
        return _cover(lo, hi, finer)
    spans: list[tuple[int, Span]] = [(level, (a, b))]
    raw: list[Span] = []
    for piece in ((lo, a), (b, hi)):
        if piece[0] is not None and piece[1] is not None and piece[0] != piece[1]:
            more, left = _cover(*piece, finer)
            spans += more
            raw += left
    return spans, raw


_MINUTE = 60


class CountSpan(NamedTuple):
    """Count rows of one ``level`` in ``[start, end)``, added (``sign`` 1) or taken away (-1).

    ``unless_rolled``: read only where no roll-up holds that hour (minute rows place a
    rolled-up event at its minute, a roll-up at its hour's start).
    """

    level: int
    span: Span
    sign: int = 1
    unless_rolled: datetime | None = None


class RawPiece(NamedTuple):
    """Raw events and roll-ups in ``[start, end)``, added (``sign`` 1) or taken away (-1).

    ``if_rolled``: read only where a roll-up holds that hour (the other side of a
    :class:`CountSpan`'s ``unless_rolled``).
    """

    span: Span
    sign: int = 1
    if_rolled: datetime | None = None


def _days_less_hours(lo: datetime, hi: datetime, now: float) -> list[CountSpan] | None:
    """Whole hours ``[lo, hi)`` inside one UTC day as that day's row less the day's other hours.

    Counts add up (every event is in its day's row and in its hour's row), so the day
    less the hours outside the window is exactly the hours inside it. Worth it when
    that reads fewer rows per key: 1 day row and the other hours that can hold rows
    (none after ``now``), against one row per hour inside. A window ending now
    covers today by 2 rows instead of up to 23. None where hours read fewer.
    """
    day = _floor(lo, _DAY)
    end = _later(day, _DAY)
    written_until = min(end, _ceil(datetime.fromtimestamp(now, timezone.utc), _HOUR))
    inside = (hi - lo).total_seconds() // _HOUR
    outside = (lo - day).total_seconds() // _HOUR + max(
        0.0, (written_until - hi).total_seconds() // _HOUR
    )
    if 1 + outside >= inside:
        return None
    spans = [CountSpan(_DAY, (day, end))]
    # Subtract up to the day's end, not just to now: exact whatever rows exist.
    spans += [
        CountSpan(_HOUR, piece, -1) for piece in ((day, lo), (hi, end)) if piece[0] < piece[1]
    ]
    return spans


def _live_s(span: tuple[datetime, datetime], now: float) -> float:
    """Seconds of ``span`` up to ``now``: how many events it can hold, as far as time tells."""
    end = min(span[1].timestamp(), now)
    return max(0.0, end - span[0].timestamp())


def _edge(
    piece: tuple[datetime, datetime], levels: tuple[int, ...], now: float
) -> tuple[list[CountSpan], list[RawPiece], bool]:
    """A piece of a window inside one hour, read from as few raw events as exactness allows.

    Returns count spans, raw pieces, and whether the piece's whole hour is to be
    counted too (its hour row, less the raw pieces returned). With minute rows
    (dimension ``all``): the whole minutes from them, unless a roll-up holds the hour
    (then raw, as a roll-up is counted at its hour's start), and the seconds at either
    end raw. With hour rows: the hour's row less the raw events of the hour outside
    the piece, where those are under half the piece's own by time up to ``now`` (a
    piece ending now leaves the hour's rest, which holds nothing yet). Exact with
    roll-ups too: the hour's row holds its roll-ups and raw events, and the raw outside
    the piece takes away the roll-ups with the events (a roll-up lies at the hour's
    start, outside a piece starting later, inside one starting there). Otherwise the
    piece is read raw.
    """
    start, end = piece
    hour = _floor(start, _HOUR)
    first, last = _ceil(start, _MINUTE), _floor(end, _MINUTE)
    if _MINUTE in levels and first < last:
        seconds = [RawPiece(p) for p in ((start, first), (last, end)) if p[0] < p[1]]
        return (
            [CountSpan(_MINUTE, (first, last), unless_rolled=hour)],
            [RawPiece((first, last), if_rolled=hour), *seconds],
            False,
        )
    outside = [p for p in ((hour, start), (end, _later(hour, _HOUR))) if p[0] < p[1]]
    if _HOUR in levels and 2 * sum(_live_s(p, now) for p in outside) < _live_s(piece, now):
        return [], [RawPiece(p, -1) for p in outside], True
    return [], [RawPiece(piece)], False


def _plan(
    query: StatsQuery, levels: tuple[int, ...], subtract: bool = True
) -> tuple[list[CountSpan], list[RawPiece]]:
    """Count spans and raw pieces that together make the query's window exactly.

    Partial hours at the edges are read as :func:`_edge` decides: raw events where
    counts cannot say what they held (a roll-up counts an event by its hour's start),
    or an hour's row less the rest of the hour, which then joins the whole hours. With
    ``subtract`` (and day and hour levels), the whole hours of a partly covered day
    may be that day's row less its other hours (:func:`_days_less_hours`); the series
    passes False, since its buckets must each hold only their own rows (an hour less
    part of itself stays in its own bucket, as the series' levels divide its step).
    """
    now = time.time()
    since, until = query.since, query.until
    lo = None if since is None else _ceil(since, _HOUR)
    hi = None if until is None else _floor(until, _HOUR)
    coarse = tuple(sorted((lv for lv in levels if lv >= 60), reverse=True))
    spans: list[CountSpan] = []
    raw: list[RawPiece] = []
    if since is not None and until is not None and lo is not None and hi is not None and hi <= lo:
        # No whole hour: the window inside one hour, or across one hour's end.
        cut = [since, *([lo] if since < lo < until else []), until]
        for piece in itertools.pairwise(cut):
            more, left, whole_hour = _edge(piece, coarse, now)
            hour = _floor(piece[0], _HOUR)
            spans += more + ([CountSpan(_HOUR, (hour, _later(hour, _HOUR)))] if whole_hour else [])
            raw += left
        return spans, raw
    if since is not None and lo is not None and since != lo:
        more, left, whole_hour = _edge((since, lo), coarse, now)
        spans, raw = spans + more, raw + left
        lo = _floor(since, _HOUR) if whole_hour else lo
    if until is not None and hi is not None and hi != until:
        more, left, whole_hour = _edge((hi, until), coarse, now)
        spans, raw = spans + more, raw + left
        hi = _later(hi, _HOUR) if whole_hour else hi
    if not (subtract and _DAY in coarse and _HOUR in coarse):
        plain, rest = _cover(lo, hi, coarse)
        return spans + [CountSpan(lv, span) for lv, span in plain], raw + [
            RawPiece(p) for p in rest
        ]
    # The partial days at either end, and the whole days between them.
    a = None if lo is None else _ceil(lo, _DAY)
    b = None if hi is None else _floor(hi, _DAY)
    if a is not None and b is not None and a > b:  # [lo, hi) inside one day
        partial, whole = [(lo, hi)], None
    else:
        partial = [p for p in ((lo, a), (b, hi)) if p[0] is not None and p[0] != p[1]]
        whole = (a, b) if a != b or a is None else None
    if whole is not None:
        spans.append(CountSpan(_DAY, whole))
    for p_lo, p_hi in partial:
        assert p_lo is not None and p_hi is not None  # a partial day has both ends
        less = _days_less_hours(p_lo, p_hi, now)
        if less is not None:
            spans += less
            continue
        hours, rest = _cover(p_lo, p_hi, coarse[1:])
        spans += [CountSpan(lv, span) for lv, span in hours]
        raw += [RawPiece(p) for p in rest]
    return spans, raw


#: (dimension, level) -> the first and last bucket of its count rows (None: no rows).
Present = dict[tuple[str, int], tuple[datetime, datetime] | None]
#: The (dimension, level) pairs stats reads for a few group values only: a job's ranks
#: (``job_rank``, for the jobs shown and the divergent recipes' jobs) and its world size.
_KEYED = (("job_rank", _DAY), ("job_rank", _HOUR), ("job", _DAY))
# At most this many buckets are named in one keyed read; a longer span (years of days)
# reads its range instead.
_MAX_KEYED_BUCKETS = 2000


def _present(conn: sa.Connection) -> Present:
    """First and last bucket of each keyed (dimension, level): one statement of index probes.

    Each ``min``/``max`` is its own subquery, an index probe on the primary key's
    ``(dim, level, bucket)`` prefix on SQLite and PostgreSQL alike. Read once per
    answer, before the pieces that use it: a bucket first written after it (a new
    hour's first flush) is read by keyed reads of the next answer, as each statement
    of an answer reads its own snapshot anyway.
    """
    c = _counts_t.c
    row = conn.execute(
        sa.select(
            *(
                sa.select(fn(c.bucket)).where(c.dim == dim, c.level == level).scalar_subquery()
                for dim, level in _KEYED
                for fn in (sa.func.min, sa.func.max)
            )
        )
    ).one()
    return {
        pair: None if row[2 * i] is None else (row[2 * i], row[2 * i + 1])
        for i, pair in enumerate(_KEYED)
    }


def _keyed(
    c: Any,
    level: int,
    span: Span,
    present: tuple[datetime, datetime] | None,
    keys: list[Any],
) -> sa.ColumnElement[bool]:
    """Count rows of ``keys`` in ``span`` at ``level``, as index probes where the buckets are few.

    The primary key is ``(dim, level, bucket, key, ...)``: a range of buckets with
    ``key IN (...)`` reads every group value's rows in the range (a job's ranks are
    one row per rank, outcome and bucket, for every job), while naming each bucket
    present lets SQLite and PostgreSQL seek each (bucket, key) pair. ``present`` (from
    :func:`_present`) bounds the buckets to those that can hold rows.
    """
    in_keys = c.key.in_([encode(k) for k in keys])
    if present is None:
        return sa.false()
    lo, hi = span
    first = present[0] if lo is None else max(present[0], _ceil(lo, level))
    buckets: list[datetime] = []
    at = first
    while at <= present[1] and (hi is None or at < hi):
        if len(buckets) == _MAX_KEYED_BUCKETS:
            return sa.and_(_within(c.bucket, span), in_keys)
        buckets.append(at)
        at = _later(at, level)
        if at == _LATEST:
            break
    return sa.and_(c.bucket.in_(buckets), in_keys)


def _rolled(hour: datetime) -> sa.ColumnElement[bool]:
    """Some roll-up holds ``hour`` (an index probe on ``audit_rollups.bucket``)."""
    return sa.exists().where(_rollups.c.bucket == hour)


def _source(
    query: StatsQuery,
    dim: str | None = None,
    levels: tuple[int, ...] | None = None,
    keys: list[Any] | None = None,
    subtract: bool = True,
    present: Present | None = None,
) -> sa.Subquery:
    """Raw events, roll-ups and (``dim`` given) count rows of ``dim`` as one relation with a weight ``n``.

    Without ``dim`` every event of the window is read raw. With it, the window is
    split by :func:`_plan` over ``levels`` (default: all of the dimension's); count
    rows carry only their dimension's columns (the others NULL). ``keys`` restricts
    count rows to those first-key values, read by :func:`_keyed` with ``present``: a
    filter on a decoded column outside would not reach the index, and a job's per-rank
    rows are many.
    """
    ev, ru = _events.c, _rollups.c
    spans: list[CountSpan] = []
    # One SELECT per raw piece, joined by UNION ALL: each is one range scan of the
    # time index, where an OR of ranges may cost PostgreSQL a scan of every event.
    pieces: list[RawPiece | None] = [None]
    if dim is not None:
        spans, edges = _plan(query, LEVELS[dim] if levels is None else levels, subtract)
        pieces = list(edges)
    parts: list[sa.Select[Any]] = []
    for piece in pieces:
        sign = 1 if piece is None else piece.sign
        # Raw events by their time, roll-ups by their hour: the same columns.
        for table, at in ((ev, ev.at), (ru, ru.bucket)):
            conds = _filters(query, table, at, None if piece is None else [piece.span])
            if piece is not None and piece.if_rolled is not None:
                conds.append(_rolled(piece.if_rolled))
            parts.append(
                sa.select(
                    at.label("at"),
                    *(table[n] for n in _NAMES),
                    (table["count"] if sign > 0 else -table["count"]).label("n"),
                    (
                        table.compile_seconds_saved if sign > 0 else -table.compile_seconds_saved
                    ).label("saved"),
                ).where(*conds)
            )
    if dim is not None:
        c = _counts_t.c
        known: Present = {} if present is None else present
        if keys is not None and any((dim, span.level) not in known for span in spans):
            raise ValueError(f"reading {dim} counts by key needs their buckets present")
        first, second = DIMENSIONS[dim]
        values: dict[str, sa.ColumnElement[Any]] = {name: sa.null() for name in _NAMES[2:]}
        if first:
            values[first] = decode(c.key, as_int=first == "rank")
        if second:
            values[second] = decode(c.key2, as_int=True)
        for level, span, sign, unless_rolled in spans:
            parts.append(
                sa.select(
                    c.bucket.label("at"),
                    c.outcome,
                    c.tier,
                    *(values[n].label(n) for n in _NAMES[2:]),
                    (c["count"] if sign > 0 else -c["count"]).label("n"),
                    (c.saved if sign > 0 else -c.saved).label("saved"),
                ).where(
                    c.dim == dim,
                    c.level == level,
                    _within(c.bucket, span)
                    if keys is None
                    else _keyed(c, level, span, known[(dim, level)], keys),
                    sa.true() if unless_rolled is None else ~_rolled(unless_rolled),
                )
            )
    if not parts:  # an empty window: one SELECT that finds nothing, for the columns
        parts.append(
            sa.select(
                ev.at.label("at"),
                *(ev[n] for n in _NAMES),
                ev["count"].label("n"),
                ev.compile_seconds_saved.label("saved"),
            ).where(sa.false())
        )
    return sa.union_all(*parts).subquery("src")


def _epoch(dialect: str, column: Any) -> sa.ColumnElement[Any]:
    # SQLite stores these timestamps as ISO text; PostgreSQL as timestamptz.
    if dialect == "sqlite":
        return sa.cast(sa.func.strftime("%s", column), sa.BigInteger)
    return sa.func.floor(sa.extract("epoch", column))


def _counts(outcomes: Mapping[str, int]) -> dict[str, Any]:
    """:class:`OutcomeCounts` fields: the hit rate over what the server observed, the rest beside it."""
    total = sum(outcomes.values())
    hits = sum(v for k, v in outcomes.items() if k in HIT_OUTCOMES)
    reported = sum(v for k, v in outcomes.items() if k in REPORTED_OUTCOMES)
    observed_hits = sum(
        v for k, v in outcomes.items() if k in HIT_OUTCOMES and k not in REPORTED_OUTCOMES
    )
    observed = total - reported
    return {
        "total": total,
        "hits": hits,
        "misses": sum(v for k, v in outcomes.items() if k in MISS_OUTCOMES),
        "reported": reported,
        "hit_rate": observed_hits / observed if observed else None,
        "combined_hit_rate": hits / total if total else None,
        "outcomes": dict(outcomes),
    }


def _epoch_of(value: datetime | None) -> float | None:
    return value.timestamp() if value is not None else None


def _step(span_s: float, buckets: int) -> int:
    want = max(span_s / max(buckets, 1), 1.0)
    return next((s for s in _STEPS_S if s >= want), math.ceil(want / 86400) * 86400)


# ---------------------------------------------------------------------- the pieces of Stats
def _totals(
    conn: sa.Connection, src: sa.Subquery
) -> tuple[dict[str, int], dict[str, int], dict[str, dict[str, int]], float, float]:
    """Server-observed totals, client-reported ones, counts by tier, and the two savings."""
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
        if not n:  # nothing of it in the window: a day's row less its hours (_source)
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


def _reported_by(conn: sa.Connection, query: StatsQuery) -> list[tuple[str, int, float]]:
    """(reporter, lookups, compile seconds saved) of the window's client reports that name one.

    From the counts' ``reporter`` dimension (raw events where counts cannot answer), which
    holds reported events only; reports from before 0013 name none, and are left for
    the caller to show as unattributed.
    """
    src = _source(query, "reporter" if _counted(query) else None)
    rows = conn.execute(
        sa.select(src.c.reporter, sa.func.sum(src.c.n), sa.func.sum(src.c.saved))
        .where(src.c.tier != SERVER_TIER, src.c.reporter.is_not(None))
        .group_by(src.c.reporter)
        # 0: nothing of it in the window, a day's row less its hours (_source)
        .having(sa.func.sum(src.c.n) != 0)
    ).all()
    return [(str(r), int(n), float(saved or 0.0)) for r, n, saved in rows]


def _attributed(
    named: list[tuple[str, int, float]],
    reported: int,
    reported_saved: float,
    lookups: int,
    limit: int,
) -> list[ReportedBy]:
    """``named`` most first, with what no reporter is named for (reports before 0013) as ``None``."""
    rows: list[tuple[str | None, int, float]] = list(named)
    attributed = sum(n for _, n, _ in named)
    if reported > attributed:
        rows.append((None, reported - attributed, reported_saved - sum(s for *_, s in named)))
    ranked = sorted(rows, key=lambda r: (-r[1], r[0] is None, r[0] or ""))[:limit]
    return [
        ReportedBy(
            reporter=r, lookups=n, share=n / lookups if lookups else 0.0, compile_seconds_saved=s
        )
        for r, n, s in ranked
    ]


def _groups(conn: sa.Connection, query: StatsQuery, present: Present) -> list[GroupStats]:
    if query.group_by is None:
        return []
    src = _source(query, query.group_by if _counted(query) else None)
    col = src.c[GROUP_BY[query.group_by]]
    rows = conn.execute(
        sa.select(col, src.c.outcome, sa.func.sum(src.c.n), sa.func.sum(src.c.saved))
        .group_by(col, src.c.outcome)
        # 0: nothing of it in the window, a day's row less its hours (_source)
        .having(sa.func.sum(src.c.n) != 0)
    ).all()
    outcomes: dict[Any, dict[str, int]] = defaultdict(dict)
    saved: dict[Any, float] = defaultdict(float)
    for key, outcome, n, s in rows:
        outcomes[key][outcome] = int(n)
        saved[key] += float(s or 0.0)
    keys = sorted(outcomes, key=lambda k: (-sum(outcomes[k].values()), str(k)))[: query.limit]
    groups = [
        GroupStats(key=k, compile_seconds_saved=saved[k], **_counts(outcomes[k])) for k in keys
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
    src = _source(query, "job_rank" if _counted(query) else None, keys=jobs, present=present)
    rows = conn.execute(
        sa.select(src.c.job_id, src.c.rank, src.c.outcome, sa.func.sum(src.c.n))
        .where(src.c.job_id.in_(jobs))
        .group_by(src.c.job_id, src.c.rank, src.c.outcome)
    ).all()
    per: dict[Any, dict[Any, dict[str, int]]] = defaultdict(lambda: defaultdict(dict))
    for job, rank, outcome, n in rows:
        if n:  # 0: nothing of it in the window, a day's row less its hours (_source)
            per[job][rank][outcome] = int(n)
    c = _counts_t.c
    sizes = dict(
        conn.execute(
            sa.select(decode(c.key), sa.func.max(c.world_size))
            .where(
                c.dim == "job",
                c.level == _DAY,
                _keyed(c, _DAY, (None, None), present.get(("job", _DAY)), jobs),
            )
            .group_by(c.key)
        ).all()
    )
    for group in groups:
        if group.key is None:
            continue
        ranks = per.get(group.key, {})
        group.ranks = [
            RankStats(rank=r, **_counts(ranks[r]))
            for r in sorted(ranks, key=lambda r: (r is None, r or 0))
        ]
        group.world_size = sizes.get(group.key)


def _top_missed(conn: sa.Connection, query: StatsQuery) -> list[MissedKernel]:
    """The kernels with the most misses, each with its misses by outcome and its last miss.

    Three statements, however many kernels: the ranking with its per-outcome counts,
    the last raw miss of every top kernel, and (only when some top kernel has no raw
    miss in the window) the last rolled-up one.
    """
    src = _source(query, "kernel" if _counted(query) else None)
    per_outcome = (
        sa.select(src.c.kernel, src.c.outcome, sa.func.sum(src.c.n).label("c"))
        .where(src.c.outcome.in_(sorted(MISS_OUTCOMES)))
        .group_by(src.c.kernel, src.c.outcome)
        # 0: nothing of it in the window, a day's row less its hours (_source)
        .having(sa.func.sum(src.c.n) != 0)
        .subquery("per_outcome")
    )
    with_total = sa.select(
        per_outcome,
        sa.func.sum(per_outcome.c.c).over(partition_by=per_outcome.c.kernel).label("misses"),
    ).subquery("with_total")
    # dense_rank: every outcome row of one kernel shares its kernel's place.
    ranked = sa.select(
        with_total,
        sa.func.dense_rank()
        .over(order_by=(with_total.c.misses.desc(), with_total.c.kernel))
        .label("place"),
    ).subquery("ranked")
    rows = conn.execute(
        sa.select(ranked.c.place, ranked.c.kernel, ranked.c.misses, ranked.c.outcome, ranked.c.c)
        .where(ranked.c.place <= query.top)
        .order_by(ranked.c.place, ranked.c.outcome)
    ).all()
    items: dict[int, MissedKernel] = {}
    for place, kernel, misses, outcome, c in rows:
        item = items.get(place)
        if item is None:
            item = items[place] = MissedKernel(
                kernel=kernel, misses=int(misses), errors=0, outcomes={}
            )
        item.outcomes[outcome] = int(c)
    result = [items[p] for p in sorted(items)]
    for item in result:
        item.errors = item.outcomes.get("error", 0)
    if result:
        _last_misses(conn, query, result)
    return result


def _kernel_in(column: Any, kernels: list[str | None]) -> sa.ColumnElement[bool]:
    """``column`` is one of ``kernels`` (None among them matching NULL)."""
    named = [k for k in kernels if k is not None]
    cond: sa.ColumnElement[bool] = column.in_(named) if named else sa.false()
    return sa.or_(cond, column.is_(None)) if None in kernels else cond


def _last_misses(conn: sa.Connection, query: StatsQuery, items: list[MissedKernel]) -> None:
    """Fill each item's last miss (and why it was needed) in one statement, plus one for roll-ups.

    Each kernel's last miss is one scalar subquery that walks ``(kernel, at, id)``
    backwards from the window's end, so a kernel with millions of events costs a
    probe, not a sort of its misses.
    """
    ev = _events.c
    misses = sorted(MISS_OUTCOMES)

    def last_of(kernel: str | None) -> sa.ScalarSelect[Any]:
        return (
            sa.select(ev.id)
            .where(
                *_filters(query, ev, ev.at),
                ev.kernel.is_(None) if kernel is None else ev.kernel == kernel,
                ev.outcome.in_(misses),
            )
            .order_by(ev.at.desc(), ev.id.desc())
            .limit(1)
            .scalar_subquery()
        )

    picked = sa.union_all(
        *(sa.select(last_of(item.kernel).label("id")) for item in items)
    ).subquery("picked")
    latest = (
        sa.select(
            ev.id,
            ev.at,
            ev.kernel,
            ev.outcome,
            ev.error,
            ev.recipe_key,
            ev.base_key,
            ev.target,
            ev.miss_reason,
            ev.latency_ms,
        )
        .where(ev.id.in_(sa.select(picked.c.id)))
        .subquery("latest")
    )
    # Why a compile was needed, from what was seen before it (any window): the same
    # recipe served earlier means it was evicted; a sibling recipe (same base key and
    # target, other headers) built earlier means the headers changed. A waited miss
    # joined a compile that was already running (a client interrupted meanwhile leaves
    # it running): that compile's own row, and hits of what it stored, were written
    # after the waiter started waiting, so only what came before the wait is history.
    before = sa.alias(_events, "before")
    earlier = (
        before.c.at <= latest.c.at,
        before.c.id < latest.c.id,
        sa.or_(
            latest.c.outcome != "waited",
            _ms_between(conn.dialect.name, before.c.at, latest.c.at) > latest.c.latency_ms,
        ),
    )
    served = sa.exists().where(
        *earlier,
        before.c.recipe_key == latest.c.recipe_key,
        before.c.outcome.in_(("hit", "local_hit", "compiled")),
    )
    # Probes on (base_key, target, recipe_key, id): the other recipes sort below or
    # above this one, and an earlier event of either ends the probe at once; a
    # recipe without siblings finds empty ranges. Targets match by "=" or both NULL,
    # each its own probe (IS NOT DISTINCT FROM would cost PostgreSQL the index).
    sibling = sa.or_(
        *(
            sa.exists().where(
                *earlier, before.c.base_key == latest.c.base_key, same_target, other_recipe
            )
            for same_target in (
                before.c.target == latest.c.target,
                sa.and_(before.c.target.is_(None), latest.c.target.is_(None)),
            )
            for other_recipe in (
                before.c.recipe_key < latest.c.recipe_key,
                before.c.recipe_key > latest.c.recipe_key,
            )
        )
    )
    rebuilt = sa.and_(
        latest.c.outcome.in_(("compiled", "waited")), latest.c.recipe_key.is_not(None)
    )
    history = sa.case(
        (sa.and_(rebuilt, served), "evicted"),
        (sa.and_(rebuilt, latest.c.base_key.is_not(None), sibling), "headers"),
        else_=sa.null(),
    )
    rows = conn.execute(
        sa.select(
            latest.c.kernel,
            latest.c.at,
            latest.c.outcome,
            latest.c.error,
            latest.c.recipe_key,
            latest.c.target,
            latest.c.miss_reason,
            history.label("history"),
        )
    ).all()
    last = {row.kernel: row for row in rows}
    for item in items:
        row = last.get(item.kernel)
        if row is not None:
            item.last_miss_at = row.at.timestamp()
            item.last_miss_outcome = row.outcome
            item.target = row.target
            item.recipe_key = row.recipe_key
            item.last_miss_reason = _reason(row.outcome, row.error, row.history)
            item.last_miss_explanation = row.miss_reason
    rolled_only = [item for item in items if item.kernel not in last]
    if rolled_only:
        _last_rolled_up_misses(conn, query, rolled_only)


def _last_rolled_up_misses(
    conn: sa.Connection, query: StatsQuery, items: list[MissedKernel]
) -> None:
    """The last miss of kernels whose misses in the window are all rolled up (one statement)."""
    ru = _rollups.c
    latest = (
        sa.select(
            ru.kernel,
            ru.last_at,
            ru.outcome,
            ru.last_error,
            sa.func.row_number()
            .over(partition_by=ru.kernel, order_by=(ru.last_at.desc(), ru.id.desc()))
            .label("from_last"),
        )
        .where(
            *_filters(query, ru, ru.bucket),
            _kernel_in(ru.kernel, [item.kernel for item in items]),
            ru.outcome.in_(sorted(MISS_OUTCOMES)),
        )
        .subquery("latest")
    )
    last = {
        row.kernel: row for row in conn.execute(sa.select(latest).where(latest.c.from_last == 1))
    }
    for item in items:
        row = last.get(item.kernel)
        if row is not None:
            item.last_miss_at = row.last_at.timestamp()
            item.last_miss_outcome = row.outcome
            item.last_miss_reason = _reason(row.outcome, row.last_error, None)


def _reason(outcome: str, error: str | None, history: str | None) -> str:
    """A short sentence a person can act on."""
    if outcome == "error":
        return _ERROR_REASONS.get(error or "", (error or "error").replace("_", " "))
    if outcome == "miss":
        return "not cached, and the caller did not ask to compile"
    if history == "evicted":
        why = "served before, then evicted or garbage-collected"
    elif history == "headers":
        why = "header contents changed since an earlier build"
    else:
        why = "first build of this recipe"
    # A waiter compiled nothing: it joined a compile already running (its starter may
    # have been interrupted since), which was needed for the reason found before the wait.
    return f"joined a compile another request had started: {why}" if outcome == "waited" else why


def _ms_between(dialect: str, earlier: Any, later: Any) -> sa.ColumnElement[Any]:
    """Milliseconds from ``earlier`` to ``later`` (two timestamp columns), in SQL."""
    if dialect == "sqlite":  # ISO text with microseconds: julianday reads the fraction
        return (sa.func.julianday(later) - sa.func.julianday(earlier)) * 86_400_000.0
    return sa.extract("epoch", later - earlier) * 1000.0


def _same(column: Any, encoded: Any, as_int: bool = False) -> list[sa.ColumnElement[bool]]:
    """``column`` equals the :func:`encode` d value ``encoded``, as two index-friendly forms.

    One form compares by ``=`` (no match for an encoded NULL), the other matches
    ``IS NULL`` gated on the encoded NULL: an ``OR`` of both, or ``IS NOT DISTINCT
    FROM``, would cost PostgreSQL the index. Callers probe once per form.
    """
    return [column == decode(encoded, as_int), sa.and_(column.is_(None), encoded == "")]


def _probe(
    pick: Any, conds: list[list[sa.ColumnElement[bool]]], order: Any
) -> sa.ColumnElement[Any]:
    """The first ``pick`` of ``audit_events`` by ``order`` under every combination of ``conds``.

    Each inner list holds alternative conditions (see :func:`_same`); every
    combination is its own ``LIMIT 1`` index probe, and the answer is the first
    non-NULL one (the alternatives exclude each other, so at most one finds a row).
    """
    combos: list[list[sa.ColumnElement[bool]]] = [[]]
    for alternatives in conds:
        combos = [[*c, a] for c in combos for a in alternatives]
    probes = [
        sa.select(pick).where(*combo).order_by(*order).limit(1).scalar_subquery()
        for combo in combos
    ]
    return sa.func.coalesce(*probes)


Recipe = tuple[str, str, str]  # job id, base key, encoded target


def _divergence(conn: sa.Connection, query: StatsQuery, present: Present) -> list[Divergence]:
    """Recipes (base key and target) that ranks of one job got different digests for.

    What the server observed and what clients reported are never merged into one row:
    a recipe the server itself saw two digests of is a row built from the server's
    events alone (``reported`` false); digests only client reports name make a row of
    their own (``reported`` true, with every event's word and the reporters named).
    One recipe can have both.

    A bounded number of statements, whatever the number of events, each a bounded set
    of index probes:

    1. Every digest ``audit_digests`` lists for a recipe of ``audit_divergences``
       (the recipes one job ever got two digests for) whose first and last
       sighting overlaps the window, with two ``EXISTS`` probes on
       ``(job_id, base_key, target, digest, tier, at)``: seen in the window by the
       server, by a client.
    2. For each row's recipe (at most ``limit``) and each rank its job has counts
       for: the rank's last digest and its first event naming the kernel, each a
       ``LIMIT 1`` probe on ``(job_id, base_key, target, rank, at, id)`` (the server's
       events only, for a server row); once for server rows, once for reported ones.
    3. For reported rows: who reported the digests the server did not see, from the
       client events of those recipes (on the same index's prefix).

    The answer is what grouping the raw events would give; a query filtered by
    client or kernel applies its filter inside the probes, which then may read
    more index entries (filtered queries read raw events anyway).
    """
    ev, dg, dv = _events.c, _digests.c, _divergences.c
    narrow = [dg.first_at < query.until] if query.until is not None else []
    if query.since is not None:
        narrow.append(dg.last_at >= query.since)
    if query.job_id is not None:
        narrow.append(dv.job_id == query.job_id)
    if query.target is not None:
        narrow.append(dv.target == encode(query.target))
    scope = [*_filters(query, ev, ev.at), ev.job_id == dv.job_id, ev.base_key == dv.base_key]

    def seen(tiers: tuple[str, ...]) -> sa.ColumnElement[Any]:
        found = [
            sa.exists().where(*scope, ev.digest == dg.digest, ev.tier.in_(tiers), target)
            for target in _same(ev.target, dv.target)
        ]
        return sa.case((sa.or_(*found), 1), else_=0)

    rows = conn.execute(
        sa.select(
            dv.job_id,
            dv.base_key,
            dv.target,
            dg.digest,
            seen((SERVER_TIER,)).label("server"),
            seen(CLIENT_TIERS).label("client"),
        )
        .select_from(
            _divergences.join(
                _digests,
                sa.and_(dg.job_id == dv.job_id, dg.base_key == dv.base_key, dg.target == dv.target),
            )
        )
        .where(*narrow)
    ).all()
    by_server: dict[Recipe, set[str]] = defaultdict(set)
    by_clients: dict[Recipe, set[str]] = defaultdict(set)
    for row in rows:
        recipe = (row.job_id, row.base_key, row.target)
        if row.server:
            by_server[recipe].add(row.digest)
        if row.client:
            by_clients[recipe].add(row.digest)
    wanted: list[tuple[Recipe, bool]] = []
    for recipe in sorted({*by_server, *by_clients}):
        server, hearsay = by_server[recipe], by_clients[recipe] - by_server[recipe]
        if len(server) > 1:
            wanted.append((recipe, False))
        if hearsay and len(server | hearsay) > 1:
            wanted.append((recipe, True))
    wanted = wanted[: query.limit]
    if not wanted:
        return []
    observed = [r for r, reported in wanted if not reported]
    claimed = [r for r, reported in wanted if reported]
    probed = {
        False: _rank_digests(conn, query, present, observed, server_only=True),
        True: _rank_digests(conn, query, present, claimed, server_only=False),
    }
    reporters = _reporters(conn, query, {r: by_clients[r] - by_server[r] for r in claimed})
    out = []
    for recipe, reported in wanted:
        ranks, kernel = probed[reported].get(recipe, ({}, None))
        digests = by_server[recipe] | (by_clients[recipe] if reported else set())
        out.append(
            Divergence(
                job_id=recipe[0],
                base_key=recipe[1],
                target=None if recipe[2] == "" else recipe[2][1:],
                kernel=kernel,
                digests=sorted(digests),
                ranks=dict(
                    sorted(
                        ranks.items(),
                        key=lambda kv: (not kv[0].isdigit(), int(kv[0]) if kv[0].isdigit() else 0),
                    )
                ),
                reported=reported,
                reported_by=reporters.get(recipe, []) if reported else [],
            )
        )
    return out


def _rank_digests(
    conn: sa.Connection,
    query: StatsQuery,
    present: Present,
    recipes: list[Recipe],
    *,
    server_only: bool,
) -> dict[Recipe, tuple[dict[str, str], str | None]]:
    """Each recipe's last digest per rank and the first kernel named, from one statement of probes.

    ``server_only``: from the server's own events (a server row holds nothing of the
    clients' word); else from every event.
    """
    if not recipes:
        return {}
    ev, dv = _events.c, _divergences.c
    scope = [*_filters(query, ev, ev.at), ev.job_id == dv.job_id, ev.base_key == dv.base_key]
    if server_only:
        scope.append(ev.tier == SERVER_TIER)
    # The ranks each job has counts for (a superset of those that got these recipes).
    c = _counts_t.c
    ranks = (
        sa.select(c.key.label("job_key"), c.key2.label("rank_key"))
        .where(
            c.dim == "job_rank",
            c.level == _DAY,
            _keyed(
                c, _DAY, (None, None), present[("job_rank", _DAY)], sorted({r[0] for r in recipes})
            ),
        )
        .distinct()
        .subquery("ranks")
    )
    per_rank = [*scope, ev.digest.is_not(None)]
    conds = [_same(ev.target, dv.target), _same(ev.rank, ranks.c.rank_key, as_int=True)]
    last = _probe(
        ev.id,
        [[sa.and_(*per_rank, t) for t in conds[0]], conds[1]],
        (ev.at.desc(), ev.id.desc()),
    )
    named = sa.func.coalesce(ev.kernel, "") != ""
    first_named = _probe(
        ev.id, [[sa.and_(*per_rank, named, t) for t in conds[0]], conds[1]], (ev.at, ev.id)
    )
    pairs = (
        sa.select(
            dv.job_id,
            dv.base_key,
            dv.target,
            ranks.c.rank_key,
            last.label("last_id"),
            first_named.label("named_id"),
        )
        .select_from(_divergences.join(ranks, ranks.c.job_key == sa.literal("=") + dv.job_id))
        .where(sa.tuple_(dv.job_id, dv.base_key, dv.target).in_(recipes))
        .subquery("pairs")
    )
    last_ev, named_ev = sa.alias(_events, "last_ev"), sa.alias(_events, "named_ev")
    result: dict[Recipe, tuple[dict[str, str], str | None]] = {}
    first: dict[Recipe, tuple[datetime, int]] = {}
    for probed in conn.execute(
        sa.select(
            pairs.c.job_id,
            pairs.c.base_key,
            pairs.c.target,
            last_ev.c.rank,
            last_ev.c.digest,
            named_ev.c.at,
            named_ev.c.id,
            named_ev.c.kernel,
        ).select_from(
            pairs.outerjoin(last_ev, last_ev.c.id == pairs.c.last_id).outerjoin(
                named_ev, named_ev.c.id == pairs.c.named_id
            )
        )
    ):
        recipe = (probed.job_id, probed.base_key, probed.target)
        ranks_of, kernel = result.get(recipe, ({}, None))
        if probed.digest is not None:
            ranks_of["-" if probed.rank is None else str(probed.rank)] = probed.digest
        if probed.kernel is not None and (
            recipe not in first or (probed.at, probed.id) < first[recipe]
        ):
            first[recipe] = (probed.at, probed.id)
            kernel = probed.kernel
        result[recipe] = (ranks_of, kernel)
    return result


def _reporters(
    conn: sa.Connection, query: StatsQuery, unseen: Mapping[Recipe, set[str]]
) -> dict[Recipe, list[str]]:
    """Who reported, in the window, the digests ``unseen`` by the server, per recipe (one statement).

    Reads the client events of those recipes on the prefix of ``(job_id, base_key,
    target, digest, tier, at)``; events reported before 0013 name no reporter.
    """
    if not unseen:
        return {}
    ev = _events.c
    rows = conn.execute(
        sa.select(ev.job_id, ev.base_key, ev.target, ev.digest, ev.reporter)
        .where(
            *_filters(query, ev, ev.at),
            sa.tuple_(ev.job_id, ev.base_key).in_(sorted({(r[0], r[1]) for r in unseen})),
            ev.tier.in_(CLIENT_TIERS),
            ev.reporter.is_not(None),
        )
        .distinct()
    ).all()
    found: dict[Recipe, set[str]] = defaultdict(set)
    for row in rows:
        recipe = (row.job_id, row.base_key, encode(row.target))
        if row.digest in unseen.get(recipe, ()):
            found[recipe].add(row.reporter)
    return {recipe: sorted(names) for recipe, names in found.items()}


def _extent(conn: sa.Connection, query: StatsQuery) -> tuple[float, float] | None:
    """Unix seconds (floored) of the first and last event or roll-up in the window, None if none.

    Four index probes (``at`` and ``bucket``), whatever the window holds: each
    ``min``/``max`` its own subquery, since SQLite optimises a lone ``min()`` or
    ``max()`` into one probe but scans the whole index for both in one ``SELECT``.
    """
    ev, ru = _events.c, _rollups.c
    found: list[datetime] = []
    for table, at in ((_events, ev.at), (_rollups, ru.bucket)):
        first, last = conn.execute(
            sa.select(
                *(
                    sa.select(fn(at)).where(*_filters(query, table.c, at)).scalar_subquery()
                    for fn in (sa.func.min, sa.func.max)
                )
            )
        ).one()
        found += [t for t in (first, last) if t is not None]
    if not found:
        return None
    return float(math.floor(min(found).timestamp())), float(math.floor(max(found).timestamp()))


def _series(conn: sa.Connection, query: StatsQuery) -> tuple[int, list[SeriesPoint]]:
    dialect = conn.dialect.name
    counted = _counted(query)
    lo: float | None = _epoch_of(query.since)
    hi: float | None = _epoch_of(query.until)
    if lo is None or hi is None:
        first: Any
        last: Any
        if counted:
            extent = _extent(conn, query)
            first, last = extent if extent is not None else (None, None)
        else:
            epoch = _epoch(dialect, _source(query).c.at)
            first, last = conn.execute(sa.select(sa.func.min(epoch), sa.func.max(epoch))).one()
        if first is None:
            return 0, []
        lo = float(first) if lo is None else lo
        hi = float(last) + 1 if hi is None else hi
    step = _step(max(hi - lo, 1.0), query.buckets)
    # Count rows of a level that divides the step lie in one bucket each.
    levels = tuple(lv for lv in LEVELS["all"] if step % lv == 0)
    src = _source(query, "all" if counted else None, levels, subtract=False)
    epoch = _epoch(dialect, src.c.at)
    # Integer floor division in SQL (SQLAlchemy's "/" is true division): rows of one
    # bucket must group together.
    bucket = (
        (sa.cast(epoch, sa.BigInteger) // step).label("b")
        if dialect == "sqlite"
        else sa.func.floor(epoch / step).label("b")
    )
    rows = conn.execute(
        sa.select(bucket, src.c.outcome, sa.func.sum(src.c.n)).group_by(bucket, src.c.outcome)
    ).all()
    per: dict[int, dict[str, int]] = defaultdict(dict)
    for b, outcome, n in rows:
        per[int(b)][outcome] = per[int(b)].get(outcome, 0) + int(n)
    first_b, last_b = int(lo // step), math.ceil(hi / step) - 1
    points = [
        SeriesPoint(t=float(b * step), **_counts(per.get(b, {})))
        for b in range(first_b, max(last_b, first_b) + 1)
    ]
    return step, points


def _store(
    engine: sa.Engine, conn: sa.Connection, query: StatsQuery, cap: int | None
) -> StoreStats:
    usage = SqlIndex(engine).usage()
    evicted, freed = conn.execute(
        sa.select(sa.func.count(), sa.func.coalesce(sa.func.sum(_evictions.c.size), 0)).where(
            *_filters(StatsQuery(since=query.since, until=query.until), {}, _evictions.c.at)
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
        present = _present(conn)
        groups_read = _beside(engine, lambda lane: _groups(lane, query, present))
        top_read = _beside(engine, lambda lane: _top_missed(lane, query))
        src = _source(query, "all" if _counted(query) else None)
        totals, reported, by_tier, saved, reported_saved = _totals(conn, src)
        reporters = _reported_by(conn, query) if sum(reported.values()) else []
        divergence = _divergence(conn, query, present)
        step, series = _series(conn, query)
        store = _store(engine, conn, query, store_cap)
        groups, top_missed = groups_read.result(), top_read.result()
    if query.group_by == "job":
        divergent_jobs = {d.job_id for d in divergence if not d.reported}
        for group in groups:
            group.divergent = group.key is not None and group.key in divergent_jobs
    server_lookups = sum(totals.values())
    lookups = server_lookups + sum(reported.values())
    hits = sum(v for k, v in (*totals.items(), *reported.items()) if k in HIT_OUTCOMES)
    server_hits = sum(v for k, v in totals.items() if k in HIT_OUTCOMES)
    server_hit_rate = server_hits / server_lookups if server_lookups else None
    return Stats(
        since=_epoch_of(query.since),
        until=_epoch_of(query.until),
        lookups=lookups,
        hits=hits,
        totals=totals,
        reported=reported,
        reported_by=_attributed(
            reporters, sum(reported.values()), reported_saved, lookups, query.limit
        ),
        by_tier=by_tier,
        hit_rate=server_hit_rate,
        server_hit_rate=server_hit_rate,
        combined_hit_rate=hits / lookups if lookups else None,
        compile_seconds_saved=saved,
        reported_compile_seconds_saved=reported_saved,
        group_by=query.group_by,
        groups=groups,
        top_missed=top_missed,
        divergence=divergence,
        bucket_seconds=step,
        series=series,
        store=store,
    )
