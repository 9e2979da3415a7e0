"""Verified hits: the server compiles a sample of what it serves again and compares.

kcache's answers rest on its keys and on a dependency list NVRTC produces as a side
output. The :class:`Verifier` checks both continuously, in production:

- **What is checked.** Every artifact served through a manifest match (it rests on
  the dependency list alone) becomes a candidate when it is served; of exact-key hits,
  a sample (``sample_rate`` of first sightings: the compile, or the first engine hit
  after a restart; later hits from memory count towards a candidate's priority). Candidates are taken manifest matches
  first, then by how often and how recently they were served; each at most once per
  ``period_s``. At most ``max_candidates`` are remembered (the least served go first).
- **How.** The recipe is compiled again in a verification worker: a compile pool of
  its own (one worker, confined like the others, its niceness raised by 19), so it
  never takes a worker, a queue place or a lock a real compile needs, and the kernel
  gives real compiles the CPU first. Between verifications the verifier sleeps so
  that it is busy at most ``cpu_share`` of the time. The fresh output is compared with
  the stored artifact **by its bytes**, and so are the lowered names: every compile is
  seeded from its recipe's base key (:func:`kcache.nvrtc.compile_seed`), so a compile
  of a recipe is the same bytes in any process, cubin, ``-G`` cubin and LTO-IR alike.
- **A divergence is an incident.** The binding of the recipe that diverged (its key
  and the digest it answered) is withdrawn at once
  (:meth:`~kcache_server.index.SqlIndex.withdraw_binding`: the key's alias and its base
  key's manifest entries naming the digest go, and a ``withdrawals`` row says so, which
  every replica and worker process reads within a second and clients read from
  ``GET /v1/withdrawals``; this process forgets the key at once). The digest itself is
  not withdrawn: other recipes bound to the same bytes are right to be. The fresh
  compile is published for the recipe, so callers get it, and the event is recorded with what differed and
  how the artifact had been served (``verification_events``), counted
  (``kcache_verified_total{result}``, ``kcache_verification_divergences_total``), and
  shown in ``GET /v1/verification`` and on the dashboard.

A recipe that no longer compiles (an include set changed under it, a toolchain
problem) is recorded as ``failed``, never as a divergence. A server that cannot compile
at all (:mod:`kcache_server.compiler_presence`) verifies nothing: its verifier is off,
and ``GET /v1/verification`` says why (``disabled_reason``).

**A divergence is different code, nothing else.** Bytes (or lowered names) that differ
diverge; the dependency lists are listed beside them, as a clue. The same bytes and
names never diverge, whatever the lists say: an artifact row keeps the metadata of the
first compile of its bytes, so another recipe with the same bytes (the same source
with an in-memory header of comments on top: a "padded twin") reads more files than the
row lists. Calling that a divergence let a compile token withdraw another team's
kernel. Such a list is *learned* instead: the fresh output is published for the
recipe, which records a manifest entry under its base key with its own list (the
artifact row and the alias stay as they are), and the verdict is ``same_bytes`` with
a note of what was learned. A manifest entry that lacks a file the compile reads (only
a broken proof could write one) stays until a match through it gives other bytes:
every answer served through a manifest match is verified, and that one diverges.

Why no "seeded" mark on artifacts (and no migration): the seed came with key schema 2
(:data:`kcache.keys.KEY_SCHEMA`), and a schema-2 key is bound only by a compile of this
release (the engine's publish, a manifest entry recorded by one, ``kcache db rekey``),
so every binding the verifier meets rests on seeded bytes, and differing bytes are
different code. An artifact compiled unseeded is served only under schema-1 keys, which
are never looked up again; ``kcache db verify --recompile`` skips the recipes recorded
under such a key (:func:`verify_offline`), so none is compared with a seeded compile.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal, Protocol

import sqlalchemy as sa

from kcache.artifact import ArtifactMeta, CompileOutput
from kcache.engine import Resolution, Via
from kcache.errors import IncludeSetChangedError, KCacheError, ToolchainError
from kcache.nvrtc import kernel_name
from kcache.recipe import Recipe
from kcache_server.auditing.writer import AuditRecord
from kcache_server.backends import Backends
from kcache_server.compile_pool import ProcessPoolCompiler
from kcache_server.models import utcnow
from kcache_server.models import verification_events_table as _events
from kcache_server.recipe_records import RecipeRecords
from kcache_server.state import ServerState

__all__ = [
    "Verdict",
    "VerificationReport",
    "Verifier",
    "install_verification",
    "verify_offline",
]

log = logging.getLogger(__name__)


#: Events recorded before compiles were seeded may also say ``same_code`` (equal once
#: NVRTC's random tags were unified) or ``inconclusive`` (LTO-IR differing in bytes).
Result = Literal["same_bytes", "diverged", "failed"]
#: Lines of differences kept per event, and characters per line.
_MAX_DIFFERENCES = 12
_MAX_LINE = 300


class _Withdraw(Protocol):
    """:meth:`SqlIndex.withdraw_binding <kcache_server.index.SqlIndex.withdraw_binding>`'s shape."""

    def __call__(self, recipe_key: str, digest: str, reason: str, *, base_key: str) -> object:
        """Withdraw the binding ``recipe_key`` -> ``digest`` (``base_key`` the recipe's)."""
        ...


