"""A ``/v1/stats`` window as one SQL relation: count rows where they answer, raw events elsewhere.

:func:`source` is what every aggregate of the answer sums: the raw events and
roll-ups of the window's raw pieces and the count rows of its count spans (as
:func:`~kcache_server.auditing.windows.plan` split it), joined by ``UNION ALL`` into
one relation with a weight ``n`` per row. Counts hold one dimension at a time and no
filters, so a query filtered by job, client, kernel or target (:func:`counted` false)
reads raw events only. A few group values (a job's ranks, its world size) are read
from counts by key, each bucket named (:func:`keyed`, bounded by
:func:`present_buckets`), so the database seeks them instead of reading a range.
"""

from __future__ import annotations

import math
from datetime import datetime
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from kcache_server.auditing.counts import DIMENSIONS, LEVELS, decode, encode
from kcache_server.auditing.windows import (
    DAY,
    HOUR,
    LATEST,
    CountSpan,
    RawPiece,
    Span,
    ceil_to,
    later,
    plan,
)
from kcache_server.models import audit_counts_table as _counts_t
from kcache_server.models import audit_events_table as _events
from kcache_server.models import audit_rollups_table as _rollups

if TYPE_CHECKING:
    from kcache_server.auditing.stats_models import StatsQuery

__all__ = [
    "MAX_KEYED_BUCKETS",
    "Present",
    "counted",
    "epoch",
    "extent",
    "filters",
    "keyed",
    "present_buckets",
    "source",
]

_FILTERS = ("job_id", "client_id", "kernel", "target")


def _within(at: Any, span: Span) -> sa.ColumnElement[bool]:
    lo, hi = span
    return sa.and_(
        sa.true() if lo is None else at >= lo,
        sa.true() if hi is None else at < hi,
    )


def filters(
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


def counted(query: StatsQuery) -> bool:
    """Whether the counts can answer ``query``: they hold one dimension at a time, no filters."""
    return all(getattr(query, name) is None for name in _FILTERS)


#: (dimension, level) -> the first and last bucket of its count rows (None: no rows).
Present = dict[tuple[str, int], tuple[datetime, datetime] | None]
#: The (dimension, level) pairs stats reads for a few group values only: a job's ranks
#: (``job_rank``, for the jobs shown and the divergent recipes' jobs) and its world size.
_KEYED = (("job_rank", DAY), ("job_rank", HOUR), ("job", DAY))
# At most this many buckets are named in one keyed read; a longer span (years of days)
# reads its range instead.
MAX_KEYED_BUCKETS = 2000


def present_buckets(conn: sa.Connection) -> Present:
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


def keyed(
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
    :func:`present_buckets`) bounds the buckets to those that can hold rows.
    """
    in_keys = c.key.in_([encode(k) for k in keys])
    if present is None:
        return sa.false()
    lo, hi = span
    first = present[0] if lo is None else max(present[0], ceil_to(lo, level))
    buckets: list[datetime] = []
    at = first
    while at <= present[1] and (hi is None or at < hi):
        if len(buckets) == MAX_KEYED_BUCKETS:
            return sa.and_(_within(c.bucket, span), in_keys)
        buckets.append(at)
        at = later(at, level)
        if at == LATEST:
            break
    return sa.and_(c.bucket.in_(buckets), in_keys)


def _rolled(hour: datetime) -> sa.ColumnElement[bool]:
    """Some roll-up holds ``hour`` (an index probe on ``audit_rollups.bucket``)."""
    return sa.exists().where(_rollups.c.bucket == hour)


def source(
    query: StatsQuery,
    dim: str | None = None,
    levels: tuple[int, ...] | None = None,
    keys: list[Any] | None = None,
    subtract: bool = True,
    present: Present | None = None,
) -> sa.Subquery:
    """Raw events, roll-ups and (``dim`` given) count rows of ``dim`` as one relation with a weight ``n``.

    Without ``dim``, or where the counts cannot answer ``query`` (:func:`counted`),
    every event of the window is read raw. With it, the window is
    split by :func:`plan` over ``levels`` (default: all of the dimension's); count
    rows carry only their dimension's columns (the others NULL). ``keys`` restricts
    count rows to those first-key values, read by :func:`keyed` with ``present``: a
    filter on a decoded column outside would not reach the index, and a job's per-rank
    rows are many.
    """
    if not counted(query):
        dim = None
    ev, ru = _events.c, _rollups.c
    spans: list[CountSpan] = []
    # One SELECT per raw piece, joined by UNION ALL: each is one range scan of the
    # time index, where an OR of ranges may cost PostgreSQL a scan of every event.
    pieces: list[RawPiece | None] = [None]
    if dim is not None:
        spans, edges = plan(query, LEVELS[dim] if levels is None else levels, subtract)
        pieces = list(edges)
    parts: list[sa.Select[Any]] = []
    for piece in pieces:
        sign = 1 if piece is None else piece.sign
        # Raw events by their time, roll-ups by their hour: the same columns.
        for table, at in ((ev, ev.at), (ru, ru.bucket)):
            conds = filters(query, table, at, None if piece is None else [piece.span])
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
                    else keyed(c, level, span, known[(dim, level)], keys),
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


def epoch(dialect: str, column: Any) -> sa.ColumnElement[Any]:
    # SQLite stores these timestamps as ISO text; PostgreSQL as timestamptz.
    if dialect == "sqlite":
        return sa.cast(sa.func.strftime("%s", column), sa.BigInteger)
    return sa.func.floor(sa.extract("epoch", column))


def extent(conn: sa.Connection, query: StatsQuery) -> tuple[float, float] | None:
    """Unix seconds (floored) of the first and last event or roll-up in the window, None if none.

    Four index probes (``at`` and ``bucket``), whatever the window holds: each
    ``min``/``max`` its own subquery, since SQLite optimises a lone ``min()`` or
    ``max()`` into one probe but scans the whole index for both in one ``SELECT``.
    Where the counts cannot answer ``query`` (:func:`counted`), the ``min`` and ``max``
    of the raw relation (:func:`source`), floored to the second.
    """
    if not counted(query):
        seconds = epoch(conn.dialect.name, source(query).c.at)
        first, last = conn.execute(sa.select(sa.func.min(seconds), sa.func.max(seconds))).one()
        return None if first is None else (float(first), float(last))
    ev, ru = _events.c, _rollups.c
    found: list[datetime] = []
    for table, at in ((_events, ev.at), (_rollups, ru.bucket)):
        first, last = conn.execute(
            sa.select(
                *(
                    sa.select(fn(at)).where(*filters(query, table.c, at)).scalar_subquery()
                    for fn in (sa.func.min, sa.func.max)
                )
            )
        ).one()
        found += [t for t in (first, last) if t is not None]
    if not found:
        return None
    return float(math.floor(min(found).timestamp())), float(math.floor(max(found).timestamp()))
