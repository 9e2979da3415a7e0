"""``StoreEvictor``: the background thread that keeps the store under its byte cap.

See :mod:`kcache_server.eviction` for the order of an eviction; this module runs it:
a pass when a compile pushed the store over its high-water mark (or every
``interval_s``), admin removals, and the eviction log followed every ``poll_s``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sqlalchemy.exc import DBAPIError

from kcache.eviction import WaterMarks
from kcache_server.auditing.writer import AuditRecord
from kcache_server.eviction.blobs import EvictedBlobs
from kcache_server.eviction.lock import EvictorLock
from kcache_server.eviction.log import EvictionLog
from kcache_server.eviction.reports import RemovalReport, StoreInfo
from kcache_server.foreign import EvictedBinding, least_recently_used_of_both
from kcache_server.index import RemovedArtifact, StoreUsage
from kcache_server.models import utcnow
from kcache_server.state import ServerState

__all__ = ["PassReport", "StoreEvictor", "install_eviction"]

log = logging.getLogger("kcache_server.eviction")

# Seconds between two log lines about the same recurring problem (a database outage).
_COMPLAINT_EVERY_S = 60.0


@dataclass(frozen=True)
class PassReport:
    """What one eviction pass found and did."""

    bytes_before: int
    evicted: int = 0
    bytes_freed: int = 0
    seconds: float = 0.0


class StoreEvictor:
    """Keeps the store under its cap, removes artifacts on request, and keeps memory caches honest.

    One per server process; see :mod:`kcache_server.eviction`. ``marks.cap`` 0 means no
    cap: the thread then only follows the eviction log (removals by an admin on any
    replica).
    """

    def __init__(
        self,
        state: ServerState,
        marks: WaterMarks,
        *,
        interval_s: float = 30.0,
        poll_s: float = 0.5,
        blob_grace_s: float = 60.0,
        retention_days: float = 30.0,
    ) -> None:
        self.state = state
        self.marks = marks
        self.interval_s = interval_s
        self.poll_s = poll_s
        backends = state.backends
        self.index = backends.index
        self.lock = EvictorLock(backends.db, state.settings.data_dir)
        self.log = EvictionLog(backends.db, retention_days=retention_days)
        self.blobs = EvictedBlobs(backends.store, backends.index, grace_s=blob_grace_s)
        #: Passes this process completed (tests and benchmarks wait on it).
        self.passes = 0
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_logged_id = 0
        self._complained: dict[str, float] = {}

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the background thread (a first pass runs at once)."""
        self._last_logged_id = self.log.last_id()
        self._thread = threading.Thread(target=self._loop, name="kcache-evictor", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the thread (a pass in progress finishes its batch)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def nudge(self) -> None:
        """Ask for a pass soon (a compile just added an artifact)."""
        if self.marks.bounded:
            self._wake.set()

    def _loop(self) -> None:
        next_pass = 0.0
        while not self._stop.is_set():
            woken = self._wake.wait(self.poll_s)
            if self._stop.is_set():
                return
            self._guard("reading the eviction log", self._forget_logged)
            if self.marks.bounded and (woken or time.monotonic() >= next_pass):
                self._wake.clear()
                self._guard("an eviction pass", self.run_pass)
                next_pass = time.monotonic() + self.interval_s
            if self.blobs.waiting:
                self._guard("deleting evicted blobs", self.blobs.collect_due)

    def _guard(self, what: str, step: Callable[[], object]) -> None:
        """Run ``step``; log a failure (once a minute per kind: a database outage repeats)."""
        try:
            step()
        except Exception as exc:
            now = time.monotonic()
            if now - self._complained.get(what, -_COMPLAINT_EVERY_S) >= _COMPLAINT_EVERY_S:
                self._complained[what] = now
                if isinstance(exc, DBAPIError):  # an outage: the reason is the message
                    log.warning("evictor: %s failed (%s); retrying", what, exc.orig or exc)
                else:
                    log.exception("evictor: %s failed; retrying", what)

    # ------------------------------------------------------------------ eviction
    def run_pass(self) -> PassReport | None:
        """Evict down to the low-water mark if the store is over the high one; None if another process holds the lock."""
        with self.lock.hold(0) as held:
            if not held:
                return None
            report = self._pass()
        self.passes += 1
        return report

    def _pass(self) -> PassReport:
        started = time.perf_counter()
        began = utcnow()
        self.log.prune()
        used = self.index.usage()  # foreign bindings' bytes included
        # Foreign bindings (docs/design.md section 10) share the cap and the LRU order.
        foreign = self.state.foreign
        foreign_count, _ = foreign.usage()
        total = used.bytes
        to_free = self.marks.to_free(total)
        if to_free <= 0:
            return PassReport(total)
        # This process's hits still queued in the audit writer are recency too: write them first.
        self.state.audit.flush()
        if foreign_count:
            victims, foreign_victims = least_recently_used_of_both(self.state.backends.db, to_free)
        else:
            victims, foreign_victims = self.index.least_recently_used(to_free), []
        evicted = self.index.evict(victims, "lru", unused_since=began)
        self._removed(evicted)
        gone = foreign.evict(foreign_victims, unused_since=began) if foreign_victims else []
        self._removed_foreign(gone)
        freed = sum(e.size for e in evicted) + sum(g.size for g in gone)
        left = total - freed
        if self.marks.over(left):
            self._complain_over(left, used)
        report = PassReport(total, len(evicted) + len(gone), freed, time.perf_counter() - started)
        log.info(
            "evictor: %d artifacts (%d bytes) evicted in %.2fs; the store holds %d of %d bytes",
            report.evicted,
            report.bytes_freed,
            report.seconds,
            left,
            self.marks.cap,
        )
        return report

    def _complain_over(self, left: int, used: StoreUsage) -> None:
        now = time.monotonic()
        if now - self._complained.get("over", -_COMPLAINT_EVERY_S) < _COMPLAINT_EVERY_S:
            return
        self._complained["over"] = now
        log.warning(
            "evictor: the store still holds %d bytes, over the high-water mark of %d (max_store_bytes "
            "%d): pinned artifacts hold %d bytes and are never evicted. Unpin some (kcache unpin) "
            "or raise max_store_bytes",
            left,
            self.marks.high_bytes,
            self.marks.cap,
            used.pinned_bytes,
        )

    def remove(self, keys: Sequence[str], reason: str = "removed") -> RemovalReport:
        """Evict the artifacts ``keys`` name (recipe keys or digests) now, pinned ones excepted."""
        found = self.index.digests_for(keys)
        unknown = [k for k, d in found.items() if d is None]
        digests = sorted({d for d in found.values() if d is not None})
        with self.lock.hold(60.0) as held:
            if not held:
                raise TimeoutError("another process held the evictor lock for 60s; retry")
            evicted = self.index.evict(digests, reason)
        self._removed(evicted)
        gone = {e.digest for e in evicted}
        pinned = [k for k, d in found.items() if d is not None and d not in gone]
        return RemovalReport(len(evicted), sum(e.size for e in evicted), pinned, unknown)

    def clear(self) -> RemovalReport:
        """Evict every artifact that is not pinned."""
        victims = self.index.least_recently_used(1 << 62)
        with self.lock.hold(60.0) as held:
            if not held:
                raise TimeoutError("another process held the evictor lock for 60s; retry")
            evicted = self.index.evict(victims, "cleared")
        self._removed(evicted)
        return RemovalReport(len(evicted), sum(e.size for e in evicted), [], [])

    def _removed(self, evicted: list[RemovedArtifact]) -> None:
        """After the rows are gone: forget the artifacts in memory, count them, delete their blobs."""
        self._forget(evicted)
        metrics = self.state.metrics
        metrics.evictions.inc(len(evicted))
        metrics.evicted_bytes.inc(sum(e.size for e in evicted))
        self.blobs.collect([e.digest for e in evicted])

    def _removed_foreign(self, gone: list[EvictedBinding]) -> None:
        """After foreign bindings' rows are gone: count them, delete their blobs (where no row
        names them), drop those bytes from this process's memory."""
        if not gone:
            return
        metrics = self.state.metrics
        metrics.evictions.inc(len(gone))
        metrics.evicted_bytes.inc(sum(g.size for g in gone))
        digests = sorted({d for g in gone for d in g.digests})
        for digest in digests:
            self.state.resolver.forget_blob(digest)
        self.blobs.collect(digests)

    def _forget(self, evicted: Sequence[RemovedArtifact]) -> None:
        resolver = self.state.resolver
        for item in evicted:
            for key in item.recipe_keys:
                resolver.forget(key)
            resolver.forget_blob(item.digest)

    def _forget_logged(self) -> None:
        """Drop from memory what any replica evicted since the last look (this one's too: cheap)."""
        self._last_logged_id, removed = self.log.after(self._last_logged_id)
        if removed:
            self._forget(removed)

    # ------------------------------------------------------------------ reporting
    def info(self) -> StoreInfo:
        """Size, cap, pins, and the evictions the log still holds."""
        usage = self.index.usage()
        count, freed = self.log.totals()
        location = str(self.state.settings.data_dir.resolve())
        return StoreInfo.of(location, usage, self.marks, count, freed)


def install_eviction(state: ServerState) -> StoreEvictor:
    """The process's evictor for ``state``'s settings, woken by every compile; start it in the lifespan.

    Refuses water marks that make no sense (a ValueError saying how to fix them).
    """
    settings = state.settings
    marks = WaterMarks(
        settings.max_store_bytes or 0, settings.store_high_water, settings.store_low_water
    )
    evictor = StoreEvictor(
        state,
        marks,
        interval_s=settings.eviction_interval_s,
        blob_grace_s=settings.eviction_blob_grace_s,
        retention_days=settings.audit.retention_days,
    )

    def on_compiled(record: AuditRecord) -> None:
        if record.outcome == "compiled":
            evictor.nudge()

    state.audit.listeners.append(on_compiled)
    metrics = state.metrics
    metrics.store_bytes_cap.set(marks.cap)

    def sample() -> None:
        usage = state.backends.index.usage()
        metrics.store_pinned_artifacts.set(usage.pinned_artifacts)
        metrics.store_pinned_bytes.set(usage.pinned_bytes)

    metrics.add_sampler(sample)
    return evictor
