"""What the routes do, apart from HTTP: the server state, recipe checks, resolving with audit.

The engine is synchronous (NVRTC, file and database I/O); routes call it on worker
threads through one bounded limiter, so a burst of compiles cannot exhaust threads,
and through a per-caller share of it, so one caller's parked requests cannot either.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import anyio
from anyio import to_thread

from kcache.artifact import ArtifactMeta, CompileFailure
from kcache.compiler import kernel_name
from kcache.deps import include_set_files_unchanged
from kcache.engine import Resolution, failure_error
from kcache.errors import ArtifactNotFoundError, KCacheError, RecipeError
from kcache.keys import is_hex_key
from kcache.recipe import Recipe
from kcache_server._lru import Lru
from kcache_server.audit import AuditLog, AuditRecord
from kcache_server.auth import TokenStore
from kcache_server.backends import Backends
from kcache_server.errors import BadRequestError, error_body, error_info
from kcache_server.fairness import CallerSlots, current_caller
from kcache_server.schemas import Context
from kcache_server.settings import Settings

__all__ = ["ServerState", "check_key", "prepare_recipe"]

# Blobs above this are served from disk every time instead of crowding the memory cache.
_MAX_CACHED_BLOB = 16 << 20


def check_key(value: str, what: str) -> str:
    """``value`` if it is a sha256 hex key, else a 400 naming ``what``."""
    if not is_hex_key(value):
        raise BadRequestError(
            f"{what} must be 64 lowercase hex digits (a sha256), got {value[:80]!r}"
        )
    return value


def _check_supported(recipe: Recipe, backends: Backends, where: str = "") -> None:
    toolchain = backends.toolchain
    if recipe.toolchain != toolchain.id:
        raise RecipeError(
            f"{where}toolchain",
            f"{recipe.toolchain!r} is not available on this server; it has {toolchain.id!r} "
            "(omit the field to use the server's default)",
        )
    target = recipe.parsed_target
    if not toolchain.supports(target.sm):
        supported = ", ".join(f"sm_{sm}" for sm in toolchain.supported_sms)
        raise RecipeError(
            f"{where}target", f"{target.text} is not supported by this server's NVRTC ({supported})"
        )
    for i, item in enumerate(recipe.link):
        if item.recipe is not None:
            _check_supported(item.recipe, backends, f"{where}link[{i}].recipe.")


def prepare_recipe(data: Mapping[str, Any], backends: Backends) -> Recipe:
    """Validate an untrusted recipe object and fill in the server's defaults."""
    try:
        recipe = Recipe.from_dict(data)
    except RecipeError:
        raise
    except (TypeError, ValueError) as exc:  # a wrong JSON type the field checks did not anticipate
        raise RecipeError("recipe", f"malformed: {exc}") from exc
    recipe = backends.engine.prepare(recipe)
    _check_supported(recipe, backends)
    return recipe


