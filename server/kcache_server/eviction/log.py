"""The eviction log (the ``evictions`` table): what was removed, read by every replica, pruned.

:meth:`SqlIndex.evict <kcache_server.index.SqlIndex.evict>` writes an entry per artifact in
the transaction that removes its rows, under the one-evictor lock (so entries commit
in ``id`` order). Every replica reads the entries after the last it saw and drops
those artifacts from its memory caches; ``kcache cache info`` and ``/v1/stats`` count
them; entries older than the audit retention are pruned, at most once an hour.
"""

from __future__ import annotations

import time
from datetime import datetime, timedelta

import sqlalchemy as sa
from sqlalchemy.exc import DBAPIError

from kcache_server.index import RemovedArtifact
from kcache_server.models import evictions_table as _evictions
from kcache_server.models import utcnow

__all__ = ["EvictionLog", "evictions_between"]

# How often the eviction log is pruned of rows older than the audit retention.
_PRUNE_EVERY_S = 3600.0
# Entries read per look: a replica catches up in a few polls after a large clear.
_READ_LIMIT = 10_000


class EvictionLog:
    """Reading, counting and pruning the eviction log of one database."""

    def __init__(self, db: sa.Engine, *, retention_days: float = 30.0) -> None:
        self.db = db
        self.retention_days = retention_days
        self._pruned_at = 0.0

    def last_id(self) -> int:
        """The newest entry's id (0 when the log is empty or the database cannot say)."""
        try:
            with self.db.connect() as conn:
                return int(conn.execute(sa.select(sa.func.max(_evictions.c.id))).scalar() or 0)
        except DBAPIError:
            return 0

    def after(self, last_id: int) -> tuple[int, list[RemovedArtifact]]:
        """The artifacts logged after entry ``last_id`` (a bounded number) and the newest id read."""
        with self.db.connect() as conn:
            rows = conn.execute(
                sa.select(_evictions.c.id, _evictions.c.digest, _evictions.c.recipe_keys)
                .where(_evictions.c.id > last_id)
                .order_by(_evictions.c.id)
                .limit(_READ_LIMIT)
            ).all()
        if not rows:
            return last_id, []
        removed = [RemovedArtifact(r.digest, 0, tuple(r.recipe_keys or ())) for r in rows]
        return int(rows[-1].id), removed

    def prune(self) -> None:
        """Delete entries older than the retention, if the last prune is an hour old."""
        now = time.monotonic()
        if self.retention_days <= 0 or now - self._pruned_at < _PRUNE_EVERY_S:
            return
        self._pruned_at = now
        horizon = utcnow() - timedelta(days=self.retention_days)
        with self.db.begin() as conn:
            conn.execute(sa.delete(_evictions).where(_evictions.c.at < horizon))

    def totals(self) -> tuple[int, int]:
        """Evictions and bytes freed, as far back as the log goes."""
        return evictions_between(self.db, None, None)


def evictions_between(
    db: sa.Engine, since: datetime | None, until: datetime | None
) -> tuple[int, int]:
    """Evictions and bytes freed whose time lies in ``[since, until)`` (either end open)."""
    conds: list[sa.ColumnElement[bool]] = []
    if since is not None:
        conds.append(_evictions.c.at >= since)
    if until is not None:
        conds.append(_evictions.c.at < until)
    with db.connect() as conn:
        count, freed = conn.execute(
            sa.select(sa.func.count(), sa.func.coalesce(sa.func.sum(_evictions.c.size), 0)).where(
                *conds
            )
        ).one()
    return int(count), int(freed)
