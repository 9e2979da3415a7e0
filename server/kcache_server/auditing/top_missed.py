"""``top_missed`` of ``/v1/stats``: the kernels that missed most, and why each missed last.

The ranking is one ``GROUP BY`` over the window's kernel lookups
(:func:`~kcache_server.auditing.lookup_stats.read_missed_kernels`: misses counted as
every figure counts them); each top kernel's last miss
is an index probe on the raw events, backwards on ``(kernel, at, id)``, with why it
had to be built decided from what was seen before it (evicted, headers changed, a
first build), and a roll-up's for kernels whose misses in the window are all rolled
up. A fixed number of statements, however many kernels.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from kcache.outcomes import MISS_OUTCOMES
from kcache_server.auditing.lookup_stats import read_missed_kernels
from kcache_server.auditing.lookups import ERROR_REASONS, REASONS, reason_text
from kcache_server.auditing.stats_models import MissedKernel, StatsQuery
from kcache_server.auditing.window_source import filters
from kcache_server.models import audit_events_table as _events
from kcache_server.models import audit_rollups_table as _rollups

__all__ = ["read_top_missed"]


def read_top_missed(conn: sa.Connection, query: StatsQuery) -> list[MissedKernel]:
    """The kernels with the most missed kernel lookups, each with its misses and its last miss.

    The ranking and the counts are kernel lookups (:mod:`~kcache_server.auditing.lookups`:
    one per process and recipe, the same misses every figure counts), by first outcome
    and by reason; the last miss is the last miss event of the kernel in the window.
    Three statements, however many kernels: the ranking with its counts, the last raw
    miss of every top kernel, and (only when some top kernel has no raw miss in the
    window) the last rolled-up one.
    """
    result = [
        MissedKernel(
            kernel=m.kernel,
            misses=m.misses,
            errors=m.outcomes.get("error", 0),
            outcomes=m.outcomes,
            reasons=m.reasons,
        )
        for m in read_missed_kernels(conn, query)
    ]
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
                *filters(query, ev, ev.at),
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
            *filters(query, ru, ru.bucket),
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
    """A short sentence a person can act on (the words of :data:`~kcache_server.auditing.lookups.REASONS`)."""
    if outcome == "error":
        return ERROR_REASONS.get(error or "", (error or "error").replace("_", " "))
    if outcome == "miss":
        code = "not_cached" if error in (None, "not_found") else f"miss:{error}"
        return reason_text(code) or code
    if outcome == "bypass":  # the client's word: the adapter's library compiled it
        return reason_text(f"bypass:{error or ''}") or "bypass"
    if outcome == "late":  # a frozen client's lookup outside its warmup
        return REASONS["late"]
    if history == "evicted":
        why = REASONS["evicted"]
    elif history == "headers":
        why = REASONS["headers_changed"]
    else:
        why = REASONS["first_build"]
    # A waiter compiled nothing: it joined a compile already running (its starter may
    # have been interrupted since), which was needed for the reason found before the wait.
    return f"{REASONS['joined_compile']}: {why}" if outcome == "waited" else why


def _ms_between(dialect: str, earlier: Any, later: Any) -> sa.ColumnElement[Any]:
    """Milliseconds from ``earlier`` to ``later`` (two timestamp columns), in SQL."""
    if dialect == "sqlite":  # ISO text with microseconds: julianday reads the fraction
        return (sa.func.julianday(later) - sa.func.julianday(earlier)) * 86_400_000.0
    return sa.extract("epoch", later - earlier) * 1000.0
