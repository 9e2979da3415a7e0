"""Cache-hit auditing: client events, statistics, retention and the dashboard's data.

The server's own lookups are recorded by :mod:`kcache_server.audit` (one
``audit_events`` row per resolve, fetch, compile, error or wait). This package
adds what is built on top of those rows:

- :mod:`~kcache_server.auditing.events`: ``POST /v1/events`` bodies from clients
  (node-local hits the server never sees) and their batched insert;
- :mod:`~kcache_server.auditing.stats`: the ``GET /v1/stats`` aggregates (hit rate,
  outcomes by tier, groups, top missed kernels, rank divergence, a time series);
- :mod:`~kcache_server.auditing.retention`: rolling old events up into hourly counts;
- :mod:`~kcache_server.auditing.install`: wiring all of it (and ``/metrics``,
  ``/dashboard``) into an app.
"""

from kcache_server.auditing.events import ClientEvent, EventBatch, ingest_events
from kcache_server.auditing.retention import roll_up
from kcache_server.auditing.settings import AuditSettings
from kcache_server.auditing.stats import (
    HIT_OUTCOMES,
    MISS_OUTCOMES,
    OUTCOMES,
    Stats,
    StatsQuery,
    compute_stats,
    parse_time,
)

__all__ = [
    "HIT_OUTCOMES",
    "MISS_OUTCOMES",
    "OUTCOMES",
    "AuditSettings",
    "ClientEvent",
    "EventBatch",
    "Stats",
    "StatsQuery",
    "compute_stats",
    "ingest_events",
    "parse_time",
    "roll_up",
]
