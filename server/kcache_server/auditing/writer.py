"""The audit writer: the server's own lookups, one ``audit_events`` row each, written in batches off the request path.

Requests only append to an in-memory queue; a background thread inserts what has
gathered every ``flush_s`` seconds (and on shutdown), adding them to the counts
``/v1/stats`` reads in the same transaction (:mod:`~kcache_server.auditing.counts`),
and bumps ``last_used_at`` of the artifacts that were served. A crash can lose the last fraction of a second
of events, never an artifact.

No single row can block the writer. A batch the database refuses is split in
halves and retried down to single rows; a row the database refuses on its own
(an out-of-range number, a NUL on PostgreSQL) is dropped, counted and logged, and
every other row lands. Only an unavailable database (a connection or lock error)
keeps rows queued for the next flush, up to ``max_queued`` rows; past that, new
events are dropped and counted rather than growing memory without end.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from typing import Any

import sqlalchemy as sa

from kcache_server.auditing.counts import write_events
from kcache_server.models import artifacts_table as _artifacts
from kcache_server.models import utcnow

__all__ = ["AuditLog", "AuditRecord"]

log = logging.getLogger(__name__)

# The database is unreachable or busy: the rows are fine, try them again later.
_UNAVAILABLE = (sa.exc.OperationalError, sa.exc.InterfaceError, sa.exc.TimeoutError)
# Rows per INSERT: a long backlog is written in transactions of bounded size.
_CHUNK = 5000
# Seconds between two log lines about events dropped because the queue was full.
_QUEUE_FULL_LOG_S = 60.0


def _unavailable(exc: BaseException) -> bool:
    """True when ``exc`` says the database is unavailable rather than that a row is bad."""
    return isinstance(exc, _UNAVAILABLE) or bool(getattr(exc, "connection_invalidated", False))


def _reason(exc: BaseException) -> str:
    """A one-line reason for the log, without the SQL or its parameters."""
    cause = getattr(exc, "orig", None) or exc
    first = (str(cause).strip().splitlines() or [""])[0]
    return f"{type(cause).__name__}: {first[:200]}"


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
    #: A miss's explanation (:mod:`kcache.recipe_diff`), filled in by a preparer before the write.
    miss_reason: str | None = None


@dataclass
class _Tally:
    """Identical lookups gathered between two flushes; written as one row with ``count``."""

    record: AuditRecord
    count: int = 0
    latency_ms_sum: float = 0.0
    saved: float = 0.0
    last: float = 0.0


class AuditLog:
    """Buffers :class:`AuditRecord` s and writes them in batches; see the module docstring."""

    def __init__(
        self, engine: sa.Engine, flush_s: float = 0.5, max_queued: int = 1_000_000
    ) -> None:
        self.engine = engine
        self.flush_s = flush_s
        self.max_queued = max_queued
        self._queue: queue.SimpleQueue[AuditRecord] = queue.SimpleQueue()
        self._flush_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._tallies: dict[Hashable, _Tally] = {}
        self._tally_lock = threading.Lock()
        # Called with every record (e.g. Prometheus counters); must be quick and not raise.
        self.listeners: list[Callable[[AuditRecord], None]] = []
        # Called with each dropped row and why ("refused" or "queue_full"); quick, never raising.
        self.drop_listeners: list[Callable[[AuditRecord, str], None]] = []
        # Called in the writer's thread with each batch before it is written (it may fill
        # in fields, e.g. miss_reason); must not raise. The database is theirs to use.
        self.preparers: list[Callable[[list[AuditRecord]], None]] = []
        # Called in the writer's thread with the kernel lookups each written batch started
        # (kcache_server.auditing.lookups), once committed; quick, never raising.
        self.lookup_listeners: list[Callable[[list[dict[str, Any]]], None]] = []
        #: Rows dropped so far, by reason.
        self.dropped: Counter[str] = Counter()
        self._queue_full_logged = 0.0

    def record(self, event: AuditRecord) -> None:
        """Queue ``event`` (never blocks on the database)."""
        if self._queue.qsize() >= self.max_queued:
            self._drop(event, "queue_full")
        else:
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

    def pending(self) -> int:
        """Rows waiting to be written (queued events; tallies not yet drained excluded)."""
        return self._queue.qsize()

    def start(self) -> None:
        """Start the background writer."""
        self._thread = threading.Thread(target=self._loop, name="kcache-audit", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the writer and write what is left (a bad row cannot hold the rest back)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.flush()
        left = self.pending()
        if left:
            log.error(
                "audit: %d events could not be written before shutdown (database unavailable)", left
            )

    def _loop(self) -> None:
        while not self._stop.wait(self.flush_s):
            try:
                self.flush()
            except Exception:  # a bug must not kill the writer; the next tick tries again
                log.exception("audit: writing events failed")

    def flush(self) -> int:
        """Write every queued event now; returns how many rows were written. Never raises.

        Rows the database refuses are dropped (and counted); when the database is
        unavailable the unwritten rows stay queued for the next flush.
        """
        with self._flush_lock:
            batch: list[AuditRecord] = self._drain_tallies()
            while True:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            for prepare in self.preparers:
                prepare(batch)
            if not batch:
                return 0
            written = self._write(batch)
            used = sorted(
                {e.digest for e in written if e.digest and e.outcome in ("hit", "waited")}
            )
            if used:
                try:
                    with self.engine.begin() as conn:
                        conn.execute(
                            sa.update(_artifacts)
                            .where(_artifacts.c.digest.in_(used))
                            .values(last_used_at=utcnow())
                        )
                except Exception as exc:  # recency is advisory: eviction just sees older times
                    log.warning(
                        "audit: could not refresh last_used_at of %d artifacts: %s",
                        len(used),
                        _reason(exc),
                    )
            return len(written)

    def _write(self, batch: list[AuditRecord]) -> list[AuditRecord]:
        """Insert ``batch``, bisecting around refused rows; returns the rows written."""
        written: list[AuditRecord] = []
        todo: list[list[AuditRecord]] = [
            batch[i : i + _CHUNK] for i in range(0, len(batch), _CHUNK)
        ][::-1]
        while todo:
            rows = todo.pop()
            try:
                lookups = self._insert(rows)
            except Exception as exc:
                if _unavailable(exc):
                    left = rows + [row for chunk in todo for row in chunk]
                    for row in left:  # in the queue again, for the next flush
                        self._queue.put(row)
                    log.warning(
                        "audit: database unavailable, %d events kept for later: %s",
                        len(left),
                        _reason(exc),
                    )
                    break
                if len(rows) == 1:
                    self._drop(rows[0], "refused", exc)
                else:  # some row in here is refused: retry each half on its own
                    half = len(rows) // 2
                    todo += [rows[half:], rows[:half]]
                continue
            written += rows
            if lookups:
                for listener in self.lookup_listeners:
                    listener(lookups)
        return written

    def _insert(self, rows: Sequence[AuditRecord]) -> list[dict[str, Any]]:
        with self.engine.begin() as conn:  # events, counts and kernel lookups in one transaction
            return write_events(conn, [asdict(e) for e in rows])

    def _drop(self, row: AuditRecord, reason: str, exc: BaseException | None = None) -> None:
        self.dropped[reason] += 1
        for listener in self.drop_listeners:
            listener(row, reason)
        if exc is not None:
            log.warning(
                "audit: dropped a row the database refused (outcome=%s route=%s recipe_key=%s): %s",
                row.outcome,
                row.route,
                ascii(row.recipe_key)[:80],
                _reason(exc),
            )
        elif time.monotonic() - self._queue_full_logged > _QUEUE_FULL_LOG_S:
            self._queue_full_logged = time.monotonic()
            log.warning(
                "audit: the queue holds %d events (max_queued); new events are dropped until the "
                "database catches up (%d dropped so far)",
                self.max_queued,
                self.dropped[reason],
            )
