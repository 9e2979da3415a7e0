"""Audit counts kept as events are written: what ``/v1/stats`` sums instead of scanning events.

Every write of audit events (the server's writer, clients' ``POST /v1/events``) goes
through :func:`write_events`, which in the same transaction inserts the events and
adds them to two narrow tables, so counts and events never disagree:

- ``audit_counts``: per time bucket, dimension and group value, the lookups by outcome
  (``count``) and the compile time they saved. Dimensions are ``all`` (by outcome and
  tier: totals and the series), ``kernel``, ``target``, ``client``, ``job``, ``rank``,
  ``job_rank`` (a job's per-rank breakdown) and ``reporter`` (the token that posted a
  client report; counted for reported events only, :data:`SPARSE`); buckets are hours and UTC days, and
  minutes for ``all`` (series steps under an hour). A group value is stored encoded
  (:func:`encode`: ``""`` for NULL, ``"=" + value`` otherwise) so that the primary
  key has no NULL and ``INSERT ... ON CONFLICT DO UPDATE SET count = count +
  excluded.count`` merges concurrent writers on SQLite and PostgreSQL alike.
- ``audit_digests``: one row per (job, base key, target, digest) ever seen, with the
  first and last time, and ``audit_divergences``: the (job, base key, target) that
  have two such rows, marked as the second digest arrives (:func:`mark_divergences`),
  so rank divergence starts from those few recipes instead of grouping every pair
  ever seen (stats confirms them against the raw events by index probes).

The counts cover every event ever written, raw or since rolled up by retention
(:mod:`~kcache_server.auditing.retention` moves events into ``audit_rollups`` and
leaves the counts alone), so stats never adds roll-ups to counts. :func:`rebuild`
computes the same tables from ``audit_events`` and ``audit_rollups`` in bulk SQL
(migration 0007's backfill, the B10 bench's fill); tests/audit/test_counts.py checks
that it equals what the writer maintained. One difference by construction: a
roll-up keeps only the hour, so rebuilt minute counts place rolled-up events at
their hour's start, where the writer had put them at their minute.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timezone
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from kcache_server.auditing.lookups import record_lookups
from kcache_server.models import audit_counts_table as _counts
from kcache_server.models import audit_digests_table as _digests
from kcache_server.models import audit_divergences_table as _divergences
from kcache_server.models import audit_events_table as _events
from kcache_server.models import audit_rollups_table as _rollups

__all__ = [
    "DIMENSIONS",
    "LEVELS",
    "SPARSE",
    "decode",
    "encode",
    "mark_divergences",
    "rebuild",
    "write_events",
]


MINUTE, HOUR, DAY = 60, 3600, 86400
#: dimension -> (first key column, second key column) of ``audit_events`` ("" for none).
DIMENSIONS: dict[str, tuple[str, str]] = {
    "all": ("", ""),
    "kernel": ("kernel", ""),
    "target": ("target", ""),
    "client": ("client_id", ""),
    "job": ("job_id", ""),
    "rank": ("rank", ""),
    "job_rank": ("job_id", "rank"),
    "reporter": ("reporter", ""),
}
#: Dimensions counted only for events whose key is not NULL: the server's own events
#: (the writer's hot path) name no reporter, and would only add rows under "".
SPARSE = frozenset({"reporter"})
#: dimension -> bucket widths (seconds) it is counted at, coarsest first.
LEVELS: dict[str, tuple[int, ...]] = {
    dim: (DAY, HOUR, MINUTE) if dim == "all" else (DAY, HOUR) for dim in DIMENSIONS
}
_COUNT_KEY = ("dim", "level", "bucket", "key", "key2", "outcome", "tier")
_DIGEST_KEY = ("job_id", "base_key", "target", "digest")
_RECIPE_KEY = ("job_id", "base_key", "target")
# Recipes per statement that marks divergences: 3 parameters each, under SQLite's 32,766.
_RECIPES_PER_STATEMENT = 5000


def encode(value: object) -> str:
    """A group value as stored in a key column: ``""`` for NULL, ``"=" + str(value)`` otherwise."""
    return "" if value is None else f"={value}"


def decode(column: Any, as_int: bool = False) -> sa.ColumnElement[Any]:
    """SQL reading an :func:`encode` d key column back (NULL for ``""``)."""
    value: sa.ColumnElement[Any] = sa.func.substr(column, 2)
    if as_int:
        value = sa.cast(value, sa.BigInteger)
    return sa.case((column == "", sa.null()), else_=value)


def _count_rows(events: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The increments of ``audit_counts`` that ``events`` make, merged, in key order.

    Buckets are unix seconds while merging (each event's time is read once, not once
    per dimension and level) and become datetimes only for the merged rows.
    """
    rows: dict[tuple[Any, ...], list[Any]] = {}  # key -> [count, saved, world_size]
    levels = sorted({level for dim_levels in LEVELS.values() for level in dim_levels})
    for e in events:
        # A row may leave out nullable columns, as an INSERT may.
        n, saved = int(e.get("count", 1)), float(e.get("compile_seconds_saved", 0.0))
        size = e.get("world_size")
        seconds = math.floor(e["at"].timestamp())
        floors = {level: seconds - seconds % level for level in levels}
        outcome = e["outcome"]
        for dim, (first, second) in DIMENSIONS.items():
            if dim in SPARSE and e.get(first) is None:
                continue
            key = encode(e.get(first)) if first else ""
            key2 = encode(e.get(second)) if second else ""
            tier = e["tier"] if dim == "all" else ""
            for level in LEVELS[dim]:
                k = (dim, level, floors[level], key, key2, outcome, tier)
                row = rows.get(k)
                if row is None:
                    row = rows[k] = [0, 0.0, None]
                row[0] += n
                row[1] += saved
                if dim == "job" and size is not None:
                    row[2] = size if row[2] is None else max(size, row[2])
    return [
        {
            **dict(
                zip(
                    _COUNT_KEY,
                    (*k[:2], datetime.fromtimestamp(k[2], timezone.utc), *k[3:]),
                    strict=True,
                )
            ),
            "count": rows[k][0],
            "saved": rows[k][1],
            "world_size": rows[k][2],
        }
        for k in sorted(rows)
    ]