@dataclass
class _Candidate:
    recipe: Recipe
    recipe_key: str
    base_key: str
    digest: str
    via: Via
    served: int = 1
    last_served: float = field(default_factory=time.monotonic)
    verified_at: float | None = None

    def priority(self, now: float) -> tuple[int, float]:
        """Larger first: manifest matches, then served often and lately (an hour's half-life)."""
        decay = 0.5 ** ((now - self.last_served) / 3600.0)
        return (1 if self.via == "manifest" else 0, self.served * decay)


@dataclass(frozen=True)
class Verdict:
    """What one verification found."""

    recipe_key: str
    base_key: str
    via: str
    result: Result
    stored_digest: str
    fresh_digest: str | None
    kernel: str
    differences: tuple[str, ...]
    seconds: float


@dataclass(frozen=True)
class VerificationReport:
    """The body of ``GET /v1/verification``."""

    enabled: bool
    verified: dict[str, int]
    served: int
    covered: int
    divergences: list[dict[str, Any]]
    disabled_reason: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {
            "enabled": self.enabled,
            "disabled_reason": self.disabled_reason,
            "verified": self.verified,
            "served_recipes": self.served,
            "verified_recipes": self.covered,
            "coverage": round(self.covered / self.served, 4) if self.served else None,
            "divergences": self.divergences,
        }


