"""The get path of a ``KernelCache``: a recipe through memory, the node tier and the server.

    get(recipe) -> prepare (auto target, default toolchain) -> recipe_key
               -> memory -> node tier -> [per-key node lock] -> node tier again
               -> GET /v1/recipes/{key}/artifact (bytes and metadata, one round trip)
               -> on a miss: POST /v1/resolve (compile if allowed), GET /v1/blobs/{digest}
               -> verified -> published into the node tier -> memory

One ``get`` is one lookup on the server's books, counted once with the outcome the
caller sees. A kernel the server holds is one request (the fetch, audited as its
``hit``: B8 counts the requests per kernel, and a warm fetch must stay one round trip,
so the fetch is not replaced by a resolve). A kernel it does not hold costs the fetch's
404 and then a resolve, which is audited (``compiled``, ``waited``, or ``miss`` with
``compile=False``); the fetch says so with ``X-KCache-On-Miss: resolve``
(:data:`kcache.artifact_header.ON_MISS_HEADER`), and the server does not audit that
404 as a ``miss`` of its own. Without it a first ``get`` counted two lookups, a miss
and a compile, and the hit rate on the dashboard was too low. The header is sent on
every request of the cache's transport: it states what this client does after any
fetch that misses, and only the fetch route reads it.

``get_many`` does the same for many recipes with ``/v1/resolve/batch`` (what a warmup's
leader runs). When the server cannot be reached the tier still answers, and a worker
with NVRTC and local compiles enabled compiles with the core engine over the tier
(:mod:`~kcache_client._local`). The server's side of each exchange, with every answer
checked, is :mod:`~kcache_client._remote`. The path keeps the in-process copies, the
process's manifest, the freeze mode (:mod:`~kcache_client._freeze`) and the watch over
the server's withdrawals (:mod:`~kcache_client._withdrawal_watch`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from kcache.artifact import ArtifactMeta
from kcache.errors import CompileError, IncludeSetChangedError, KCacheError, RecipeError
from kcache.job_manifest import ManifestKernel
from kcache.lru import LruCache
from kcache.recipe import Recipe
from kcache.signing import Signature
from kcache_client._artifact import Artifact, ArtifactOrigin
from kcache_client._events import EventSink, tally_key
from kcache_client._freeze import Freezer
from kcache_client._include_pins import IncludeSetPins
from kcache_client._local import LocalCompiler
from kcache_client._offline import tell_offline
from kcache_client._remote import Remote, ResolveAnswer
from kcache_client._settings import ClientSettings
from kcache_client._stats import CacheStats
from kcache_client._tier import NodeTier
from kcache_client._trust import Trust
from kcache_client._withdrawal_watch import WithdrawalWatch
from kcache_client._withdrawals import Pair
from kcache_client.errors import (
    NO_SERVER,
    CacheClosedError,
    RecipeRefusedError,
    RemoteNotFoundError,
    ServerResponseError,
    ServerUnavailableError,
)

__all__ = ["Lookup", "require_recipe"]

#: Recipes per ``/v1/resolve/batch`` request: big enough for the server to compile
#: in parallel, small enough for the progress bar to move.
_BATCH = 8
#: The server's code for a recipe pinned to an include set's earlier contents (409).
INCLUDE_SET_CHANGED = "include_set_changed"
_ORIGIN_OF_STATUS: dict[str, ArtifactOrigin] = {
    "hit": "server",
    "compiled": "compiled",
    "waited": "waited",
}


def require_recipe(value: Any, where: str) -> Recipe:
    """``value`` if it is a :class:`~kcache.recipe.Recipe`, else a TypeError naming ``where``,
    what was given and what is wanted (the project's TypeError for a wrong argument type)."""
    if isinstance(value, Recipe):
        return value
    shown = (
        f"{type(value).__name__} {value!r}"
        if value is None or isinstance(value, int | float)
        else type(value).__name__
    )
    hint = (
        ": wrap source text in Recipe(source=..., kernel=..., target=...)"
        if isinstance(value, str | bytes)
        else ": build one with Recipe(...) (a dict: Recipe.from_dict)"
        if isinstance(value, Mapping)
        else ""
    )
    raise TypeError(f"{where} must be a kcache Recipe, not {shown}{hint}")


def _nothing() -> None:
    """A look that finds nothing (``refresh``: the server is asked whatever the tier holds)."""


class Lookup:
    """``KernelCache.get`` and ``get_many`` for one cache; see the module docstring.

    Made by the cache from the parts its other jobs share: the node tier and the read-only
    ``layers`` under it, the ``remote`` server (None without one), the ``local`` compiler,
    the ``events`` sink (None when none are sent), ``context`` (who asks), ``prepare``
    (a recipe made concrete) and the ``include_pins``, pinned again once when the server
    says a set changed since.
    """

    def __init__(
        self,
        settings: ClientSettings,
        *,
        tier: NodeTier,
        layers: list[NodeTier],
        trust: Trust,
        stats: CacheStats,
        remote: Remote | None,
        local: LocalCompiler,
        events: EventSink | None,
        context: Callable[[], dict[str, Any]],
        prepare: Callable[[Recipe], Recipe],
        include_pins: IncludeSetPins,
    ) -> None:
        self.url = settings.url
        self.tier = tier
        self.layers = layers
        self.trust = trust
        self.stats = stats
        self.remote = remote
        self.local = local
        self.events = events
        self.context = context
        self.prepare = prepare
        self.include_pins = include_pins
        self.memory: LruCache[str, Artifact] = LruCache(max_entries=settings.memory_entries)
        #: What this process was served, by recipe key: its manifest (KernelCache.manifest),
        #: kept as the metadata each artifact holds anyway (no object more per kernel).
        self.used: dict[str, ArtifactMeta] = {}
        self.freezer = Freezer(stats, events, context)
        #: Every artifact's ``materialize``: one bound method, not one per artifact.
        self._materialize = self._checked_file
        #: When the server's withdrawals are read, and what is done with them
        #: (kcache_client._withdrawals); None without a server.
        self.watch = (
            WithdrawalWatch(
                remote,
                tier,
                settings.withdrawal_check_s,
                stats,
                self.forget_withdrawn,
                retry=replace(
                    settings.retry, attempts=1, deadline_s=min(settings.retry.deadline_s, 10.0)
                ),
            )
            if remote is not None
            else None
        )
        if remote is not None and self.watch is not None:
            remote.withdrawals_through = self.watch.answered
        #: Set by ``KernelCache.close()``: every lookup then raises CacheClosedError, with a
        #: server or without, memory hits too (one behaviour, whatever the cache holds).
        self.closed = False

    def require_server(self) -> Remote:
        """The server, or ServerUnavailableError naming why there is none."""
        if self.closed:
            raise CacheClosedError("a request to the server")
        if self.remote is None:
            raise ServerUnavailableError(
                NO_SERVER, "set KCACHE_URL (--server URL for a command, url= in Python)"
            )
        return self.remote

    # ------------------------------------------------------------------ get
    def get(self, recipe: Recipe, *, compile: bool, refresh: bool) -> Artifact:
        """``KernelCache.get``: see its docstring."""
        if not isinstance(recipe, Recipe):
            require_recipe(recipe, "get(recipe)")
        if self.closed:
            raise CacheClosedError("get()")
        try:
            return self._get(recipe, compile=compile, refresh=refresh)
        except IncludeSetChangedError:
            pass  # a local compile found one of this process's own sets edited since its pin
        except ServerResponseError as exc:
            if exc.code != INCLUDE_SET_CHANGED:
                raise
        # A set the recipe names changed on the server since this process pinned it:
        # pin its contents now and ask once more.
        self.include_pins.refresh()
        return self._get(recipe, compile=compile, refresh=refresh)

    def _get(self, recipe: Recipe, *, compile: bool, refresh: bool) -> Artifact:
        started = time.perf_counter()
        concrete = self.prepare(recipe)
        key = concrete.key()
        if not refresh:
            found = self._local_hit(key, concrete, started)
            if found is not None:
                return found
            late = self.freezer.late(key, concrete)  # frozen: reported, or refused here
            if late is not None:
                raise late
        offline: ServerUnavailableError
        # The per-key lock makes the node download once however many ranks ask; it
        # guards no correctness (publishing is atomic), so a lock timeout only costs time.
        # A rank waiting for another's download takes the entry from the tier as soon as
        # it is published, without queueing for the lock (hold_unless), and leaves the
        # next key to the rank that fetched this one (follows).
        published: Callable[[], Artifact | None] = (
            _nothing if refresh else lambda: self._from_tier(key, concrete)
        )
        with self.tier.hold_unless(key, published, follows=True) as art:
            if art is None and not refresh:
                art = self._from_tier(key, concrete)  # published before the lock was had
            if art is not None:
                self._event(art, started)
                return art
            try:
                return self._from_server(concrete, key, compile=compile, refresh=refresh)
            except ServerUnavailableError as exc:
                offline = exc
            if refresh:  # without the server the tier answers, as it does for get()
                art = self._from_tier(key, concrete)
                if art is not None:
                    if self.url is not None:
                        tell_offline(offline, f"answered from the node tier {self.tier.root}")
                    return art
        # Outside the lock: the local engine takes the same per-key lock itself.
        return self._compile_locally(concrete, key, compile, offline)

    def get_many(
        self,
        recipes: Sequence[Recipe],
        *,
        compile: bool,
        progress: bool,
        context: Mapping[str, Any] | None,
    ) -> list[Artifact | KCacheError]:
        """``KernelCache.get_many``: see its docstring."""
        if isinstance(recipes, Recipe | str | bytes | Mapping) or not isinstance(recipes, Sequence):
            raise TypeError(
                f"get_many(recipes) takes a sequence (a list) of kcache Recipe objects, not "
                f"{type(recipes).__name__}"
            )
        for i, recipe in enumerate(recipes):
            if not isinstance(recipe, Recipe):
                require_recipe(recipe, f"get_many recipes[{i}]")
        if self.closed:
            raise CacheClosedError("get_many()")
        results = self._get_many(recipes, compile=compile, progress=progress, context=context)
        stale = [
            i
            for i, result in enumerate(results)
            if isinstance(result, RecipeRefusedError) and result.code == INCLUDE_SET_CHANGED
        ]
        if stale:  # sets edited on the server since they were pinned here: pin again, once
            self.include_pins.refresh()
            again = self._get_many(
                [recipes[i] for i in stale], compile=compile, progress=False, context=context
            )
            for i, result in zip(stale, again, strict=True):
                results[i] = result
        return results

    def _get_many(
        self,
        recipes: Sequence[Recipe],
        *,
        compile: bool,
        progress: bool,
        context: Mapping[str, Any] | None,
    ) -> list[Artifact | KCacheError]:
        started = time.perf_counter()
        concrete = [self.prepare(r) for r in recipes]
        keys = [r.key() for r in concrete]
        results: dict[str, Artifact | KCacheError] = {}
        todo: dict[str, Recipe] = {}
        for key, recipe in zip(keys, concrete, strict=True):
            if key not in results and key not in todo:
                found = self._local_hit(key, recipe, started)
                late = None if found is not None else self.freezer.late(key, recipe)
                if found is not None:
                    results[key] = found
                elif late is not None:
                    results[key] = late
                else:
                    todo[key] = recipe
        asked = {**self.context(), **(context or {})}
        pending = list(todo.items())
        # Imported here: tqdm (12 ms, 8,000 objects the collector walks) is for warmups only.
        from tqdm import tqdm

        with tqdm(
            total=len(results) + len(pending),
            initial=len(results),
            desc="kcache warmup",
            unit="kernel",
            disable=not progress,
        ) as bar:
            for start in range(0, len(pending), _BATCH):
                chunk = pending[start : start + _BATCH]
                try:
                    answers = self.require_server().resolve_batch(
                        chunk, compile=compile, context=asked
                    )
                except ServerUnavailableError as exc:
                    if not (self.local.enabled and compile):
                        raise
                    for key, recipe in pending[start:]:
                        results[key] = self._compile_one_locally(recipe, key, exc)
                        bar.update(1)
                    break
                for (key, recipe), answer in zip(chunk, answers, strict=True):
                    results[key] = (
                        answer
                        if isinstance(answer, KCacheError)
                        else self._absorb(key, recipe, answer, compile)
                    )
                    bar.update(1)
        return [results[key] for key in keys]

    # ------------------------------------------------------------------ memory and tiers
    def forget_withdrawn(self, pairs: Sequence[Pair]) -> None:
        """Drop from memory the copies of what the server withdrew (the watch's callback)."""
        for key, digest in pairs:
            art = self.memory.get(key)
            if art is not None and art.digest == digest:
                self.memory.discard(key)

    def _local_hit(self, key: str, concrete: Recipe, started: float) -> Artifact | None:
        """Memory, then the node tier, audited as a ``local_hit``; None when neither holds it."""
        art = self.memory.get(key)
        watch = self.watch
        if art is not None and watch is not None and not watch.memory_holds(key, art.digest):
            self.memory.discard(key)
            art = None
        if art is not None:
            self.stats.add("memory_hits")
        else:
            art = self._from_tier(key, concrete)
            if art is None:
                return None
        self._event(art, started)
        return art

    def _from_tier(self, key: str, concrete: Recipe) -> Artifact | None:
        # Verifies the digest (a corrupt blob reads as absent) and, where the tier's
        # standing asks for it, the signature (an entry that fails reads as absent).
        tier = self.tier
        found = tier.lookup_signed(key)
        if found is None:
            for tier in self.layers:  # read-only, below the writable tier, in order
                found = tier.lookup_signed(key)
                if found is not None:
                    break
            else:
                return None
        watch = self.watch  # what the server withdrew, read first when due
        if watch is not None and not watch.tier_holds(key, found[0].digest):
            return None
        self.stats.add("node_hits")
        meta, data, signature = found
        return self._remember(self._artifact(key, concrete, meta, data, "node", signature, tier))

    def _artifact(
        self,
        key: str,
        concrete: Recipe,
        meta: ArtifactMeta,
        data: bytes,
        origin: ArtifactOrigin,
        signature: Signature | None,
        tier: NodeTier | None = None,
    ) -> Artifact:
        """The artifact found, with the verdict of the one check that found it usable (its
        digest and, where asked, its signature: the tier's lookup, the server answer's check,
        a local compile), which ``load()`` relies on (``Artifact.verdict``)."""
        trust = self.trust
        if origin == "local_compile":
            how = "compiled here"
        elif origin in ("node", "memory"):
            how = (tier or self.tier).standing.kind  # private, shared, untrusted: its tier's
        else:
            how = "signed"
        return Artifact.found(
            how,
            recipe_key=key,
            base_key="",  # the recipe's, computed when first read (Artifact.base_key)
            digest=meta.digest,
            data=data,
            blob_path=(tier or self.tier).location(meta.digest),
            metadata=meta,
            recipe=concrete,
            origin=origin,
            signature=signature,
            trust=trust,
            materialize=self._materialize,
        )

    def _checked_file(self, digest: str, data: bytes) -> str:
        """A file holding exactly ``data`` (bytes of ``digest`` checked when they were found),
        for ``Artifact.path``: the node tier's blob where the tier is private to this user,
        else a file written from ``data`` into this user's own private tier (a shared tier's
        file could be rewritten by its owner between a check and a load)."""
        found = self.tier.checked_file(digest, data)
        if found is None:
            found = self.local.tier.checked_file(digest, data)
        if found is None:
            raise KCacheError(f"no private directory to write the kernel {digest} into")
        return found

    def _remember(self, art: Artifact) -> Artifact:
        """Keep ``art`` in memory, where later calls find it (as from ``memory``), and in the
        process's manifest."""
        self.memory.put(art.recipe_key, art.found_in("memory"))
        self.used[art.recipe_key] = art.metadata
        return art

    def manifest_kernels(self) -> list[ManifestKernel]:
        """What this process was served so far, as the entries of its manifest."""
        return [
            ManifestKernel(key, m.digest, m.kernel, m.target, m.toolchain, m.kind, m.size)
            for key, m in self.used.items()
        ]

    def _publish(
        self,
        key: str,
        concrete: Recipe,
        meta: ArtifactMeta,
        data: bytes,
        origin: ArtifactOrigin,
        signature: Signature,
    ) -> Artifact:
        self.tier.publish(key, concrete.base_key(), meta, data, signature)
        self.stats.add("server_fetches")
        return self._remember(self._artifact(key, concrete, meta, data, origin, signature))

    # ------------------------------------------------------------------ server
    def _from_server(self, concrete: Recipe, key: str, *, compile: bool, refresh: bool) -> Artifact:
        """By key in one round trip; on a miss (or with ``refresh``) a resolve. Publishes into the tier."""
        remote = self.require_server()
        if not refresh:
            fetched = remote.fetch(concrete, key)
            if fetched is not None:
                meta, data, signature = fetched
                return self._publish(key, concrete, meta, data, "server", signature)
        answer = remote.resolve(concrete, key, compile=compile, context=self.context())
        return self._absorb(key, concrete, answer, compile, held=True)

    def _absorb(
        self,
        key: str,
        concrete: Recipe,
        answer: ResolveAnswer,
        compile: bool,
        *,
        held: bool = False,
    ) -> Artifact:
        """A resolve's answer -> the artifact, its bytes taken from the tier or downloaded.

        ``held``: the caller holds the key's node lock already. A blob evicted on the
        server between its answer and the download is resolved again, once (a recipe
        whose artifact is gone is a plain miss, compiled again on demand).
        """
        status, meta, signature = answer
        origin = _ORIGIN_OF_STATUS[status]
        remote = self.require_server()
        with contextlib.nullcontext() if held else self.tier.hold(key):
            existing = self.tier.lookup(key)
            if existing is not None and existing[0].digest == meta.digest:
                art = self._artifact(key, concrete, meta, existing[1], origin, signature)
                return self._remember(art)
            try:
                data = remote.download(meta)
            except RemoteNotFoundError:
                again = remote.resolve(concrete, key, compile=compile, context=self.context())
                status, meta, signature = again
                origin = _ORIGIN_OF_STATUS[status]
                data = remote.download(meta)
            return self._publish(key, concrete, meta, data, origin, signature)

    # ------------------------------------------------------------------ offline
    def _compile_locally(
        self, concrete: Recipe, key: str, compile: bool, offline: ServerUnavailableError
    ) -> Artifact:
        origin, meta, data = self.local.compile(concrete, key, compile=compile, offline=offline)
        if origin != "node":
            self.stats.add("local_compiles")
        if self.url is not None:
            tell_offline(
                offline,
                f"answered from the node tier {self.tier.root}"
                if origin == "node"
                else f"compiled here into the node tier {self.tier.root} (local compiles are on)",
            )
        art = self._artifact(key, concrete, meta, data, origin, None, self.local.tier)
        return self._remember(art)

    def _compile_one_locally(
        self, concrete: Recipe, key: str, offline: ServerUnavailableError
    ) -> Artifact | KCacheError:
        """One recipe of a batch compiled here because the server is unreachable; its own
        failure (a compile error, a target or option this NVRTC refuses) is its result, as
        the server's batch answers it, not the whole batch's."""
        try:
            return self._compile_locally(concrete, key, True, offline)
        except (CompileError, RecipeError) as exc:
            return exc

    # ------------------------------------------------------------------ events
    def _event(self, art: Artifact, started: float) -> None:
        """Report a memory or node-tier hit: the server never sees those otherwise."""
        events = self.events
        if events is None:
            return
        latency_ms = (time.perf_counter() - started) * 1000.0
        now = time.time()
        # A hit whose identical predecessor is still queued is only counted into it.
        if events.tally(
            tally_key(art.recipe_key, art.digest, art.origin, "local_hit"), latency_ms, now
        ):
            return
        meta = art.metadata
        events.record(
            {
                "time": now,
                "outcome": "local_hit",
                "tier": art.origin,
                "recipe_key": art.recipe_key,
                "base_key": art.base_key,
                "digest": art.digest,
                "kernel": meta.kernel,
                "target": meta.target,
                "toolchain": meta.toolchain,
                **self.context(),
                "latency_ms": latency_ms,
            }
        )
