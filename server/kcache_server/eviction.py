"""The server store's byte cap: a background evictor, one at a time across replicas.

Policy (:mod:`kcache.eviction`): when the artifacts the index holds pass the high-water
mark of ``max_store_bytes``, the least recently used unpinned ones are evicted down
to the low-water mark. Recency is ``artifacts.last_used_at``, which the audit writer
refreshes in batches from every hit and fetch (no write per request); an artifact
never served counts from its creation.

Order of an eviction, so that no row ever names a missing blob:

1. one transaction per batch deletes the artifacts' aliases, manifest entries,
   compile charges and rows, and logs them in ``evictions`` (a row used since the
   pass began, or pinned meanwhile, is skipped);
2. this process forgets those recipe keys and blobs in its memory caches; every
   other replica does the same when it reads the log (every ``poll_s``);
3. the blob goes last, by :meth:`LocalArtifactStore.collect`'s protocol: set aside,
   re-checked against the index, then unlinked, so a compile that stored the same
   bytes again in the meantime keeps them (blobs in a bucket: see ``_collect_remote``). A blob written or reused within
   ``blob_grace_s`` stays until a later pass (a compile publishes its blob before
   it commits the row that names it). A reader holding the blob open finishes its
   read: unlinking a file does not take it from an open descriptor.

One evictor at a time: a PostgreSQL advisory lock, or on SQLite a file lock in the
data directory. A process that does not get it skips its pass; whoever holds it
does the work. Compiles wake the evictor, so the store is over its high-water mark
for at most one pass after a compile pushed it there.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, cast

import sqlalchemy as sa
from sqlalchemy.exc import DBAPIError

from kcache.eviction import WaterMarks
from kcache.locks import try_file_lock
from kcache.store.cached import CachedArtifactStore
from kcache.store.local import SET_ASIDE_PREFIX
from kcache_server.auditing.writer import AuditRecord
from kcache_server.db import is_postgres
from kcache_server.index import Evicted, StoreUsage, pinned
from kcache_server.models import Artifact, Eviction, RecipeAlias, utcnow
from kcache_server.state import ServerState

__all__ = [
    "Evictor",
    "PassReport",
    "RemovalReport",
    "StoreEntry",
    "StoreInfo",
    "evictions_between",
    "install_eviction",
    "list_entries",
]

log = logging.getLogger(__name__)

_evictions = cast(sa.Table, Eviction.__table__)
# pg_advisory_lock(int, int): a key space apart from the per-recipe compile locks (one bigint).
_PG_LOCK = (0x6B63, 0x45564943)  # "kc", "EVIC"
# Seconds between two log lines about the same recurring problem (a database outage).
_COMPLAINT_EVERY_S = 60.0
# Blobs set aside per query that asks the index which of them are named again.
_COLLECT_BATCH = 1000
# How often the eviction log is pruned of rows older than the audit retention.
_PRUNE_EVERY_S = 3600.0


@dataclass(frozen=True)
class PassReport:
    """What one eviction pass found and did."""

    bytes_before: int
    evicted: int = 0
    bytes_freed: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class RemovalReport:
    """What an admin removal did: evicted artifacts, bytes freed, keys that were pinned or unknown."""

    evicted: int
    bytes_freed: int
    pinned: list[str] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class StoreInfo:
    """The store's size against its cap, and what eviction has done (``kcache cache info``)."""

    location: str
    usage: StoreUsage
    marks: WaterMarks
    evictions: int
    bytes_freed: int


class _OneEvictor:
    """The lock that lets one process at a time evict: PostgreSQL advisory lock, else a file lock.

    Unlike the compile locks it guards more than duplicate work: eviction log rows are
    inserted only under it, so they commit in ``id`` order and every replica reading
    the log by ``id`` sees each of them.
    """

    def __init__(self, db: sa.Engine, data_dir: Path) -> None:
        self.db = db
        self.path = data_dir / "locks" / "evictor.lock"
        self._local = threading.Lock()

    @contextlib.contextmanager
    def hold(self, wait_s: float) -> Iterator[bool]:
        """Yields True while this process holds the lock; False when it was not had within ``wait_s``."""
        got = self._local.acquire(timeout=wait_s) if wait_s > 0 else self._local.acquire(False)
        if not got:
            yield False
            return
        try:
            if is_postgres(self.db):
                with self._advisory(wait_s) as held:
                    yield held
            else:
                with try_file_lock(self.path, wait_s) as held:
                    yield held
        finally:
            self._local.release()

    @contextlib.contextmanager
    def _advisory(self, wait_s: float) -> Iterator[bool]:
        conn = self.db.connect().execution_options(isolation_level="AUTOCOMMIT")
        held = False
        try:
            args = {"a": _PG_LOCK[0], "b": _PG_LOCK[1]}
            held = bool(conn.execute(sa.text("SELECT pg_try_advisory_lock(:a, :b)"), args).scalar())
            if not held and wait_s > 0:
                conn.execute(sa.text(f"SET lock_timeout = {max(1, int(wait_s * 1000))}"))
                try:
                    conn.execute(sa.text("SELECT pg_advisory_lock(:a, :b)"), args)
                    held = True
                except DBAPIError:
                    held = False
                finally:
                    with contextlib.suppress(DBAPIError):
                        conn.execute(sa.text("SET lock_timeout = 0"))
            yield held
        finally:
            try:
                if held:
                    conn.execute(sa.text("SELECT pg_advisory_unlock(:a, :b)"), args)
            except DBAPIError:
                conn.invalidate()  # closing a broken connection releases the lock server-side
            finally:
                conn.close()