class Verifier:
    """Samples served artifacts, compiles them again in its own worker and compares.

    ``compile`` runs a recipe in the verification pool; ``publish`` stores a fresh
    output for a recipe (the engine's publish); ``withdraw`` withdraws a binding
    (:meth:`~kcache_server.index.SqlIndex.withdraw_binding`); ``forget`` drops a withdrawn
    binding (recipe key, digest) from the server's memory; ``read`` gives a stored
    artifact's verified bytes; ``count`` is called with each result for the metrics.
    """

    def __init__(
        self,
        db: sa.Engine,
        *,
        compile: Callable[[Recipe], CompileOutput],
        read: Callable[[ArtifactMeta], bytes],
        lookup: Callable[[str], ArtifactMeta | None],
        publish: Callable[[Recipe, CompileOutput], ArtifactMeta],
        withdraw: _Withdraw,
        forget: Callable[[str, str], None],
        count: Callable[[str], None] = lambda result: None,
        enabled: bool = True,
        disabled_reason: str | None = None,
        sample_rate: float = 0.05,
        period_s: float = 86_400.0,
        cpu_share: float = 0.05,
        max_candidates: int = 10_000,
        interval_s: float = 1.0,
    ) -> None:
        self.db = db
        self._compile = compile
        self._read = read
        self._lookup = lookup
        self._publish = publish
        self._withdraw = withdraw
        self._forget = forget
        self._count = count
        self.enabled = enabled
        #: Why verification is off, for its report (None: off by the setting, or on).
        self.disabled_reason = disabled_reason
        self.sample_rate = sample_rate
        self.period_s = period_s
        self.cpu_share = cpu_share
        self.max_candidates = max_candidates
        self.interval_s = interval_s
        self._candidates: dict[str, _Candidate] = {}
        self._passed_over: set[str] = set()  # exact-key hits not sampled (bounded like the rest)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._random = random.Random()

    # ------------------------------------------------------------------ sampling
    def observe(self, resolution: Resolution) -> None:
        """Note a served artifact (an engine observer: called with every resolution)."""
        # A compile counts as a first sighting too: a warm server answers later hits from
        # memory (note_hit), which the engine never sees, so a key first met compiled
        # would otherwise never be sampled (bench/b13_verification.py found none were).
        if not self.enabled or resolution.status not in ("hit", "waited", "compiled"):
            return
        key = resolution.recipe_key
        with self._lock:
            known = self._candidates.get(key)
            if known is not None:
                known.served += 1
                known.last_served = time.monotonic()
                if resolution.via == "manifest" or known.via == "compile":
                    known.via = resolution.via  # how it is served, once it is
                known.digest = resolution.artifact.digest
                return
            if resolution.via != "manifest":
                if key in self._passed_over:
                    return
                if self._random.random() >= self.sample_rate:
                    if len(self._passed_over) < self.max_candidates:
                        self._passed_over.add(key)
                    return
            self._make_room()
            self._candidates[key] = _Candidate(
                resolution.recipe,
                key,
                resolution.base_key,
                resolution.artifact.digest,
                resolution.via,
            )

    def note_hit(self, recipe_key: str | None) -> None:
        """Count a hit the server answered from memory (no engine call: no resolution)."""
        if recipe_key is None:
            return
        with self._lock:
            known = self._candidates.get(recipe_key)
            if known is not None:
                known.served += 1
                known.last_served = time.monotonic()
                if known.via == "compile":
                    known.via = "key"  # a hit from memory is one by exact key

    def _make_room(self) -> None:
        if len(self._candidates) < self.max_candidates:
            return
        now = time.monotonic()
        least = min(self._candidates.values(), key=lambda c: c.priority(now))
        del self._candidates[least.recipe_key]

    def _next(self) -> _Candidate | None:
        now = time.monotonic()
        with self._lock:
            due = [
                c
                for c in self._candidates.values()
                if c.verified_at is None or now - c.verified_at >= self.period_s
            ]
            if not due:
                return None
            chosen = max(due, key=lambda c: c.priority(now))
            chosen.verified_at = now
            return chosen

    # ------------------------------------------------------------------ verifying
    def verify_next(self) -> Verdict | None:
        """Verify the most deserving candidate now (None when none is due)."""
        candidate = self._next()
        return None if candidate is None else self.verify(candidate)

    def verify(self, candidate: _Candidate) -> Verdict | None:
        """Compile ``candidate`` again, compare, act on a divergence and record the event.

        None when the recipe's key no longer names an artifact (evicted meanwhile).
        """
        started = time.perf_counter()
        meta = self._lookup(candidate.recipe_key)  # what the key serves now
        if meta is None:
            with self._lock:
                self._candidates.pop(candidate.recipe_key, None)
            return None
        fresh_digest: str | None = None
        differences: list[str] = []
        try:
            fresh = self._compile(candidate.recipe)
            result, differences = self._compare(candidate, meta, fresh)
        except IncludeSetChangedError:
            # Its include set was edited since: the key names contents that are gone, so
            # nothing can be compared (and nothing will serve it: keys pin the contents).
            with self._lock:
                self._candidates.pop(candidate.recipe_key, None)
            return None
        except KCacheError as exc:  # no longer compiles, or the stored copy is damaged
            result = "failed"
            differences = [f"could not compare: {exc}"]
        if result == "diverged":
            fresh_digest = self._quarantine(candidate, meta, fresh, differences)
        verdict = Verdict(
            candidate.recipe_key,
            candidate.base_key,
            candidate.via,
            result,
            meta.digest,
            fresh_digest,
            kernel_name(candidate.recipe)[:1024],
            tuple(line[:_MAX_LINE] for line in differences[:_MAX_DIFFERENCES]),
            time.perf_counter() - started,
        )
        self._record(verdict)
        self._count(result)
        if result == "diverged":
            log.error(
                "VERIFICATION DIVERGED: recipe %s (served by %s) was answered with %s, a fresh "
                "compile differs (%s); withdrawn and replaced by %s",
                verdict.recipe_key,
                "manifest match" if verdict.via == "manifest" else "exact key",
                verdict.stored_digest,
                "; ".join(verdict.differences),
                verdict.fresh_digest,
            )
        return verdict

    def _compare(
        self, candidate: _Candidate, meta: ArtifactMeta, fresh: CompileOutput
    ) -> tuple[Result, list[str]]:
        """Bytes and lowered names decide; a different dependency list alone is learned.

        (The module docstring says why.) Returns the result and what differed, or for
        ``same_bytes`` what was learned.
        """
        stored = self._read(meta)
        differences: list[str] = []
        if stored != fresh.data:
            differences.append(f"code: {_byte_difference(stored, fresh.data)}")
        if dict(meta.lowered_names) != dict(fresh.lowered_names):
            differences.append(
                f"lowered names {sorted(meta.lowered_names.items())[:4]} -> "
                f"{sorted(fresh.lowered_names.items())[:4]}"
            )
        stored_deps = {(d.name, d.sha256) for d in meta.dependencies}
        fresh_deps = {(d.name, d.sha256) for d in fresh.dependencies}
        lists = [
            f"dependency {name} ({digest[:8]}..) read but not recorded"
            for name, digest in sorted(fresh_deps - stored_deps)
        ] + [
            f"dependency {name} ({digest[:8]}..) recorded but not read"
            for name, digest in sorted(stored_deps - fresh_deps)
        ]
        if differences:
            return "diverged", differences + lists
        if not lists:
            return "same_bytes", []
        try:  # a manifest entry under this recipe's base key with the list it read
            self._publish(candidate.recipe, fresh)
        except Exception:  # the bytes agree whether or not the list is recorded now
            log.warning(
                "could not record the dependencies of %s", candidate.recipe_key, exc_info=True
            )
            return "same_bytes", ["same bytes, other dependencies (not recorded):", *lists]
        return "same_bytes", ["same bytes, other dependencies (learned into the manifest):", *lists]

    def _quarantine(
        self,
        candidate: _Candidate,
        meta: ArtifactMeta,
        fresh: CompileOutput,
        differences: list[str],
    ) -> str:
        """Withdraw this recipe's binding to the stored digest everywhere; publish the fresh compile."""
        reason = "verification: " + "; ".join(differences)
        self._withdraw(candidate.recipe_key, meta.digest, reason, base_key=candidate.base_key)
        published = self._publish(candidate.recipe, fresh)
        self._forget(candidate.recipe_key, meta.digest)
        with self._lock:
            candidate.digest = published.digest
        return published.digest

    def _record(self, verdict: Verdict) -> None:
        try:
            with self.db.begin() as conn:
                conn.execute(
                    sa.insert(_events).values(
                        at=utcnow(),
                        recipe_key=verdict.recipe_key,
                        base_key=verdict.base_key,
                        via=verdict.via,
                        result=verdict.result,
                        stored_digest=verdict.stored_digest,
                        fresh_digest=verdict.fresh_digest,
                        kernel=verdict.kernel,
                        differences=list(verdict.differences),
                        seconds=verdict.seconds,
                    )
                )
        except sa.exc.SQLAlchemyError:
            log.warning("could not record a verification of %s", verdict.recipe_key, exc_info=True)

    # ------------------------------------------------------------------ the thread
    def start(self) -> None:
        """Verify in the background until :meth:`close`."""
        if not self.enabled or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="kcache-verifier", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the background thread (a verification in progress finishes first)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                verdict = self.verify_next()
            except Exception:  # the verifier must never take the server down
                log.exception("verification failed")
                continue
            if verdict is not None and self.cpu_share < 1.0:
                # Busy at most cpu_share of the time: rest (1/share - 1) times what it took.
                self._stop.wait(verdict.seconds * (1.0 / self.cpu_share - 1.0))

    # ------------------------------------------------------------------ reporting
    def report(self, *, since_days: float = 30.0, limit: int = 50) -> VerificationReport:
        """Counts by result, coverage of the recipes seen served, the latest divergences."""
        since = utcnow() - timedelta(days=since_days)
        with self.db.connect() as conn:
            counts: dict[str, int] = {
                str(result): int(n)
                for result, n in conn.execute(
                    sa.select(_events.c.result, sa.func.count())
                    .where(_events.c.at >= since)
                    .group_by(_events.c.result)
                ).all()
            }
            rows = conn.execute(
                sa.select(_events)
                .where(_events.c.result == "diverged", _events.c.at >= since)
                .order_by(_events.c.at.desc(), _events.c.id.desc())
                .limit(limit)
            ).all()
        with self._lock:
            served = len(self._candidates) + len(self._passed_over)
            covered = sum(1 for c in self._candidates.values() if c.verified_at is not None)
        return VerificationReport(
            self.enabled,
            counts,
            served,
            covered,
            [
                {
                    "at": row.at.isoformat(),
                    "recipe_key": row.recipe_key,
                    "base_key": row.base_key,
                    "via": row.via,
                    "stored_digest": row.stored_digest,
                    "fresh_digest": row.fresh_digest,
                    "kernel": row.kernel,
                    "differences": list(row.differences),
                }
                for row in rows
            ],
            self.disabled_reason,
        )


