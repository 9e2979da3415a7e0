"""Wiring auditing into an app: routes, the request-metrics middleware, gauges, retention.

``install_auditing(app, state)`` is the one call the app factory makes; everything
it adds lives in this package, :mod:`kcache_server.metrics` and the routes
``events``, ``stats``, ``metrics`` and ``dashboard``.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, cast

import anyio
import sqlalchemy as sa
from fastapi import FastAPI, Request

from kcache_server.audit import AuditRecord
from kcache_server.auditing.retention import RetentionWorker
from kcache_server.auditing.settings import AuditSettings
from kcache_server.metrics import MetricsMiddleware, ServerMetrics
from kcache_server.models import Artifact
from kcache_server.service import ServerState

__all__ = ["Auditing", "get_auditing", "install_auditing"]


@dataclass
class Auditing:
    """What the auditing routes need, kept on ``app.state.auditing``."""

    settings: AuditSettings
    metrics: ServerMetrics
    retention: RetentionWorker


def auditing_of(request: Request) -> Auditing:
    """The app's :class:`Auditing`."""
    auditing: Auditing = request.app.state.auditing
    return auditing


async def get_auditing(request: Request) -> Auditing:
    """:func:`auditing_of` as a dependency (async: FastAPI runs sync dependencies on threads)."""
    return auditing_of(request)


def _store_sampler(db: sa.Engine, metrics: ServerMetrics) -> Any:
    artifacts = cast(sa.Table, Artifact.__table__)

    def sample() -> None:
        with db.connect() as conn:
            count, size = conn.execute(
                sa.select(sa.func.count(), sa.func.coalesce(sa.func.sum(artifacts.c.size), 0))
            ).one()
        metrics.store_artifacts.set(count)
        metrics.store_bytes.set(size)

    return sample


def _pool_sampler(state: ServerState, metrics: ServerMetrics) -> Any:
    compiler = state.backends.compiler

    def sample() -> None:
        # The pool counts compiles running or queued; beyond its workers they queue.
        pending = int(getattr(compiler, "pending", getattr(compiler, "_pending", 0)))
        metrics.compiles_in_flight.set(pending)
        metrics.queue_depth.set(max(0, pending - compiler.workers))

    return sample


def install_auditing(
    app: FastAPI, state: ServerState, settings: AuditSettings | None = None
) -> Auditing:
    """Add ``/v1/events``, ``/v1/stats``, ``/metrics`` and ``/dashboard`` to ``app``."""
    from kcache_server.routes import dashboard, events, metrics, stats

    settings = settings or AuditSettings()
    server_metrics = ServerMetrics()
    retention = RetentionWorker(
        state.backends.db, settings.retention_days, settings.rollup_interval_s
    )
    auditing = Auditing(settings, server_metrics, retention)
    app.state.auditing = auditing
    for router in (events.router, stats.router, metrics.router, dashboard.router):
        app.include_router(router)
    app.add_middleware(MetricsMiddleware, metrics=server_metrics)
    server_metrics.add_sampler(_store_sampler(state.backends.db, server_metrics))
    server_metrics.add_sampler(_pool_sampler(state, server_metrics))

    def count(record: AuditRecord) -> None:
        server_metrics.lookup(record.outcome, record.tier, latency_ms=record.latency_ms)

    state.audit.listeners.append(count)

    def dropped(_: AuditRecord, reason: str) -> None:
        server_metrics.audit_rows_dropped.labels(reason=reason).inc()

    state.audit.drop_listeners.append(dropped)

    # Retention runs for as long as the app serves: wrap the app's own lifespan.
    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(a: FastAPI) -> AsyncIterator[Any]:
        async with inner(a) as value:
            retention.start()
            try:
                yield value
            finally:
                await anyio.to_thread.run_sync(retention.close)

    app.router.lifespan_context = lifespan
    return auditing
