"""Fetches nginx answered from its cache, audited as the replica's own (``edge_log``).

:func:`install_edge_audit` builds the tailer of nginx's edge log
(:mod:`kcache_server.auditing.edge_log`) for the app: each group of alike lines becomes
the ``fetch`` row the route records for a fetch it answers, counted in the lookups'
metrics, plus a counter of the lines read by result. A line counts only when the index
knows its recipe key bound to its digest: anyone who can write the file can write lines
in the format, and a forged line must not pass for a hit (``unknown`` counts the rest).
"""

from __future__ import annotations

import logging
import time
from datetime import datetime, timezone

from prometheus_client import Counter

from kcache.artifact import ArtifactMeta
from kcache_server.auditing.edge_log import EdgeHit, EdgeLogTailer
from kcache_server.auditing.writer import AuditRecord
from kcache_server.state import ServerState

__all__ = ["install_edge_audit"]

log = logging.getLogger(__name__)


def install_edge_audit(state: ServerState) -> EdgeLogTailer | None:
    """The tailer of nginx's edge log (``edge_log``), auditing each cached fetch as the route would.

    Each group of alike lines becomes one ``fetch`` row of outcome ``hit`` with their
    ``count`` (the row :meth:`~kcache_server.resolving.Resolver.record_fetch` tallies
    for the replica's own fetches), counted as that many lookups in the metrics (the
    audit's listener counts a row's ``count``), when the index knows the line's recipe
    key as bound to its digest; other lines (a key it never served, another digest, or
    the index unreachable to say) are not recorded.
    """
    path = state.settings.edge_log
    if path is None:
        return None
    resolver, index, audit = state.resolver, state.backends.index, state.audit

    def meta_of(hit: EdgeHit, looked_up: dict[str, ArtifactMeta | None]) -> ArtifactMeta | None:
        meta = resolver.cached_artifact(hit.recipe_key)
        if meta is None:
            if hit.recipe_key not in looked_up:
                try:
                    entry = index.lookup(hit.recipe_key)
                except Exception as exc:  # the database is away: nothing says the line is true
                    log.warning(
                        "edge log: looking up %s failed, its lines are not counted: %s",
                        hit.recipe_key,
                        exc,
                    )
                    entry = None
                looked_up[hit.recipe_key] = entry if isinstance(entry, ArtifactMeta) else None
            meta = looked_up[hit.recipe_key]
        return meta if meta is not None and meta.digest == hit.digest else None

    def record(hits: list[EdgeHit]) -> int:
        looked_up: dict[str, ArtifactMeta | None] = {}
        recorded = 0
        for hit in hits:
            meta = meta_of(hit, looked_up)
            if meta is None:  # a key or digest the index does not know: no fetch it answered
                continue
            recorded += hit.count
            audit.record(
                AuditRecord(
                    outcome="hit",
                    route="fetch",
                    latency_ms=hit.latency_ms,
                    recipe_key=hit.recipe_key,
                    digest=hit.digest,
                    kernel=meta.kernel,
                    target=meta.target,
                    toolchain=meta.toolchain,
                    compile_seconds_saved=meta.compile_seconds * hit.count,
                    count=hit.count,
                    at=datetime.fromtimestamp(min(hit.at, time.time()), timezone.utc),
                )
            )
        return recorded

    tailer = EdgeLogTailer(path, state.settings.data_dir / "locks", record)
    lines = Counter(
        "kcache_edge_log_lines",
        "Lines of nginx's edge log read by this process, by result (hit: audited as a fetch; "
        "unknown: a recipe key or digest the index does not know, not audited; ignored: no "
        "fetch; bad: not in the format, skipped)",
        ["result"],
        registry=state.metrics.registry,
    )
    tailer.listeners.append(lambda what, n: lines.labels(result=what).inc(n))
    return tailer