def _byte_difference(stored: bytes, fresh: bytes) -> str:
    """Where two outputs part: their sizes and the first byte that differs."""
    at = next(
        (i for i, (a, b) in enumerate(zip(stored, fresh, strict=False)) if a != b),
        min(len(stored), len(fresh)),
    )
    return f"{len(stored)} bytes stored, {len(fresh)} compiled, the first difference at byte {at}"


def install_verification(state: ServerState) -> tuple[Verifier, ProcessPoolCompiler | None]:
    """The process's verifier over ``state``, and its one-worker pool; start both in the lifespan.

    The verifier watches the engine's resolutions and the memory hits the audit log
    sees. Its pool is built like the server's own (same toolchain, include sets,
    limits and confinement) with one worker, niceness +19.
    """
    settings = state.settings
    options = settings.verify
    backends = state.backends
    pool: ProcessPoolCompiler | None = None
    enabled, disabled_reason = options.enabled, None
    if not options.enabled:
        disabled_reason = "verification is turned off (verify.enabled = false)"
    elif not backends.toolchain.compiles:
        # Verifying is compiling again; a fetch-only server says why it does not, once.
        enabled = False
        disabled_reason = (
            "verification compiles served recipes again, and this server cannot compile: "
            f"{backends.toolchain.cannot_compile}"
        )
        log.warning("kcache server: verified hits are off: %s", disabled_reason)
    if enabled:
        main = backends.compiler
        pool = ProcessPoolCompiler(
            main.toolchain,
            main.include_sets,
            workers=1,
            timeout_s=main.timeout_s,
            memory_mb=main.memory_mb,
            queue_limit=1,
            tmp_dir=main.tmp_dir,
            toolchain_dir=main.toolchain_dir,
            min_free_bytes=main.min_free_bytes,
            compile_sandbox=main.sandbox_mode,
            nice=19,
        )
    engine = backends.engine
    metrics = state.metrics
    starting = threading.Lock()
    started: list[bool] = []

    def compile(recipe: Recipe) -> CompileOutput:
        assert pool is not None
        # A recipe pinned to an include set's earlier contents cannot be compiled again
        # (the files are gone): IncludeSetChangedError, before the compile and after it.
        engine.check_include_sets(recipe)
        with starting:  # the worker starts with the first verification, not with the server
            if not started:
                pool.start()
                started.append(True)
        output = pool.compile(recipe, engine.link_inputs(recipe))
        engine.check_include_sets(recipe, max_age_s=0)
        return output

    def lookup(recipe_key: str) -> ArtifactMeta | None:
        entry = backends.index.lookup(recipe_key)
        return entry if isinstance(entry, ArtifactMeta) else None

    def publish(recipe: Recipe, output: CompileOutput) -> ArtifactMeta:
        return engine.publish(recipe, recipe.key(), recipe.base_key(), output)

    def count(result: str) -> None:
        metrics.verified.labels(result).inc()
        if result == "diverged":
            metrics.divergences.inc()

    verifier = Verifier(
        backends.db,
        compile=compile,
        read=engine.read,
        lookup=lookup,
        publish=publish,
        withdraw=backends.index.withdraw_binding,
        forget=state.resolver.withdraw,
        count=count,
        enabled=enabled,
        disabled_reason=disabled_reason,
        sample_rate=options.sample_rate,
        period_s=options.period_s,
        cpu_share=options.cpu_share,
        max_candidates=options.max_candidates,
    )
    engine.observers.append(verifier.observe)

    def on_hit(record: AuditRecord) -> None:
        if record.outcome == "hit":
            verifier.note_hit(record.recipe_key)

    state.audit.listeners.append(on_hit)
    return verifier, pool


