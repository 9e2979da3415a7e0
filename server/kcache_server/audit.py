"""Audit events: one row per lookup outcome, written in batches off the request path.

Requests only append to an in-memory queue; a background thread inserts what has
gathered every ``flush_s`` seconds (and on shutdown), and bumps ``last_used_at``
of the artifacts that were served. A crash can lose the last fraction of a second
of events, never an artifact.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import cast

import sqlalchemy as sa

from kcache_server.models import Artifact, AuditEvent, utcnow

__all__ = ["AuditLog", "AuditRecord"]

log = logging.getLogger(__name__)
_events = cast(sa.Table, AuditEvent.__table__)
_artifacts = cast(sa.Table, Artifact.__table__)


@dataclass
class AuditRecord:
    """One event (the columns of ``audit_events``)."""

    outcome: str
    route: str
    latency_ms: float
    tier: str = "server"
    recipe_key: str | None = None
    base_key: str | None = None
    digest: str | None = None
    kernel: str | None = None
    target: str | None = None
    toolchain: str | None = None
    error: str | None = None
    client_id: str | None = None
    host: str | None = None
    pid: int | None = None
    job_id: str | None = None
    rank: int | None = None
    world_size: int | None = None
    compile_seconds_saved: float = 0.0
    at: datetime = field(default_factory=utcnow)


class AuditLog:
    """Buffers :class:`AuditRecord` s and writes them in batches."""

    def __init__(self, engine: sa.Engine, flush_s: float = 0.5) -> None:
        self.engine = engine
        self.flush_s = flush_s
        self._queue: queue.SimpleQueue[AuditRecord] = queue.SimpleQueue()
        self._flush_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # Called with every record (e.g. Prometheus counters); must be quick and not raise.
        self.listeners: list[Callable[[AuditRecord], None]] = []

    def record(self, event: AuditRecord) -> None:
        """Queue ``event`` (never blocks on the database)."""
        self._queue.put(event)
        for listener in self.listeners:
            listener(event)

    def start(self) -> None:
        """Start the background writer."""
        self._thread = threading.Thread(target=self._loop, name="kcache-audit", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the writer and write what is left."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.flush()

    def _loop(self) -> None:
        while not self._stop.wait(self.flush_s):
            try:
                self.flush()
            except Exception:  # a database hiccup must not kill the writer; retry next tick
                log.exception("writing audit events failed")

    def flush(self) -> int:
        """Write every queued event now; returns how many."""
        with self._flush_lock:
            batch: list[AuditRecord] = []
            while True:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            if not batch:
                return 0
            used = sorted({e.digest for e in batch if e.digest and e.outcome in ("hit", "waited")})
            try:
                with self.engine.begin() as conn:
                    conn.execute(sa.insert(_events), [asdict(e) for e in batch])
                    if used:
                        conn.execute(
                            sa.update(_artifacts)
                            .where(_artifacts.c.digest.in_(used))
                            .values(last_used_at=utcnow())
                        )
            except Exception:
                for event in batch:  # keep them for the next attempt
                    self._queue.put(event)
                raise
            return len(batch)
