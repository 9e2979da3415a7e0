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
import time
from collections.abc import Callable, Hashable
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
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
    count: int = 1
    at: datetime = field(default_factory=utcnow)


@dataclass
class _Tally:
    """Identical lookups gathered between two flushes; written as one row with ``count``."""

    record: AuditRecord
    count: int = 0
    latency_ms_sum: float = 0.0
    saved: float = 0.0
    last: float = 0.0


class AuditLog:
    """Buffers :class:`AuditRecord` s and writes them in batches."""

    def __init__(self, engine: sa.Engine, flush_s: float = 0.5) -> None:
        self.engine = engine
        self.flush_s = flush_s
        self._queue: queue.SimpleQueue[AuditRecord] = queue.SimpleQueue()
        self._flush_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._tallies: dict[Hashable, _Tally] = {}
        self._tally_lock = threading.Lock()
        # Called with every record (e.g. Prometheus counters); must be quick and not raise.
        self.listeners: list[Callable[[AuditRecord], None]] = []

    def record(self, event: AuditRecord) -> None:
        """Queue ``event`` (never blocks on the database)."""
        self._queue.put(event)
        for listener in self.listeners:
            listener(event)

    def tally(
        self, key: Hashable, make: Callable[[], AuditRecord], latency_ms: float, saved: float
    ) -> None:
        """Count one more lookup identical to the others under ``key`` (``make`` builds the first).

        The hot path (warm fetches by recipe key, tens of thousands a second) would
        otherwise write one row per request; identical ones within a flush interval
        become one row whose ``count`` says how many lookups it stands for, with the
        mean latency and the summed compile time saved. Nothing is dropped.
        """
        with self._tally_lock:
            entry = self._tallies.get(key)
            if entry is None:
                entry = self._tallies[key] = _Tally(make())
            entry.count += 1
            entry.latency_ms_sum += latency_ms
            entry.saved += saved
            entry.last = time.time()
        for listener in self.listeners:
            listener(entry.record)

    def _drain_tallies(self) -> list[AuditRecord]:
        with self._tally_lock:
            tallies, self._tallies = self._tallies, {}
        return [
            replace(
                t.record,
                count=t.count,
                latency_ms=t.latency_ms_sum / t.count,
                compile_seconds_saved=t.saved,
                at=datetime.fromtimestamp(t.last, timezone.utc),
            )
            for t in tallies.values()
        ]

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
            batch: list[AuditRecord] = self._drain_tallies()
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