def verify_offline(
    backends: Backends, records: RecipeRecords, sample: int | None = None
) -> list[Verdict]:
    """``kcache db verify --recompile``: verify recorded recipes of a data directory here.

    The recipes the server recorded whole (``recipe_records``), ``sample`` of them drawn
    at random or all, are compiled in this process and compared with what their keys
    serve, exactly as the server's verifier does, divergences withdrawn and replaced
    and recorded the same way. A key whose recipe was not kept is not verified, nor one
    the recipe no longer has (recorded under an older key schema: compiled unseeded, and
    never looked up again).
    """
    from kcache.nvrtc import compile_recipe
    from kcache_server.models import recipe_aliases_table as aliases

    if not backends.toolchain.compiles:
        raise ToolchainError(
            "kcache db verify --recompile compiles recorded recipes again, and this "
            f"installation cannot compile: {backends.toolchain.cannot_compile}"
        )
    from kcache_server.models import recipe_records_table as records_table

    engine = backends.engine
    query = (
        sa.select(records_table.c.recipe_key, records_table.c.base_key)
        .join(aliases, aliases.c.recipe_key == records_table.c.recipe_key)
        .where(records_table.c.recipe_zlib.is_not(None))
    )
    if sample is not None:
        query = query.order_by(sa.func.random()).limit(sample)
    with backends.db.connect() as conn:
        keys = conn.execute(query).all()

    def lookup(recipe_key: str) -> ArtifactMeta | None:
        entry = backends.index.lookup(recipe_key)
        return entry if isinstance(entry, ArtifactMeta) else None

    verifier = Verifier(
        backends.db,
        compile=lambda recipe: compile_recipe(
            recipe, backends.toolchain, backends.compiler.include_sets, engine.link_inputs(recipe)
        ),
        read=engine.read,
        lookup=lookup,
        publish=lambda recipe, output: engine.publish(
            recipe, recipe.key(), recipe.base_key(), output
        ),
        withdraw=backends.index.withdraw_binding,
        forget=lambda recipe_key, digest: None,  # no server memory here: running servers
        enabled=True,  # read the withdrawal like any other
    )
    verdicts = []
    for recipe_key, base_key in keys:
        recipe = records.recipe(recipe_key)
        meta = lookup(recipe_key)
        if recipe is None or meta is None or not _keyed_alike(recipe, recipe_key):
            continue
        verdict = verifier.verify(_Candidate(recipe, recipe_key, base_key, meta.digest, "key"))
        if verdict is not None:
            verdicts.append(verdict)
    return verdicts


def _keyed_alike(recipe: Recipe, recipe_key: str) -> bool:
    """Whether ``recipe`` has the key it was recorded under (not so for an older key schema)."""
    try:
        return recipe.key() == recipe_key
    except KCacheError:  # no longer keyable as it was recorded
        return False
