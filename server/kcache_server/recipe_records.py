"""Recipe records: every recipe the server compiled or served through a manifest match, kept.

One ``recipe_records`` row per recipe key: its fingerprint
(:func:`kcache.recipe_diff.fingerprint`: what tells recipes of one kernel apart) and,
where it compresses to at most :data:`MAX_BODY_BYTES`, the whole recipe, so the
server can explain a miss (:meth:`RecipeRecords.nearest`) and compile a served
recipe again (:meth:`RecipeRecords.recipe`).

Writing never fails a request, nor runs on the event loop: requests only
:meth:`~RecipeRecords.note` what they saw (a queue append), and the audit writer's
thread, before each batch of audit rows is written, records those recipes and
explains those misses (:meth:`~RecipeRecords.prepare`), so an explanation lands
with its audit row (``audit_events.miss_reason``). A database error is logged and
counted (:attr:`RecipeRecords.failures`); the row is written without its reason.

The work is bounded: a recipe seen again within :data:`REFRESH_S` costs nothing (a
memory look-up), else one ``UPDATE``; an explanation reads at most
:data:`CANDIDATES` rows of the same program name and source plus as many of the same
base key, by index; at most :data:`MAX_EXPLAINED_PER_FLUSH` misses are explained per
batch (the rest are written without a reason).
"""

from __future__ import annotations

import json
import logging
import queue
import time
import zlib
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from kcache.keys import sha256_hex
from kcache.lru import LruCache
from kcache.recipe import Recipe
from kcache.recipe_diff import Explanation, explain, fingerprint
from kcache_server.models import negative_entries_table as _negatives
from kcache_server.models import recipe_aliases_table as _aliases
from kcache_server.models import recipe_records_table as _records
from kcache_server.models import utcnow

if TYPE_CHECKING:
    from kcache_server.auditing.writer import AuditRecord

__all__ = [
    "CANDIDATES",
    "MAX_BODY_BYTES",
    "MAX_EXPLAINED_PER_FLUSH",
    "REFRESH_S",
    "SEEN_BEFORE",
    "RecipeRecords",
    "miss_reason",
]

log = logging.getLogger(__name__)

#: The largest compressed recipe kept whole (larger ones keep their fingerprint only).
MAX_BODY_BYTES = 256 << 10
#: Candidates read per way of being near (same name and source; same base key).
CANDIDATES = 20
#: A recipe recorded less than this long ago (by this process) is not written again.
REFRESH_S = 60.0
#: Misses explained per audit batch; the rest of a burst keeps no reason.
MAX_EXPLAINED_PER_FLUSH = 256
#: Notes waiting for the audit writer's thread; past it, notes are dropped and counted.
MAX_QUEUED = 10_000
#: The reason of a miss of a recipe recorded before (its artifact went away since).
SEEN_BEFORE = "seen before: its artifact was evicted, collected or set aside since"
#: The ``audit_events.miss_reason`` column's size.
MISS_REASON_CHARS = 1024
# Recipe keys this process recorded lately, with when (monotonic seconds).
_RECENT_KEYS = 100_000
# A stored body is never inflated past this (they are at most recipe-sized).
_MAX_INFLATED = 64 << 20
# Seconds between two log lines about failing database writes.
_LOG_EVERY_S = 60.0


def miss_reason(explanation: Explanation) -> str:
    """:attr:`Explanation.text` cut to fit ``audit_events.miss_reason``."""
    text = explanation.text
    if len(text) <= MISS_REASON_CHARS:
        return text
    return text[: MISS_REASON_CHARS - 3] + "..."


@dataclass(frozen=True)
class _Note:
    """What a request saw: a recipe to record (``keep``) and/or a miss to explain (``record``)."""

    recipe: Recipe
    record: AuditRecord | None
    keep: bool


