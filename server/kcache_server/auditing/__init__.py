"""Cache-hit auditing: recording lookups, client events, statistics and retention.

- :mod:`~kcache_server.auditing.writer`: the server's own lookups (one
  ``audit_events`` row per resolve, fetch, compile, error or wait), written in batches;
- :mod:`~kcache_server.auditing.events`: ``POST /v1/events`` bodies from clients
  (node-local hits the server never sees) and their batched insert;
- :mod:`~kcache_server.auditing.stats`: the ``GET /v1/stats`` aggregates (hit rate,
  outcomes by tier, groups, top missed kernels, rank divergence, a time series), with
  its query and answer in :mod:`~kcache_server.auditing.stats_models` and its parts
  in the modules that module lists;
- :mod:`~kcache_server.auditing.retention`: rolling old events up into hourly counts.

``kcache stats``, their terminal view, is a command of the serving wing
(:mod:`~kcache_server.serving.audit_cli`).

Their settings are ``Settings.audit`` (:class:`~kcache_server.settings.AuditSettings`);
:func:`kcache_server.create_app` wires them into the app with everything else.
"""

from typing import TYPE_CHECKING

from kcache.lazy import lazy_exports

if TYPE_CHECKING:  # _LAZY's names, for type checkers (tests/test_lazy_exports.py)
    from kcache.outcomes import HIT_OUTCOMES as HIT_OUTCOMES
    from kcache.outcomes import MISS_OUTCOMES as MISS_OUTCOMES
    from kcache.outcomes import OUTCOMES as OUTCOMES
    from kcache_server.auditing.events import ClientEvent as ClientEvent
    from kcache_server.auditing.events import EventBatch as EventBatch
    from kcache_server.auditing.events import ingest_events as ingest_events
    from kcache_server.auditing.query_times import parse_time as parse_time
    from kcache_server.auditing.retention import roll_up as roll_up
    from kcache_server.auditing.stats import compute_stats as compute_stats
    from kcache_server.auditing.stats_models import Stats as Stats
    from kcache_server.auditing.stats_models import StatsQuery as StatsQuery

# Imported on first use: `kcache stats` is registered (serving.audit_cli) on every run of the
# `kcache` command, which must not load SQLAlchemy and pydantic for that.
_LAZY = {
    **dict.fromkeys(
        ("ClientEvent", "EventBatch", "ingest_events"), "kcache_server.auditing.events"
    ),
    "roll_up": "kcache_server.auditing.retention",
    **dict.fromkeys(("HIT_OUTCOMES", "MISS_OUTCOMES", "OUTCOMES"), "kcache.outcomes"),
    **dict.fromkeys(("Stats", "StatsQuery"), "kcache_server.auditing.stats_models"),
    "compute_stats": "kcache_server.auditing.stats",
    "parse_time": "kcache_server.auditing.query_times",
}

__all__ = [*_LAZY]


__getattr__, __dir__ = lazy_exports("kcache_server.auditing", _LAZY, globals(), __all__)
