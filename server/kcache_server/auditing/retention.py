"""Retention: audit events older than the window become hourly counts, not gaps.

One roll-up is one transaction: aggregate the old events per hour and per
(outcome, tier, kernel, target, client, job, rank, reporter) into ``audit_rollups``, then
delete exactly the events it counted (by id, up to the largest id it read), so an
event written meanwhile is neither lost nor counted twice. Roll-up rows are only
inserted, never merged, so two replicas rolling up at once stay correct: their
rows cover disjoint events and simply add up in :mod:`~kcache_server.auditing.stats`.

What a roll-up keeps: counts, compile time saved, latency sums, the time and
error code of the last event of each group. What it drops: digests and keys of
single events, so rank divergence is only reported inside the retention window, and
the kernel lookups (``audit_lookups``, :mod:`~kcache_server.auditing.lookups`) first
made before the cutoff, with the jobs' compiles recorded before it: the hit rate, the
compiles avoided and the miss reasons cover the retention window, as raw events do
(older windows still show their requests, from the counts).

The counts ``/v1/stats`` sums (:mod:`~kcache_server.auditing.counts`) already hold
every event, raw or rolled up, so a roll-up leaves them alone; stats reads roll-ups
only where it reads raw events (the partial hours at a window's edges, filtered
queries, the last miss of a kernel with no raw miss left). Divergence candidates
whose events are all gone are dropped after the roll-up.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

import sqlalchemy as sa

from kcache_server.auditing.counts import decode
from kcache_server.models import audit_digests_table as _digests
from kcache_server.models import audit_divergences_table as _divergences
from kcache_server.models import audit_events_table as _events
from kcache_server.models import audit_job_builds_table as _builds
from kcache_server.models import audit_lookups_table as _lookups
from kcache_server.models import audit_rollups_table as _rollups

__all__ = ["RetentionWorker", "roll_up"]

log = logging.getLogger(__name__)

_KEYS = ("outcome", "tier", "kernel", "target", "client_id", "job_id", "rank", "reporter")
# Events rolled up per transaction: bounds the transaction's size and lock time.
_CHUNK = 50_000


def _hour(at: datetime) -> datetime:
    return at.astimezone(timezone.utc).replace(minute=0, second=0, microsecond=0)


def _roll_chunk(engine: sa.Engine, cutoff: datetime) -> int:
    ev = _events.c
    with engine.begin() as conn:
        # One DELETE ... RETURNING: on SQLite the write lock must come before any read
        # (a reader cannot upgrade once another writer has committed), and the
        # returned rows are exactly the events this transaction owns.
        oldest = sa.select(ev.id).where(ev.at < cutoff).order_by(ev.id).limit(_CHUNK)
        rows = conn.execute(
            sa.delete(_events)
            .where(ev.id.in_(oldest.scalar_subquery()))
            .returning(
                ev.at,
                ev.error,
                ev.latency_ms,
                ev.compile_seconds_saved,
                ev["count"],
                *(ev[k] for k in _KEYS),
            )
        ).all()
        if not rows:
            return 0
        groups: dict[tuple[Any, ...], dict[str, Any]] = {}
        for row in rows:
            key = (_hour(row.at), *(getattr(row, k) for k in _KEYS))
            group = groups.get(key)
            if group is None:
                group = groups[key] = {
                    "bucket": key[0],
                    **{k: getattr(row, k) for k in _KEYS},
                    "count": 0,
                    "latency_ms_sum": 0.0,
                    "compile_seconds_saved": 0.0,
                    "last_at": row.at,
                    "last_error": row.error,
                }
            group["count"] += row.count
            group["latency_ms_sum"] += row.latency_ms * row.count  # a tallied row holds the mean
            group["compile_seconds_saved"] += row.compile_seconds_saved
            if row.at >= group["last_at"]:
                group["last_at"] = row.at
                group["last_error"] = row.error or group["last_error"]
        conn.execute(sa.insert(_rollups), list(groups.values()))
        return len(rows)


def roll_up(engine: sa.Engine, older_than: datetime) -> int:
    """Replace every audit event before ``older_than`` by hourly counts; returns events rolled up."""
    if older_than.tzinfo is None:
        raise ValueError("older_than must be timezone-aware")
    total = 0
    while True:
        n = _roll_chunk(engine, older_than)
        total += n
        if n < _CHUNK:
            break
    _forget_digests(engine, older_than)
    _forget_lookups(engine, older_than)
    return total


def _forget_lookups(engine: sa.Engine, older_than: datetime) -> None:
    """Delete kernel lookups and job compiles recorded before ``older_than``, a chunk a transaction."""
    lk, jb = _lookups.c, _builds.c
    while True:
        with engine.begin() as conn:
            oldest = sa.select(lk.id).where(lk.at < older_than).order_by(lk.id).limit(_CHUNK)
            gone = conn.execute(sa.delete(_lookups).where(lk.id.in_(oldest.scalar_subquery())))
        if gone.rowcount < _CHUNK:
            break
    with engine.begin() as conn:
        conn.execute(sa.delete(_builds).where(jb.at < older_than))


def _forget_digests(engine: sa.Engine, older_than: datetime) -> None:
    """Drop divergence candidates last seen before ``older_than`` that no raw event backs any more.

    A recipe left with fewer than two digests leaves ``audit_divergences`` with them.

    The ``NOT EXISTS`` keeps a row whose old event (a client's late report, say)
    arrived after the roll-up read its chunk: a candidate is only dropped once no
    event could make it a divergence.
    """
    ev, dg = _events.c, _digests.c
    backed = sa.exists().where(
        ev.job_id == dg.job_id,
        ev.base_key == dg.base_key,
        ev.target.is_not_distinct_from(decode(dg.target)),
        ev.digest == dg.digest,
    )
    dv = _divergences.c
    digests_left = (
        sa.select(sa.func.count())
        .where(dg.job_id == dv.job_id, dg.base_key == dv.base_key, dg.target == dv.target)
        .scalar_subquery()
    )
    with engine.begin() as conn:
        conn.execute(sa.delete(_digests).where(dg.last_at < older_than, ~backed))
        # A divergence needs two digests; the table is small (divergent recipes only).
        conn.execute(sa.delete(_divergences).where(digests_left < 2))


class RetentionWorker:
    """A daemon thread that rolls up events older than ``retention_days`` every ``interval_s``."""

    def __init__(
        self,
        engine: sa.Engine,
        retention_days: float,
        interval_s: float,
        clock: Callable[[], datetime] = lambda: datetime.now(timezone.utc),
    ) -> None:
        self.engine = engine
        self.retention = timedelta(days=retention_days)
        self.interval_s = interval_s
        self.clock = clock
        self.rolled_up = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._guard = threading.Lock()

    def start(self) -> None:
        """Start the thread (once; later calls do nothing)."""
        with self._guard:
            if self._thread is not None or not self.retention:
                return
            self._thread = threading.Thread(
                target=self._loop, name="kcache-audit-retention", daemon=True
            )
            self._thread.start()

    def run_once(self) -> int:
        """Roll up now; returns the number of events rolled up."""
        n = roll_up(self.engine, self.clock() - self.retention)
        self.rolled_up += n
        return n

    def close(self) -> None:
        """Stop the thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _loop(self) -> None:
        while True:
            try:
                self.run_once()
            except Exception:  # a database hiccup must not end retention; try next time
                log.exception("rolling up audit events failed")
            if self._stop.wait(self.interval_s):
                return