class Evictor:
    """Keeps the store under its cap, removes artifacts on request, and keeps memory caches honest.

    One per server process; see the module docstring. ``marks.cap`` 0 means no cap:
    the thread then only follows the eviction log (removals by an admin on any replica).
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
        self.blob_grace_s = blob_grace_s
        self.retention_days = retention_days
        backends = state.backends
        self.db = backends.db
        self.index = backends.index
        self.store = backends.store
        self.lock = _OneEvictor(backends.db, state.settings.data_dir)
        #: Passes this process completed (tests and benchmarks wait on it).
        self.passes = 0
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_logged_id = 0
        # Evicted blobs kept for now (written or reused within the grace): digest -> when due.
        self._deferred: dict[str, float] = {}
        self._deferred_lock = threading.Lock()
        self._complained: dict[str, float] = {}
        self._pruned_at = 0.0

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the background thread (a first pass runs at once)."""
        self._last_logged_id = self._max_logged_id()
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
            if self._deferred:
                self._guard("deleting evicted blobs", self._collect_due)

    def _guard(self, what: str, step: Any) -> None:
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
        self._prune_log()
        used = self.index.usage()
        to_free = self.marks.to_free(used.bytes)
        if to_free <= 0:
            return PassReport(used.bytes)
        # This process's hits still queued in the audit writer are recency too: write them first.
        self.state.audit.flush()
        victims = self.index.least_recently_used(to_free)
        evicted = self.index.evict(victims, "lru", unused_since=began)
        self._removed(evicted)
        freed = sum(e.size for e in evicted)
        left = used.bytes - freed
        if self.marks.over(left):
            self._complain_over(left, used)
        report = PassReport(used.bytes, len(evicted), freed, time.perf_counter() - started)
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
        return RemovalReport(len(evicted), sum(e.size for e in evicted))

    def _removed(self, evicted: list[Evicted]) -> None:
        """After the rows are gone: forget the artifacts in memory, count them, delete their blobs."""
        self._forget(evicted)
        metrics = self.state.metrics
        metrics.evictions.inc(len(evicted))
        metrics.evicted_bytes.inc(sum(e.size for e in evicted))
        self._collect([e.digest for e in evicted])

    def _forget(self, evicted: Sequence[Evicted]) -> None:
        resolver = self.state.resolver
        for item in evicted:
            for key in item.recipe_keys:
                resolver.forget(key)
            resolver.forget_blob(item.digest)

    # ------------------------------------------------------------------ blobs
    def _collect(self, digests: Sequence[str]) -> None:
        """Delete the blobs of evicted artifacts that no row names; young ones wait for the grace.

        With blobs in a bucket (:class:`CachedArtifactStore`) see :meth:`_collect_remote`.

        :meth:`LocalArtifactStore.collect`'s protocol, batched (one query per thousand
        blobs instead of one each): set every blob aside by rename, ask the index once
        which digests a row names again, then put those back (and any whose mtime moved:
        the same bytes stored again) and unlink the rest. A killed evictor leaves set-aside
        blobs that :meth:`LocalArtifactStore.restore_set_aside` (``kcache db gc``) puts back.
        """
        if isinstance(self.store, CachedArtifactStore):
            self._collect_remote(digests, due=False)
            return
        cutoff = time.time() - self.blob_grace_s
        suffix = f"{os.getpid()}-{secrets.token_hex(4)}"  # unique to this pass, as collect's are
        for start in range(0, len(digests), _COLLECT_BATCH):
            aside: list[tuple[str, str, str]] = []
            for digest in digests[start : start + _COLLECT_BATCH]:
                path = os.fspath(self.store.path(digest))  # strings: pathlib costs per blob here
                try:
                    mtime = os.stat(path).st_mtime
                    if mtime >= cutoff:
                        with self._deferred_lock:
                            self._deferred[digest] = mtime + self.blob_grace_s
                        continue
                    moved = f"{os.path.dirname(path)}/{SET_ASIDE_PREFIX}{digest}-{suffix}"
                    os.rename(path, moved)
                except FileNotFoundError:
                    continue
                aside.append((digest, path, moved))
            if not aside:
                continue
            try:
                named = self.index.named([digest for digest, _, _ in aside])
            except BaseException:
                for _, path, moved in aside:
                    os.replace(moved, path)
                raise
            for digest, path, moved in aside:
                if digest in named or os.stat(moved).st_mtime >= cutoff:
                    os.replace(moved, path)  # a fresh copy published meanwhile has the same bytes
                else:
                    os.unlink(moved)

    def _collect_remote(self, digests: Sequence[str], *, due: bool) -> None:
        """Blobs in a bucket: deleted ``blob_grace_s`` after their rows, if no row names them then.

        A bucket has no rename to set a blob aside, and a compile storing the same bytes
        again does not touch the object (its conditional PUT finds it there), so the
        grace runs from the eviction for every blob: a compile that stored its blob
        before the rows went has committed its row by then, and the index says so. (One
        whose commit lands between that check and the delete leaves a row without its
        blob; the engine sees the blob missing and compiles the recipe again.)
        """
        if not due:
            when = time.time() + self.blob_grace_s
            with self._deferred_lock:
                for digest in digests:
                    self._deferred[digest] = when
            return
        named = self.index.named(list(digests))
        for digest in digests:
            if digest not in named:
                self.store.delete(digest)  # the bucket's object and the local copy

    def _collect_due(self) -> None:
        now = time.time()
        with self._deferred_lock:
            due = [d for d, when in self._deferred.items() if when <= now]
            for digest in due:
                del self._deferred[digest]
        if not due:
            return
        if isinstance(self.store, CachedArtifactStore):
            self._collect_remote(due, due=True)
        else:
            # Named again meanwhile (recompiled): kept; else it goes now.
            self._collect(due)

    # ------------------------------------------------------------------ the eviction log
    def _max_logged_id(self) -> int:
        try:
            with self.db.connect() as conn:
                return int(conn.execute(sa.select(sa.func.max(_evictions.c.id))).scalar() or 0)
        except DBAPIError:
            return 0

    def _forget_logged(self) -> None:
        """Drop from memory what any replica evicted since the last look (this one's too: cheap)."""
        with self.db.connect() as conn:
            rows = conn.execute(
                sa.select(_evictions.c.id, _evictions.c.digest, _evictions.c.recipe_keys)
                .where(_evictions.c.id > self._last_logged_id)
                .order_by(_evictions.c.id)
                .limit(10_000)
            ).all()
        if rows:
            self._forget([Evicted(r.digest, 0, tuple(r.recipe_keys or ())) for r in rows])
            self._last_logged_id = int(rows[-1].id)

    def _prune_log(self) -> None:
        now = time.monotonic()
        if self.retention_days <= 0 or now - self._pruned_at < _PRUNE_EVERY_S:
            return
        self._pruned_at = now
        horizon = utcnow() - timedelta(days=self.retention_days)
        with self.db.begin() as conn:
            conn.execute(sa.delete(_evictions).where(_evictions.c.at < horizon))

    # ------------------------------------------------------------------ reporting
    def info(self) -> StoreInfo:
        """Size, cap, pins, and the evictions the log still holds."""
        usage = self.index.usage()
        with self.db.connect() as conn:
            count, freed = conn.execute(
                sa.select(sa.func.count(), sa.func.coalesce(sa.func.sum(_evictions.c.size), 0))
            ).one()
        return StoreInfo(
            str(self.state.settings.data_dir.resolve()), usage, self.marks, int(count), int(freed)
        )


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


