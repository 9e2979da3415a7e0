"""``kcache db rekey``: the recipes the server recorded and used lately, resolved under today's keys.

A change of the key schema (``KEY_SCHEMA``) gives every recipe a new key: after an
upgrade, clients compute keys the server has never seen, and a fleet would go back to
cold compiles. The server kept what it needs to avoid that: every recipe it compiled
or served, whole (``recipe_records``), as it prepared it then. :func:`rekey` reads
those used within a window and, for each, does what a request for it would do on this
server now:

- parse it and prepare it with the server's engine (:meth:`kcache.engine.Engine.prepare`):
  the toolchain recorded is kept (the check a request makes, that it is the toolchain
  this server runs, refuses one that is gone), include sets are pinned to their
  contents now (a pin recorded earlier is dropped first: clients pin the server's sets
  to the digests it publishes now);
- key it under the current schema; a key the index holds exactly is ``current``;
- else resolve it with compile (:meth:`kcache.engine.Engine.resolve`): ``compiled``
  here, ``waited`` for a running server that compiled it meanwhile (the engine's key
  lock makes each key compile once across processes), or ``matched`` when a manifest
  entry of its base key answers it without a compile; ``failed`` when it no longer
  compiles or cannot be prepared (its toolchain gone, an include set no longer
  configured), with the first line of the error;
- ``no_recipe``: a record whose body was not kept (over the size kept) or is unreadable.

A recipe is recorded again under its new key (as last seen when the old record was),
so ``GET /v1/recipes/{key}/recipe``, verification and a later rekey find it there.
Records that give the same new key (a recipe recorded under both schemas) are
resolved once. Compiles run in ``jobs`` threads through the server's own compile pool
(its workers, sandbox and limits, no quota charged), most recently used recipes first.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Literal

import sqlalchemy as sa

from kcache.artifact import ArtifactMeta, CompileFailure
from kcache.engine import failure_error
from kcache.errors import KCacheError, ToolchainError
from kcache.keys import KEY_SCHEMA
from kcache.recipe import Recipe, include_set_name
from kcache_server.backends import Backends
from kcache_server.models import recipe_records_table as _records
from kcache_server.models import utcnow
from kcache_server.recipe_records import RecipeRecords

__all__ = ["OUTCOMES", "Outcome", "RekeyFailure", "RekeyReport", "rekey", "unpinned"]

log = logging.getLogger(__name__)

Outcome = Literal["current", "compiled", "waited", "matched", "missing", "failed", "no_recipe"]
#: Every outcome, in the order a report lists them (``missing``: a dry run's would-compile).
OUTCOMES: tuple[Outcome, ...] = (
    "current",
    "compiled",
    "waited",
    "matched",
    "missing",
    "failed",
    "no_recipe",
)


@dataclass(frozen=True)
class RekeyFailure:
    """A recorded recipe that could not be resolved under the current schema."""

    recorded_key: str
    recipe_key: str | None  # its current key, when it could be keyed
    error: str  # the first line of the error

    def to_dict(self) -> dict[str, Any]:
        return {
            "recorded_key": self.recorded_key,
            "recipe_key": self.recipe_key,
            "error": self.error,
        }


@dataclass
class RekeyReport:
    """What :func:`rekey` found and did; ``counts`` are per distinct current key (and per body missing)."""

    since_days: float
    dry_run: bool
    records: int = 0  # recorded recipes used within the window
    counts: Counter[str] = field(default_factory=Counter)
    failures: list[RekeyFailure] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failures

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": KEY_SCHEMA,
            "since_days": self.since_days,
            "dry_run": self.dry_run,
            "records": self.records,
            **{outcome: self.counts[outcome] for outcome in OUTCOMES},
            "failures": [f.to_dict() for f in self.failures],
            "seconds": round(self.seconds, 3),
        }

    def summary(self) -> str:
        """One line: how many records, and what became of them."""
        hidden = ("compiled", "waited", "matched") if self.dry_run else ("missing",)
        shown = [f"{self.counts[o]} {o.replace('_', ' ')}" for o in OUTCOMES if o not in hidden]
        verb = "would rekey" if self.dry_run else "rekeyed"
        return (
            f"kcache: {verb} {self.records} recipes used in the last {self.since_days:g} days "
            f"under key schema {KEY_SCHEMA}: {', '.join(shown)} ({self.seconds:.1f}s)"
        )


def unpinned(data: dict[str, Any]) -> dict[str, Any]:
    """A recipe's JSON form with its include sets (and its linked recipes') named without digests."""
    out = dict(data)
    if "include_sets" in out:
        out["include_sets"] = [include_set_name(entry) for entry in out["include_sets"]]
    if "link" in out:
        out["link"] = [
            {**item, "recipe": unpinned(item["recipe"])} if "recipe" in item else item
            for item in out["link"]
        ]
    return out


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0][:500] if lines else type(exc).__name__


def _recent(db: sa.Engine, since_days: float) -> list[tuple[str, datetime]]:
    """(recipe key, last seen) of records seen within ``since_days``, most recent first."""
    cutoff = utcnow() - timedelta(days=since_days)
    c = _records.c
    with db.connect() as conn:
        rows = conn.execute(
            sa.select(c.recipe_key, c.last_seen_at)
            .where(c.last_seen_at >= cutoff)
            .order_by(c.last_seen_at.desc(), c.recipe_key)
        ).all()
    return [(key, seen) for key, seen in rows]


@dataclass(frozen=True)
class _Pending:
    recorded_key: str
    recipe: Recipe  # prepared, keyed under the current schema
    seen_at: datetime


def rekey(
    backends: Backends,
    records: RecipeRecords,
    *,
    since_days: float = 30.0,
    jobs: int = 1,
    dry_run: bool = False,
) -> RekeyReport:
    """Resolve every recipe recorded whole and seen within ``since_days`` under its current key.

    ``backends`` is the server's (:func:`kcache_server.backends.open_backends`), its
    compile pool not started: it is started here when something is to be compiled,
    and closed before returning. ``dry_run`` looks everything up, compiles and writes
    nothing (``missing``: what would be compiled). Where the toolchain compiles nothing
    (no NVRTC >= 13.3: :func:`kcache.toolchain.probe_toolchain`) it refuses at once,
    :class:`~kcache.errors.ToolchainError` naming why, rather than failing every recipe.
    """
    if not backends.toolchain.compiles:
        raise ToolchainError(
            "kcache db rekey checks and compiles recipes with this installation's toolchain, "
            f"and it cannot compile: {backends.toolchain.cannot_compile}"
        )
    started = time.perf_counter()
    report = RekeyReport(since_days=since_days, dry_run=dry_run)
    engine = backends.engine
    pending: list[_Pending] = []
    seen_keys: set[str] = set()
    for recorded_key, seen_at in _recent(backends.db, since_days):
        report.records += 1
        recorded = records.recipe(recorded_key)
        if recorded is None:
            report.counts["no_recipe"] += 1
            continue
        key: str | None = None
        try:
            recipe = engine.prepare(Recipe.from_dict(unpinned(recorded.to_dict())))
            backends.toolchain.check(recipe, "on this server")
            key = recipe.key()
            if key in seen_keys:
                continue
            seen_keys.add(key)
            entry = backends.index.lookup(key)
            if isinstance(entry, CompileFailure):
                raise failure_error(entry)
        except (KCacheError, ValueError, TypeError) as exc:
            report.counts["failed"] += 1
            report.failures.append(RekeyFailure(recorded_key, key, _first_line(exc)))
            continue
        if isinstance(entry, ArtifactMeta):
            report.counts["current"] += 1
            if not dry_run:
                _record(records, recipe, seen_at)
        elif dry_run:
            report.counts["missing"] += 1
        else:
            pending.append(_Pending(recorded_key, recipe, seen_at))
    if pending:
        _resolve_all(backends, records, pending, jobs, report)
    report.seconds = time.perf_counter() - started
    return report


def _resolve_all(
    backends: Backends,
    records: RecipeRecords,
    pending: list[_Pending],
    jobs: int,
    report: RekeyReport,
) -> None:
    """Resolve ``pending`` with compile, ``jobs`` at a time, counting each into ``report``."""
    backends.compiler.start()
    try:

        def one(item: _Pending) -> tuple[_Pending, Outcome, BaseException | None]:
            try:
                resolution = backends.engine.resolve(item.recipe, compile=True)
            except (KCacheError, ValueError, TypeError) as exc:
                return item, "failed", exc
            _record(records, item.recipe, item.seen_at)
            if resolution.status == "compiled":
                return item, "compiled", None
            if resolution.status == "waited":
                return item, "waited", None
            return item, ("matched" if resolution.via == "manifest" else "current"), None

        with ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="kcache-rekey") as pool:
            for item, outcome, exc in pool.map(one, pending):
                report.counts[outcome] += 1
                if exc is not None:
                    report.failures.append(
                        RekeyFailure(item.recorded_key, item.recipe.key(), _first_line(exc))
                    )
    finally:
        backends.compiler.close()


def _record(records: RecipeRecords, recipe: Recipe, seen_at: datetime) -> None:
    """Record ``recipe`` under its current key, as last seen at ``seen_at`` (kept if recorded)."""
    try:
        records.record_as_seen(recipe, seen_at)
    except Exception:  # the kernel is resolved; only explanations and later rekeys miss it
        log.warning("rekey: could not record recipe %s", recipe.key(), exc_info=True)