@dataclass
class ServerState:
    """Everything a request needs, built once per server process."""

    settings: Settings
    backends: Backends
    audit: AuditLog
    tokens: TokenStore
    blobs: Lru[str, bytes] = field(init=False)
    metas: Lru[str, ArtifactMeta] = field(init=False)
    limiter: anyio.CapacityLimiter | None = None
    caller_slots: CallerSlots = field(init=False)

    def __post_init__(self) -> None:
        self.blobs = Lru(self.settings.blob_cache_bytes, len)
        self.metas = Lru(100_000)
        threads = self.settings.request_threads
        self.caller_slots = CallerSlots(self.settings.caller_threads or max(1, threads // 2))

    async def run(self, func: Any, *args: Any, **kwargs: Any) -> Any:
        """Run a blocking call on a worker thread under the shared limiter and the caller's share."""
        async with self.caller_slots.hold(current_caller.get()):
            return await to_thread.run_sync(lambda: func(*args, **kwargs), limiter=self.limiter)

    # ------------------------------------------------------------------ resolving
    def resolve(
        self, recipe: Recipe, compile: bool, context: Context, route: str
    ) -> dict[str, Any]:
        """Resolve one prepared recipe, record the audit event, and return the response body."""
        started = time.perf_counter()
        try:
            result = self.backends.engine.resolve(recipe, compile=compile)
        except ArtifactNotFoundError as exc:
            self._audit(recipe, context, route, started, "miss", error="not_found")
            raise ArtifactNotFoundError(
                f"no artifact for recipe {recipe.key()} (and compile is false)"
            ) from exc
        except KCacheError as exc:
            self._audit(recipe, context, route, started, "error", error=error_info(exc).code)
            raise
        self._audit(recipe, context, route, started, result.status, result=result)
        self.metas.put(result.recipe_key, result.artifact)
        return result.to_dict()

    def resolve_warm(self, recipe: Recipe, context: Context, route: str) -> dict[str, Any] | None:
        """A hit answered from memory (no worker thread, no database), or None to ask the engine.

        The memo holds what the engine or the index answered for this exact key; its
        include-set files are re-checked and its blob must still be in the store.
        """
        started = time.perf_counter()
        key = recipe.key()
        meta = self.warm_artifact(key)
        if meta is None or not self.backends.store.has(meta.digest):
            return None
        result = Resolution("hit", key, recipe.base_key(), meta, recipe, 0.0)
        self._audit(recipe, context, route, started, "hit", result=result)
        return result.to_dict()

    def resolve_or_error(
        self, recipe: Recipe, compile: bool, context: Context, route: str
    ) -> dict[str, Any]:
        """Like :meth:`resolve`, but an error becomes a ``{"status": "error", ...}`` result."""
        try:
            return self.resolve(recipe, compile, context, route)
        except KCacheError as exc:
            return {"status": "error", **error_body(exc)}

    def _audit(
        self,
        recipe: Recipe,
        context: Context,
        route: str,
        started: float,
        outcome: str,
        *,
        result: Resolution | None = None,
        error: str | None = None,
    ) -> None:
        meta = result.artifact if result is not None else None
        saved = meta.compile_seconds if meta is not None and outcome in ("hit", "waited") else 0.0
        latency_ms = (time.perf_counter() - started) * 1000.0
        who = context.model_dump()

        def make() -> AuditRecord:
            return AuditRecord(
                outcome=outcome,
                route=route,
                latency_ms=latency_ms,
                recipe_key=recipe.key(),
                base_key=recipe.base_key(),
                digest=meta.digest if meta is not None else None,
                kernel=kernel_name(recipe)[:1024],
                target=recipe.target,
                toolchain=recipe.toolchain,
                error=error,
                compile_seconds_saved=saved,
                **who,
            )

        if outcome == "hit" and meta is not None:
            # Repeated hits of one recipe by one caller become one counted row per flush.
            tally = (route, recipe.key(), meta.digest, *who.values())
            self.audit.tally(tally, make, latency_ms, saved)
        else:
            self.audit.record(make())

    # ------------------------------------------------------------------ the fetch path
    def warm_artifact(self, recipe_key: str) -> ArtifactMeta | None:
        """The memoised metadata for ``recipe_key`` if it is still valid, without I/O on the index.

        Valid means its include-set files are unchanged: a recipe key does not cover them.
        """
        meta = self.metas.get(recipe_key)
        if meta is not None and not include_set_files_unchanged(
            meta.dependencies, self.backends.compiler.include_sets
        ):
            self.metas.discard(recipe_key)
            return None
        return meta

    def artifact_for_key(self, recipe_key: str) -> ArtifactMeta:
        """Metadata of the artifact recorded for ``recipe_key`` (memoised; include sets re-checked)."""
        meta = self.warm_artifact(recipe_key)
        if meta is not None:
            return meta
        entry = self.backends.index.lookup(recipe_key)
        if entry is None:
            raise ArtifactNotFoundError(f"no artifact for recipe {recipe_key}")
        if isinstance(entry, CompileFailure):
            raise failure_error(entry)
        meta = entry
        if not include_set_files_unchanged(meta.dependencies, self.backends.compiler.include_sets):
            raise ArtifactNotFoundError(
                f"the artifact for recipe {recipe_key} read include-set files that have changed since; "
                "resolve the recipe again"
            )
        # Aliases only ever point at identical bytes, so a memoised entry cannot go stale;
        # the blob read below notices one that was garbage-collected.
        self.metas.put(recipe_key, meta)
        return meta

    def blob(self, digest: str) -> bytes:
        """The verified bytes of a blob (hot ones from memory)."""
        data = self.blobs.get(digest)
        if data is None:
            try:
                data = self.backends.store.get(digest)
            except ArtifactNotFoundError:  # the store's message names its directory: not for callers
                raise ArtifactNotFoundError(f"no blob {digest}") from None
            if len(data) <= _MAX_CACHED_BLOB:
                self.blobs.put(digest, data)
        return data

    def record_fetch(
        self, recipe_key: str, meta: ArtifactMeta | None, started: float, outcome: str
    ) -> None:
        """Audit a ``GET /v1/recipes/{key}/artifact`` (identical hits are tallied, not rowed)."""
        latency_ms = (time.perf_counter() - started) * 1000.0

        def make() -> AuditRecord:
            return AuditRecord(
                outcome=outcome,
                route="fetch",
                latency_ms=latency_ms,
                recipe_key=recipe_key,
                digest=meta.digest if meta else None,
                kernel=meta.kernel if meta else None,
                target=meta.target if meta else None,
                toolchain=meta.toolchain if meta else None,
            )

        if meta is not None and outcome == "hit":
            self.audit.tally(
                ("fetch", recipe_key, meta.digest), make, latency_ms, meta.compile_seconds
            )
        else:
            self.audit.record(make())