@dataclass(frozen=True)
class StoreEntry:
    """One stored artifact as ``kcache cache ls`` shows it."""

    digest: str
    recipe_keys: list[str]
    kernel: str
    target: str
    kind: str
    size: int
    created_at: datetime
    last_used_at: datetime | None
    pinned: bool


def list_entries(db: sa.Engine, limit: int) -> list[StoreEntry]:
    """The ``limit`` most recently used artifacts, with the recipe keys that name them."""
    artifacts = cast(sa.Table, Artifact.__table__)
    aliases = cast(sa.Table, RecipeAlias.__table__)
    last_use = sa.func.coalesce(artifacts.c.last_used_at, artifacts.c.created_at)
    query = (
        sa.select(
            artifacts.c.digest,
            artifacts.c.kernel,
            artifacts.c.target,
            artifacts.c.kind,
            artifacts.c.size,
            artifacts.c.created_at,
            artifacts.c.last_used_at,
            pinned(artifacts.c.digest).label("pinned"),
        )
        .order_by(last_use.desc(), artifacts.c.digest)
        .limit(limit)
    )
    with db.connect() as conn:
        rows = conn.execute(query).all()
        keys: dict[str, list[str]] = {}
        digests = [r.digest for r in rows]
        for start in range(0, len(digests), 500):
            for key, digest in conn.execute(
                sa.select(aliases.c.recipe_key, aliases.c.digest).where(
                    aliases.c.digest.in_(digests[start : start + 500])
                )
            ):
                keys.setdefault(digest, []).append(key)
    return [
        StoreEntry(
            r.digest,
            sorted(keys.get(r.digest, [])),
            r.kernel,
            r.target,
            r.kind,
            int(r.size),
            r.created_at,
            r.last_used_at,
            bool(r.pinned),
        )
        for r in rows
    ]


def install_eviction(state: ServerState) -> Evictor:
    """The process's evictor for ``state``'s settings, woken by every compile; start it in the lifespan.

    Refuses water marks that make no sense (a ValueError saying how to fix them).
    """
    settings = state.settings
    marks = WaterMarks(
        settings.max_store_bytes or 0, settings.store_high_water, settings.store_low_water
    )
    evictor = Evictor(
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