class RecipeRecords:
    """The ``recipe_records`` table: record recipes, read one back, explain a miss."""

    def __init__(self, engine: sa.Engine, *, max_queued: int = MAX_QUEUED) -> None:
        self.engine = engine
        self.max_queued = max_queued
        self._notes: queue.SimpleQueue[_Note] = queue.SimpleQueue()
        self._recent: LruCache[str, float] = LruCache(max_entries=_RECENT_KEYS)
        #: Database errors and dropped notes so far, by operation
        #: (``record``, ``explain``, ``queue_full``).
        self.failures: Counter[str] = Counter()
        #: Called with the operation of each failure (e.g. a Prometheus counter); never raising.
        self.failure_listeners: list[Callable[[str], None]] = []
        self._logged = 0.0
        self._budget = MAX_EXPLAINED_PER_FLUSH  # misses :meth:`prepare` may still explain

    # ------------------------------------------------------------------ writing
    def record(self, recipe: Recipe) -> None:
        """Keep ``recipe`` (insert, or refresh ``last_seen_at``); idempotent; never raises."""
        try:
            key = recipe.key()
            seen = self._recent.get(key)
            now = time.monotonic()
            if seen is not None and now - seen < REFRESH_S:
                return
            stamp = utcnow()
            with self.engine.begin() as conn:
                refreshed = conn.execute(
                    sa.update(_records)
                    .where(_records.c.recipe_key == key)
                    .values(last_seen_at=stamp)
                ).rowcount
                if not refreshed:
                    conn.execute(self._upsert(conn, self._row(recipe, stamp)))
            self._recent.put(key, now)
        except Exception as exc:  # never the request's failure
            self._failed("record", exc)

    def record_as_seen(self, recipe: Recipe, seen_at: datetime) -> None:
        """Keep ``recipe`` as last seen at ``seen_at``, unless its key is recorded already.

        For ``kcache db rekey``: a recipe recorded under an older key schema, recorded
        again under its current key without counting as used now. Raises on a database error.
        """
        row = self._row(recipe, seen_at)
        with self.engine.begin() as conn:
            dialect = postgresql if conn.dialect.name == "postgresql" else sqlite
            conn.execute(
                dialect.insert(_records)
                .values(row)
                .on_conflict_do_nothing(index_elements=[_records.c.recipe_key])
            )

    def _row(self, recipe: Recipe, stamp: datetime) -> dict[str, Any]:
        body = json.dumps(recipe.to_dict(), separators=(",", ":"), ensure_ascii=False).encode()
        packed: bytes | None = zlib.compress(body, 6)
        if packed is not None and len(packed) > MAX_BODY_BYTES:
            packed = None
        return {
            "recipe_key": recipe.key(),
            "base_key": recipe.base_key(),
            "name": recipe.name,
            "source_sha256": sha256_hex(recipe.source.encode()),
            "fingerprint": fingerprint(recipe),
            "recipe_zlib": packed,
            "created_at": stamp,
            "last_seen_at": stamp,
        }

    @staticmethod
    def _upsert(conn: sa.Connection, row: Mapping[str, Any]) -> Any:
        dialect = postgresql if conn.dialect.name == "postgresql" else sqlite
        stmt = dialect.insert(_records).values(dict(row))
        return stmt.on_conflict_do_update(
            index_elements=[_records.c.recipe_key],
            set_={"last_seen_at": stmt.excluded.last_seen_at},
        )

    # ------------------------------------------------------------------ reading
    def recipe(self, recipe_key: str) -> Recipe | None:
        """The recipe recorded under ``recipe_key``; None when absent or not kept whole."""
        with self.engine.connect() as conn:
            packed = conn.execute(
                sa.select(_records.c.recipe_zlib).where(_records.c.recipe_key == recipe_key)
            ).scalar_one_or_none()
        if packed is None:
            return None
        try:
            inflate = zlib.decompressobj()
            body = inflate.decompress(packed, _MAX_INFLATED)
            if inflate.unconsumed_tail:
                raise ValueError(f"inflates past {_MAX_INFLATED} bytes")
            return Recipe.from_dict(json.loads(body))
        except Exception as exc:  # a damaged row: as good as not kept
            log.warning("recipe records: the body of %s is unreadable: %s", recipe_key, exc)
            return None

    def nearest(self, recipe: Recipe, *, values: bool = True) -> Explanation:
        """The nearest recorded recipe of ``recipe``'s kernel, and what differs ("never seen": none).

        Candidates are the :data:`CANDIDATES` most recently seen recipes of the same
        program name and source and as many of the same base key, ``recipe`` itself
        excluded; the nearest has the fewest differences (the most recent on a tie).
        ``values`` false: no macro or specialization value in what it says
        (:mod:`kcache.recipe_diff`).
        """
        key = recipe.key()
        candidates = self._candidates(
            key, recipe.base_key(), recipe.name, sha256_hex(recipe.source.encode())
        )
        return explain(fingerprint(recipe), candidates, values=values)

    def keys_starting(self, prefix: str, limit: int = 6) -> list[str]:
        """Up to ``limit`` recipe keys beginning with ``prefix`` that this server knows, sorted.

        Known: recorded here, held under an alias, or remembered as a failed compile.
        ``prefix`` is lowercase hex (checked by the caller); each table is read by its
        key's index, as a range (``prefix`` <= key < ``prefix`` + "g": every hex digit
        sorts below "g").
        """
        found: set[str] = set()
        with self.engine.connect() as conn:
            for table in (_records, _aliases, _negatives):
                column = table.c.recipe_key
                rows = conn.execute(
                    sa.select(column)
                    .where(column >= prefix, column < prefix + "g")
                    .order_by(column)
                    .limit(limit)
                )
                found.update(key for (key,) in rows)
        return sorted(found)[:limit]

    def recorded(self, recipe_key: str) -> bool:
        """True when a recipe is recorded under ``recipe_key`` (compiled or served here)."""
        return self._recent.get(recipe_key) is not None or self._recorded(recipe_key)

    def _recorded(self, recipe_key: str) -> bool:
        with self.engine.connect() as conn:
            found = conn.execute(
                sa.select(_records.c.recipe_key).where(_records.c.recipe_key == recipe_key)
            ).first()
        return found is not None

    def nearest_to_key(self, recipe_key: str, *, values: bool = True) -> Explanation | None:
        """:meth:`nearest` for a recorded recipe key (from its fingerprint); None if not recorded."""
        c = _records.c
        with self.engine.connect() as conn:
            row = conn.execute(
                sa.select(c.base_key, c.name, c.source_sha256, c.fingerprint).where(
                    c.recipe_key == recipe_key
                )
            ).one_or_none()
        if row is None:
            return None
        candidates = self._candidates(recipe_key, row.base_key, row.name, row.source_sha256)
        return explain(row.fingerprint, candidates, values=values)

    def _candidates(
        self, recipe_key: str, base_key: str, name: str, source_sha256: str
    ) -> list[tuple[str, Mapping[str, Any]]]:
        """(key, fingerprint) of the recipes near one, most recently seen first."""
        c = _records.c
        columns = (c.recipe_key, c.fingerprint, c.last_seen_at)
        ways = (
            (c.source_sha256 == source_sha256, c.name == name),
            (c.base_key == base_key,),
        )
        found: dict[str, tuple[datetime, Mapping[str, Any]]] = {}
        with self.engine.connect() as conn:
            for where in ways:
                rows = conn.execute(
                    sa.select(*columns)
                    .where(*where, c.recipe_key != recipe_key)
                    .order_by(c.last_seen_at.desc())
                    .limit(CANDIDATES)
                )
                for key, fp, seen in rows:
                    if isinstance(fp, Mapping):
                        found[key] = (seen, fp)
        ordered = sorted(found.items(), key=lambda item: (item[1][0], item[0]), reverse=True)
        return [(key, fp) for key, (_, fp) in ordered]

    # ------------------------------------------------------------------ from requests
    def note(self, recipe: Recipe, record: AuditRecord | None = None, *, keep: bool) -> None:
        """Queue ``recipe`` to be recorded (``keep``) and the miss ``record`` to be explained.

        Quick, for any thread (the event loop too): the work happens in
        :meth:`prepare`, on the audit writer's thread, before ``record`` is written.
        """
        if self._notes.qsize() >= self.max_queued:
            self._count("queue_full")
            return
        self._notes.put(_Note(recipe, record, keep))

    def prepare(self, batch: list[AuditRecord]) -> None:
        """Do what was noted, in order: explain each miss, then record its recipe. Never raises.

        An :class:`~kcache_server.auditing.writer.AuditLog` preparer: a miss is noted
        before its audit record is queued, so every miss in ``batch`` is explained
        here, against every recipe recorded before it.
        """
        # Misses of one recipe key repeated in the batch are explained once, until a
        # recipe is recorded (which may be nearer, or the same recipe).
        explained: dict[str, str] = {}
        self._budget = MAX_EXPLAINED_PER_FLUSH  # the audit writer calls one batch at a time
        while True:
            try:
                item = self._notes.get_nowait()
            except queue.Empty:
                break
            record = item.record
            if record is not None and record.miss_reason is None:
                record.miss_reason = self._reason(item.recipe, explained)
            if item.keep:
                self.record(item.recipe)
                explained.clear()

    def _reason(self, recipe: Recipe, explained: dict[str, str]) -> str | None:
        key = recipe.key()
        reason = explained.get(key)
        if reason is not None or self._budget <= 0:
            return reason
        self._budget -= 1
        try:
            if self._recent.get(key) is not None or self._recorded(key):
                reason = SEEN_BEFORE
            else:
                # Stored for /v1/stats, which any read token may ask: no values.
                reason = miss_reason(self.nearest(recipe, values=False))
            explained[key] = reason
        except Exception as exc:  # the row is written without its reason
            self._failed("explain", exc)
            return None
        return reason

    # ------------------------------------------------------------------ failures
    def _count(self, operation: str) -> None:
        self.failures[operation] += 1
        for listener in self.failure_listeners:
            listener(operation)

    def _failed(self, operation: str, exc: BaseException) -> None:
        self._count(operation)
        if time.monotonic() - self._logged > _LOG_EVERY_S:
            self._logged = time.monotonic()
            cause = getattr(exc, "orig", None) or exc
            first = (str(cause).strip().splitlines() or [""])[0][:200]
            log.warning(
                "recipe records: %s failed (%d so far): %s: %s",
                operation,
                self.failures[operation],
                type(cause).__name__,
                first,
            )