def _digest_rows(events: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    rows: dict[tuple[Any, ...], dict[str, Any]] = {}
    for e in events:
        if e.get("job_id") is None or e.get("base_key") is None or e.get("digest") is None:
            continue
        k = (e["job_id"], e["base_key"], encode(e.get("target")), e["digest"])
        row = rows.get(k)
        if row is None:
            rows[k] = {
                **dict(zip(_DIGEST_KEY, k, strict=True)),
                "first_at": e["at"],
                "last_at": e["at"],
            }
        else:
            row["first_at"] = min(row["first_at"], e["at"])
            row["last_at"] = max(row["last_at"], e["at"])
    return [rows[k] for k in sorted(rows)]


def _insert(conn: sa.Connection, table: sa.Table) -> Any:
    dialect = postgresql if conn.dialect.name == "postgresql" else sqlite
    return dialect.insert(table)


def _upsert_counts(conn: sa.Connection) -> Any:
    stmt = _insert(conn, _counts)
    old, new = _counts.c, stmt.excluded
    larger = sa.case(
        (new.world_size.is_(None), old.world_size),
        (old.world_size.is_(None), new.world_size),
        (new.world_size > old.world_size, new.world_size),
        else_=old.world_size,
    )
    return stmt.on_conflict_do_update(
        index_elements=list(_COUNT_KEY),
        set_={
            "count": old["count"] + new["count"],
            "saved": old.saved + new.saved,
            "world_size": larger,
        },
    )


def _upsert_digests(conn: sa.Connection) -> Any:
    stmt = _insert(conn, _digests)
    old, new = _digests.c, stmt.excluded
    return stmt.on_conflict_do_update(
        index_elements=list(_DIGEST_KEY),
        set_={
            "first_at": sa.case((new.first_at < old.first_at, new.first_at), else_=old.first_at),
            "last_at": sa.case((new.last_at > old.last_at, new.last_at), else_=old.last_at),
        },
    )


def write_events(conn: sa.Connection, rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Insert ``rows`` into ``audit_events``, add them to the counts and record the kernel
    lookups they start, in ``conn``'s transaction; returns those kernel lookups.

    Each row names every column of ``audit_events`` but ``id``. Upserts go in key
    order, so concurrent writers on PostgreSQL lock count rows in one order and
    cannot deadlock each other. The kernel lookups (:mod:`~kcache_server.auditing.lookups`)
    are what every hit rate counts; the caller counts the new ones in its metrics.
    """
    if not rows:
        return []
    conn.execute(sa.insert(_events), list(rows))
    conn.execute(_upsert_counts(conn), _count_rows(rows))
    digests = _digest_rows(rows)
    if digests:
        conn.execute(_upsert_digests(conn), digests)
        mark_divergences(conn, sorted({tuple(d[k] for k in _RECIPE_KEY) for d in digests}))
    return record_lookups(conn, rows)


def mark_divergences(conn: sa.Connection, recipes: Sequence[tuple[Any, ...]] | None) -> None:
    """Add to ``audit_divergences`` those of ``recipes`` (None: all) with two digests in ``audit_digests``.

    A recipe is (job id, base key, encoded target). One statement per few thousand
    recipes, reading only their ``audit_digests`` rows (primary-key prefix probes).
    """
    dg = _digests.c
    recipe = (dg.job_id, dg.base_key, dg.target)
    chunks: list[Sequence[tuple[Any, ...]] | None] = (
        [None]
        if recipes is None
        else [
            recipes[i : i + _RECIPES_PER_STATEMENT]
            for i in range(0, len(recipes), _RECIPES_PER_STATEMENT)
        ]
    )
    for chunk in chunks:
        pick = sa.select(*recipe).where(
            sa.true() if chunk is None else sa.tuple_(*recipe).in_(chunk)
        )
        stmt = _insert(conn, _divergences).from_select(
            list(_RECIPE_KEY), pick.group_by(*recipe).having(sa.func.count() > 1)
        )
        conn.execute(stmt.on_conflict_do_nothing())


# ---------------------------------------------------------------------- bulk rebuild
def _bucket_sql(conn: sa.Connection, column: Any, level: int) -> sa.ColumnElement[Any]:
    """``column`` floored to ``level`` seconds in UTC, stored as ``UTCDateTime`` stores it."""
    if conn.dialect.name == "postgresql":
        unit = {MINUTE: "minute", HOUR: "hour", DAY: "day"}[level]
        return sa.func.date_trunc(unit, column, "UTC")
    # SQLite keeps "YYYY-MM-DD HH:MM:SS.ffffff" text: cutting it is several times
    # cheaper than strftime, which parses every row.
    keep, pad = {MINUTE: (16, ":00.000000"), HOUR: (13, ":00:00.000000")}.get(
        level, (10, " 00:00:00.000000")
    )
    return sa.func.substr(column, 1, keep, type_=sa.String()).concat(pad)


def _encode_sql(column: Any) -> sa.ColumnElement[Any]:
    text = sa.cast(column, sa.Text) if isinstance(column.type, sa.Integer) else column
    return sa.case((column.is_(None), ""), else_=sa.literal("=") + text)


def rebuild(conn: sa.Connection) -> None:
    """Recompute ``audit_counts``, ``audit_digests`` and ``audit_divergences`` from events and roll-ups (bulk SQL).

    The same rows :func:`write_events` would have made (see the module docstring for
    the one difference); used by migration 0007 and the B10 bench. Each dimension's
    finest level is read from the events, its coarser ones from that level's rows.
    Migration 0007 runs it on a database without the ``reporter`` columns (0013): the
    ``reporter`` dimension is left out there, as no event of that time names one.
    """
    conn.execute(sa.delete(_counts))
    conn.execute(sa.delete(_digests))
    conn.execute(sa.delete(_divergences))
    ev, ru = _events.c, _rollups.c
    reporters = "reporter" in {c["name"] for c in sa.inspect(conn).get_columns("audit_events")}
    columns: tuple[str, ...] = (
        "outcome",
        "tier",
        "kernel",
        "target",
        "client_id",
        "job_id",
        "rank",
    )
    columns += ("reporter",) if reporters else ()
    dimensions = {d: cols for d, cols in DIMENSIONS.items() if reporters or d != "reporter"}
    src = sa.union_all(
        sa.select(
            ev.at.label("at"),
            *(ev[c] for c in columns),
            ev["count"].label("n"),
            ev.compile_seconds_saved.label("saved"),
            ev.world_size.label("world_size"),
        ),
        sa.select(
            ru.bucket.label("at"),
            *(ru[c] for c in columns),
            ru["count"].label("n"),
            ru.compile_seconds_saved.label("saved"),
            sa.cast(sa.null(), sa.Integer).label("world_size"),
        ),
    ).subquery("src")
    target = [*_COUNT_KEY, "count", "saved", "world_size"]
    for dim, (first, second) in dimensions.items():
        finest, *coarser = LEVELS[dim][::-1]
        bucket = _bucket_sql(conn, src.c.at, finest)
        key = _encode_sql(src.c[first]) if first else sa.literal("")
        key2 = _encode_sql(src.c[second]) if second else sa.literal("")
        tier = src.c.tier if dim == "all" else sa.literal("")
        size = sa.func.max(src.c.world_size) if dim == "job" else sa.cast(sa.null(), sa.Integer)
        group = (bucket, key, key2, src.c.outcome, tier)
        conn.execute(
            sa.insert(_counts).from_select(
                target,
                sa.select(
                    sa.literal(dim),
                    sa.literal(finest),
                    *group,
                    sa.func.sum(src.c.n),
                    sa.func.sum(src.c.saved),
                    size,
                )
                .where(src.c[first].is_not(None) if dim in SPARSE else sa.true())
                .group_by(*group)
                # In primary-key order: the index grows at its end instead of at random.
                .order_by(*group),
            )
        )
        co = _counts.c
        for level in coarser:
            bucket = _bucket_sql(conn, co.bucket, level)
            group = (bucket, co.key, co.key2, co.outcome, co.tier)
            conn.execute(
                sa.insert(_counts).from_select(
                    target,
                    sa.select(
                        sa.literal(dim),
                        sa.literal(level),
                        *group,
                        sa.func.sum(co["count"]),
                        sa.func.sum(co.saved),
                        sa.func.max(co.world_size),
                    )
                    .where(co.dim == dim, co.level == finest)
                    .group_by(*group)
                    .order_by(*group),
                )
            )
    recipe = (ev.job_id, ev.base_key, _encode_sql(ev.target), ev.digest)
    conn.execute(
        sa.insert(_digests).from_select(
            [*_DIGEST_KEY, "first_at", "last_at"],
            sa.select(*recipe, sa.func.min(ev.at), sa.func.max(ev.at))
            .where(ev.job_id.is_not(None), ev.base_key.is_not(None), ev.digest.is_not(None))
            .group_by(*recipe),
        )
    )
    mark_divergences(conn, None)
