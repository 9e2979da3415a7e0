"""``KernelCache``: cubins by recipe, through memory, the node-local tier and the server.

    get(recipe) -> prepare (auto target, default toolchain) -> recipe_key
               -> memory -> node tier -> [per-key node lock] -> node tier again
               -> GET /v1/recipes/{key}/artifact -> POST /v1/resolve (compile if allowed)
               -> verify sha256 -> publish into the node tier -> memory

When the server cannot be reached the tier still answers, and a worker with NVRTC
installed and local compiles enabled compiles with the core engine over the tier.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import hashlib
import os
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kcache.artifact import ArtifactMeta
from kcache.engine import Engine
from kcache.errors import CompileError, KCacheError, ToolchainError
from kcache.lru import LruCache
from kcache.outcomes import Outcome, parse_outcome
from kcache.recipe import Recipe
from kcache_client._artifact import Artifact
from kcache_client._collective import Collective, as_collective
from kcache_client._device import auto_target as device_auto_target
from kcache_client._events import EventSink
from kcache_client._http import RetryPolicy, Transport
from kcache_client._settings import ClientSettings
from kcache_client._tier import NodeTier
from kcache_client.errors import (
    ClientError,
    DigestMismatchError,
    RemoteNotFoundError,
    ServerUnavailableError,
    WarmupCompileError,
    WarmupError,
    WarmupTimeoutError,
)

__all__ = ["KernelCache", "Resolved", "WarmupResult"]

#: Recipes per ``/v1/resolve/batch`` request: big enough for the server to compile
#: in parallel, small enough for the progress bar to move.
_BATCH = 8
#: Tries of a download whose bytes do not match their digest.
_DIGEST_TRIES = 3
#: Share of the warmup timeout the leader may spend resolving; the rest is left for
#: broadcasting its answer before the other ranks give up.
_LEADER_SHARE = 0.85


@dataclass(frozen=True)
class Resolved:
    """An artifact and how it was obtained: ``hit``/``compiled``/``waited`` (server), ``local_hit``."""

    status: Outcome
    artifact: Artifact


@dataclass(frozen=True)
class WarmupResult:
    """What ``warmup`` gives each rank: its own artifacts, in the order it asked for them.

    ``statuses`` are the leader's outcomes for this rank's recipes (``hit``, ``compiled``,
    ``waited``, ``local_hit``); ``union_size`` is how many distinct recipes the leader
    resolved for the whole group (or node).
    """

    artifacts: list[Artifact]
    statuses: list[str]
    leader: bool
    union_size: int
    seconds: float


@dataclass
class CacheStats:
    """Counters of where ``get()`` answers came from (per KernelCache)."""

    memory_hits: int = 0
    node_hits: int = 0
    server_fetches: int = 0
    local_compiles: int = 0
    digest_mismatches: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, name: str, n: int = 1) -> None:
        """Thread-safe increment."""
        with self._lock:
            setattr(self, name, getattr(self, name) + n)


def _needs(recipe: Recipe) -> tuple[bool, bool]:
    """(needs an auto target, needs a toolchain), looking into linked recipes too."""
    auto, toolchain = recipe.target == "auto", recipe.toolchain is None
    for item in recipe.link:
        if item.recipe is not None:
            a, t = _needs(item.recipe)
            auto, toolchain = auto or a, toolchain or t
    return auto, toolchain


def _meta_from_body(body: Any) -> ArtifactMeta:
    """Artifact metadata from a resolve body or a bare metadata object."""
    if not isinstance(body, dict):
        raise ClientError(f"the server sent {type(body).__name__} where artifact metadata belongs")
    data = body.get("artifact", body)
    try:
        return ArtifactMeta.from_dict(data)
    except (KeyError, TypeError, ValueError) as exc:
        raise ClientError(f"the server's artifact metadata is malformed: {exc!r}") from exc


def _error_dict(exc: BaseException, leader: int) -> dict[str, Any]:
    """A failure as plain data, identical on every rank that receives it."""
    if isinstance(exc, WarmupError):
        return exc.to_dict()
    if isinstance(exc, KCacheError) and hasattr(exc, "log") and hasattr(exc, "recipe_key"):
        return WarmupCompileError(
            f"warmup: recipe {exc.recipe_key} does not compile: {exc}",
            kind=type(exc).__name__,
            recipe_key=exc.recipe_key,
            log=str(exc.log),
            leader=leader,
        ).to_dict()
    return WarmupError(
        f"warmup failed on rank {leader}: {type(exc).__name__}: {exc}",
        kind=type(exc).__name__,
        leader=leader,
    ).to_dict()


class KernelCache:
    """Fetch or request compiled kernels by recipe; one per process, shared by its threads.

    ``url``, ``token`` and ``cache_dir`` default to ``KCACHE_URL``, ``KCACHE_TOKEN`` and
    ``KCACHE_CACHE_DIR`` (else ``~/.cache/kcache/client``); ``max_bytes`` caps the node
    tier (``KCACHE_CACHE_MAX_BYTES``, default 10 GiB or 10 % of its filesystem, 0 for none). A miss the server cannot
    answer because it is unreachable (or because there is no URL) is compiled here
    when ``local_compile`` is on and NVRTC is installed: by default that is without a
    server, and ``KCACHE_LOCAL_COMPILE`` or the argument decide otherwise. Local
    compiles read the directories of ``include_sets`` (name -> directory) for the
    include sets a recipe names. ``auto_target`` overrides what ``target="auto"``
    means (default: the device's ``sm_XY`` from the CUDA driver).
    """

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        *,
        local_compile: bool | None = None,
        auto_target: str | None = None,
        device: int | None = None,
        job_id: str | None = None,
        host: str | None = None,
        retry: RetryPolicy | None = None,
        send_events: bool = True,
        memory_entries: int = 4096,
        lock_timeout: float = 900.0,
        connect_timeout: float = 5.0,
        read_timeout: float = 600.0,
        include_sets: Mapping[str, str | os.PathLike[str]] | None = None,
        max_bytes: int | str | None = None,
    ) -> None:
        self.settings = ClientSettings.from_env(
            url=url,
            token=token,
            cache_dir=cache_dir,
            local_compile=local_compile,
            job_id=job_id,
            include_sets=include_sets,
            max_bytes=max_bytes,
        )
        self.url = self.settings.url
        self.tier = NodeTier(
            self.settings.cache_dir,
            lock_timeout=lock_timeout,
            max_bytes=self.settings.cache_max_bytes,
        )
        self.stats = CacheStats()
        self._auto_target = auto_target
        self._device = device
        self._transport = (
            Transport(
                self.url,
                self.settings.token,
                retry=retry,
                connect_timeout=connect_timeout,
                read_timeout=read_timeout,
            )
            if self.url
            else None
        )
        self._events = (
            EventSink(self._transport) if self._transport is not None and send_events else None
        )
        self._memory: LruCache[str, Artifact] = LruCache(max_entries=memory_entries)
        self._toolchain_default: str | None = None
        self._toolchain_lock = threading.Lock()
        self._engine: Engine | None = None
        self._engine_lock = threading.Lock()
        self.host = host or socket.gethostname()
        self.client_id = (
            os.environ.get("KCACHE_CLIENT_ID")
            or f"{self.host}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        )
        self.rank = int(os.environ.get("RANK", "0") or 0)
        self.world_size = int(os.environ.get("WORLD_SIZE", "1") or 1)
        self._closed = False
        # atexit holds only a weak reference, so an unused cache can still be collected.
        ref = weakref.ref(self)
        self._atexit = lambda: (lambda c: c.close() if c is not None else None)(ref())
        atexit.register(self._atexit)

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Deliver queued audit events (bounded wait) and close connections; idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._atexit)
        if self._events is not None:
            self._events.close()
        if self._transport is not None:
            self._transport.close()

    def __enter__(self) -> KernelCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def requests(self) -> int:
        """HTTP requests this cache has sent to the server (retries and events included)."""
        return self._transport.requests if self._transport is not None else 0

    @property
    def events(self) -> EventSink | None:
        """The audit-event sink (None without a server or with ``send_events=False``)."""
        return self._events

    def context(self) -> dict[str, Any]:
        """Who is asking: sent with every resolve and event."""
        return {
            "client_id": self.client_id,
            "host": self.host,
            "pid": os.getpid(),
            "job_id": self.settings.job_id,
            "rank": self.rank,
            "world_size": self.world_size,
        }

    # ------------------------------------------------------------------ keying
    def auto_target(self) -> str:
        """What ``target="auto"`` means here (the device's ``sm_XY``); NoDeviceError without a GPU."""
        return self._auto_target or device_auto_target(self._device)

    def default_toolchain(self) -> str:
        """The server's default toolchain id (``GET /v1/toolchains``), cached for the process.

        It is also saved in the node tier, so a process started while the server is
        down still keys recipes as it did; failing that, a local NVRTC's id is used
        when local compiles are enabled.
        """
        with self._toolchain_lock:
            if self._toolchain_default is not None:
                return self._toolchain_default
            try:
                facts = self.toolchains()
                default = str(facts["default"])
            except ServerUnavailableError as exc:
                default = self._offline_toolchain(exc)
            self._toolchain_default = default
            return default

    def toolchains(self) -> dict[str, Any]:
        """The server's ``GET /v1/toolchains`` answer (also saved in the tier for offline keying)."""
        transport = self._require_server()
        body = transport.request("GET", "/v1/toolchains").json()
        if not isinstance(body, dict) or not isinstance(body.get("default"), str):
            raise ClientError(f"{transport.url}/v1/toolchains did not name a default toolchain")
        assert self.url is not None
        self.tier.save_server_facts(self.url, {"default_toolchain": body["default"]})
        return body

    def _offline_toolchain(self, cause: ServerUnavailableError) -> str:
        if self.url is not None:
            facts = self.tier.load_server_facts(self.url)
            if facts and isinstance(facts.get("default_toolchain"), str):
                return str(facts["default_toolchain"])
        if self.settings.local_compile:
            try:
                return self._local_engine().toolchain_id
            except ToolchainError as exc:
                raise ServerUnavailableError(
                    cause.url, f"{cause.cause}; and no local NVRTC: {exc}"
                ) from exc
        raise ServerUnavailableError(
            cause.url,
            f"{cause.cause}; the recipe names no toolchain, and the server's default is not "
            f"known in {self.tier.root} yet (give the recipe a toolchain, or enable local compiles)",
        ) from cause

    def prepare(self, recipe: Recipe) -> Recipe:
        """The concrete recipe: ``auto`` resolved to this device, the toolchain to the server's."""
        auto, toolchain = _needs(recipe)
        target = self.auto_target() if auto else None
        tc = self.default_toolchain() if toolchain else None
        return recipe.with_defaults(target=target, toolchain=tc)

    def key(self, recipe: Recipe) -> str:
        """The recipe key of the concrete recipe."""
        return self.prepare(recipe).key()

    # ------------------------------------------------------------------ get
    def get(self, recipe: Recipe, compile: bool = True) -> Artifact:
        """The verified artifact for ``recipe``: memory, node tier, server fetch, server compile.

        Raises RemoteCompileError (a CompileError) when the recipe does not compile,
        RemoteNotFoundError when absent and ``compile`` is false, ServerUnavailableError
        (naming the URL and cause) when only the unreachable server could have answered.
        """
        return self.obtain(recipe, compile).artifact

    def obtain(self, recipe: Recipe, compile: bool = True) -> Resolved:
        """Like :meth:`get`, also saying where the artifact came from (``local_hit`` for the tiers)."""
        started = time.perf_counter()
        concrete = self.prepare(recipe)
        key = concrete.key()
        hit = self._memory_get(key)
        if hit is not None:
            self.stats.add("memory_hits")
            self._event(hit, "memory", started)
            return Resolved("local_hit", hit)
        art = self._tier_get(key, concrete)
        if art is not None:
            self.stats.add("node_hits")
            self._event(art, "node", started)
            return Resolved("local_hit", art)
        offline: ServerUnavailableError
        # The per-key lock makes the node download once however many ranks ask.
        with self.tier.hold(key):
            art = self._tier_get(key, concrete)
            if art is not None:
                self.stats.add("node_hits")
                self._event(art, "node", started)
                return Resolved("local_hit", art)
            try:
                return self._fetch(concrete, key, compile)
            except ServerUnavailableError as exc:
                offline = exc
        # Outside the lock: the local engine takes the same per-key lock itself.
        return self._compile_locally(concrete, key, compile, offline)

    def resolve(self, recipe: Recipe, compile: bool = True) -> Resolved:
        """Ask the server (``POST /v1/resolve``) even if the tiers have it; fill the tier.

        This is ``kcache compile --server``: the status says whether the server hit,
        compiled or joined another compile.
        """
        concrete = self.prepare(recipe)
        key = concrete.key()
        with self.tier.hold(key):
            try:
                return self._resolve_remote(concrete, key, compile)
            except ServerUnavailableError as exc:
                offline = exc
            # Without the server the tier answers, as it does for get().
            art = self._tier_get(key, concrete)
            if art is not None:
                self.stats.add("node_hits")
                return Resolved("local_hit", art)
        return self._compile_locally(concrete, key, compile, offline)

    # ------------------------------------------------------------------ tiers
    def _memory_get(self, key: str) -> Artifact | None:
        return self._memory.get(key)

    def _memory_put(self, art: Artifact) -> Artifact:
        self._memory.put(art.recipe_key, art)
        return art

    def forget_memory(self) -> None:
        """Drop the in-process copies (the node tier keeps its own)."""
        self._memory.clear()

    def _tier_get(self, key: str, concrete: Recipe) -> Artifact | None:
        found = self.tier.lookup(key)  # verifies the digest; a corrupt blob reads as absent
        if found is None:
            return None
        meta, data = found
        return self._memory_put(self._artifact(key, concrete, meta, data))

    def _artifact(self, key: str, concrete: Recipe, meta: ArtifactMeta, data: bytes) -> Artifact:
        return Artifact(
            recipe_key=key,
            base_key=concrete.base_key(),
            digest=meta.digest,
            data=data,
            path=self.tier.path(meta.digest),
            metadata=meta,
            recipe=concrete,
        )

    def _publish(self, key: str, concrete: Recipe, meta: ArtifactMeta, data: bytes) -> Artifact:
        self.tier.publish(key, concrete.base_key(), meta, data)
        return self._memory_put(self._artifact(key, concrete, meta, data))

    # ------------------------------------------------------------------ server
    def _require_server(self) -> Transport:
        if self._transport is None:
            raise ServerUnavailableError(
                "(none)", "no server configured: set KCACHE_URL or pass url="
            )
        return self._transport

    def _fetch(self, concrete: Recipe, key: str, compile: bool) -> Resolved:
        """By key first (one round trip for the bytes), then resolve; publishes into the tier."""
        transport = self._require_server()
        try:
            response = transport.request("GET", f"/v1/recipes/{key}/artifact")
        except RemoteNotFoundError:
            return self._resolve_remote(concrete, key, compile)
        data = response.content
        claimed = (
            response.headers.get("X-Kcache-Digest") or response.headers.get("ETag", "")
        ).strip('"')
        try:
            meta = _meta_from_body(transport.request("GET", f"/v1/recipes/{key}").json())
        except RemoteNotFoundError:
            return self._resolve_remote(concrete, key, compile)  # forgotten in between (gc)
        if claimed != meta.digest or hashlib.sha256(data).hexdigest() != meta.digest:
            # Damaged in transit, or the alias moved between the two requests: the
            # blob by digest is immutable, so fetch that (verified, retried).
            self.stats.add("digest_mismatches")
            data = self._download_blob(meta.digest)
        self.stats.add("server_fetches")
        return Resolved("hit", self._publish(key, concrete, meta, data))

    def _resolve_remote(
        self, concrete: Recipe, key: str, compile: bool, *, retried: bool = False
    ) -> Resolved:
        transport = self._require_server()
        body = {"recipe": concrete.to_dict(), "compile": compile, "context": self.context()}
        answer = transport.request("POST", "/v1/resolve", json=body).json()
        meta = _meta_from_body(answer)
        try:
            status = parse_outcome(answer.get("status", "hit"), "the server's resolve status")
        except ValueError as exc:
            raise ClientError(str(exc)) from None
        if answer.get("recipe_key") not in (None, key):
            raise ClientError(
                f"the server keyed the recipe as {answer.get('recipe_key')}, this client as {key}: "
                "client and server run different kcache versions"
            )
        existing = self.tier.lookup(key)
        if existing is not None and existing[0].digest == meta.digest:
            data = existing[1]
        else:
            try:
                data = self._download_blob(meta.digest)
            except RemoteNotFoundError:
                if retried:
                    raise
                # Evicted on the server between the answer and the download: ask again
                # (a recipe whose artifact is gone is a plain miss, compiled on demand).
                return self._resolve_remote(concrete, key, compile, retried=True)
        self.stats.add("server_fetches")
        return Resolved(status, self._publish(key, concrete, meta, data))

    def _download_blob(self, digest: str) -> bytes:
        """``GET /v1/blobs/{digest}``, refetched until the bytes hash to ``digest`` (bounded)."""
        transport = self._require_server()
        actual = ""
        for _ in range(_DIGEST_TRIES):
            data = transport.request("GET", f"/v1/blobs/{digest}").content
            actual = hashlib.sha256(data).hexdigest()
            if actual == digest:
                return data
            self.stats.add("digest_mismatches")
        raise DigestMismatchError(f"{transport.url}/v1/blobs/{digest}", digest, actual)

    # ------------------------------------------------------------------ offline
    def _local_engine(self) -> Engine:
        """The core engine over the node tier (same store, index and lock), built once."""
        with self._engine_lock:
            if self._engine is None:
                from kcache.compilers import InProcessCompiler
                from kcache.include_sets import IncludeSets
                from kcache.toolchain import load_toolchain

                self._engine = Engine(
                    self.tier.store,
                    self.tier.index,
                    self.tier.lock,
                    InProcessCompiler(load_toolchain(), IncludeSets(self.settings.include_sets)),
                )
            return self._engine

    def _compile_locally(
        self, concrete: Recipe, key: str, compile: bool, offline: ServerUnavailableError
    ) -> Resolved:
        where = f"the node tier {self.tier.root} has no artifact for recipe {key}"
        if not self.settings.local_compile or not compile:
            reason = (
                "local compiles are off (KCACHE_LOCAL_COMPILE=1)" if compile else "compile=False"
            )
            raise ServerUnavailableError(
                offline.url, f"{offline.cause}; {where}, and {reason}"
            ) from offline
        try:
            engine = self._local_engine()
        except ToolchainError as exc:
            raise ServerUnavailableError(
                offline.url, f"{offline.cause}; {where}, and {exc}"
            ) from exc
        if concrete.toolchain != engine.toolchain_id:
            raise ServerUnavailableError(
                offline.url,
                f"{offline.cause}; {where}, and it names toolchain {concrete.toolchain} while the "
                f"local NVRTC is {engine.toolchain_id}",
            ) from offline
        result = engine.resolve(concrete)
        data = engine.read(result.artifact)
        # The engine's "hit" was found in the tier (through a manifest): a local_hit here.
        status: Outcome = "local_hit" if result.status == "hit" else result.status
        if status != "local_hit":
            self.stats.add("local_compiles")
        if result.status == "compiled":
            self.tier.stored(len(data))  # the engine stored it in the tier: keep the cap
        return Resolved(
            status, self._memory_put(self._artifact(key, concrete, result.artifact, data))
        )

    # ------------------------------------------------------------------ events
    def _event(self, art: Artifact, tier: str, started: float) -> None:
        if self._events is None:
            return
        meta = art.metadata
        self._events.record(
            {
                "time": time.time(),
                "outcome": "local_hit",
                "tier": tier,
                "recipe_key": art.recipe_key,
                "base_key": art.base_key,
                "digest": art.digest,
                "kernel": meta.kernel,
                "target": meta.target,
                "toolchain": meta.toolchain,
                **self.context(),
                "latency_ms": (time.perf_counter() - started) * 1000.0,
            }
        )

    # ------------------------------------------------------------------ batch + warmup
    def resolve_many(
        self,
        recipes: Sequence[Recipe],
        *,
        compile: bool = True,
        progress: bool = False,
        context: dict[str, Any] | None = None,
    ) -> dict[str, dict[str, Any]]:
        """Resolve concrete recipes through ``/v1/resolve/batch`` and fill the node tier.

        Returns recipe_key -> outcome: ``{"status": "hit"|"compiled"|"waited"|"local_hit",
        "digest"}`` or ``{"status": "error", "error", "detail", "log", "recipe_key"}``.
        Recipes already in the tier cost no request. When the server cannot be reached
        (or there is none) and local compiles are on, the rest are compiled here, one by
        one (``compiled``, or ``error`` with the compiler's log); otherwise connection
        failures raise. ``context`` replaces :meth:`context` in the requests (a warmup
        names its group rank).
        """
        unique: dict[str, Recipe] = {}
        for recipe in recipes:
            unique.setdefault(recipe.key(), recipe)
        outcomes: dict[str, dict[str, Any]] = {}
        todo: list[tuple[str, Recipe]] = []
        for key, recipe in unique.items():
            found = self.tier.lookup(key)
            if found is not None:
                outcomes[key] = {"status": "local_hit", "digest": found[0].digest}
            else:
                todo.append((key, recipe))
        bar = _progress(len(unique), progress, initial=len(unique) - len(todo))
        try:
            for start in range(0, len(todo), _BATCH):
                chunk = todo[start : start + _BATCH]
                try:
                    results = self._batch(chunk, compile, context or self.context())
                except ServerUnavailableError as exc:
                    if not (self.settings.local_compile and compile):
                        raise
                    for key, recipe in todo[start:]:
                        outcomes[key] = self._local_outcome(key, recipe, exc)
                        bar.update(1)
                    break
                for (key, recipe), result in zip(chunk, results, strict=True):
                    outcomes[key] = self._absorb(key, recipe, result)
                    bar.update(1)
        finally:
            bar.close()
        return {key: outcomes[key] for key in unique}

    def _local_outcome(
        self, key: str, recipe: Recipe, offline: ServerUnavailableError
    ) -> dict[str, Any]:
        """One recipe of a warmup compiled here because the server is unreachable."""
        try:
            resolved = self._compile_locally(recipe, key, True, offline)
        except CompileError as exc:
            return {
                "status": "error",
                "error": "compile_error",
                "detail": str(exc),
                "log": exc.log,
                "recipe_key": key,
            }
        return {"status": resolved.status, "digest": resolved.artifact.digest}

    def _batch(
        self, chunk: list[tuple[str, Recipe]], compile: bool, context: dict[str, Any]
    ) -> list[Any]:
        transport = self._require_server()
        body = {
            "recipes": [r.to_dict() for _, r in chunk],
            "compile": compile,
            "context": context,
        }
        results = transport.request("POST", "/v1/resolve/batch", json=body).json().get("results")
        if not isinstance(results, list) or len(results) != len(chunk):
            raise ClientError(f"{transport.url}/v1/resolve/batch returned a malformed results list")
        return results

    def _absorb(self, key: str, recipe: Recipe, result: Any) -> dict[str, Any]:
        """One batch result -> outcome; a success is downloaded (verified) into the tier."""
        if not isinstance(result, dict) or result.get("status") not in (
            "hit",
            "compiled",
            "waited",
        ):
            result = result if isinstance(result, dict) else {}
            return {
                "status": "error",
                "error": str(result.get("error", "error")),
                "detail": str(result.get("detail", "")),
                "log": str(result.get("log", "")),
                "recipe_key": result.get("recipe_key") or key,
            }
        meta = _meta_from_body(result)
        with self.tier.hold(key):
            if self.tier.lookup(key) is None:
                self._publish(key, recipe, meta, self._download_blob(meta.digest))
        return {"status": result["status"], "digest": meta.digest}

    def warmup(
        self,
        recipes: Iterable[Recipe],
        group: Any = None,
        *,
        per_node: bool = False,
        timeout: float = 1800.0,
        compile: bool = True,
        progress: bool | None = None,
    ) -> WarmupResult:
        """Resolve every rank's recipes once per job (or node), then load them from the tier.

        ARCHITECTURE section 8. ``group`` is a torch process group, any
        :class:`~kcache_client.Collective`, or None (torch's default group when one is
        initialised, else this process alone). Every rank resolves ``auto`` for its own
        device; the ranks all-gather their concrete recipes; the leader (rank 0, or the
        lowest rank of each host with ``per_node``) resolves the union through
        ``/v1/resolve/batch`` with a progress bar and fills its node tier; its broadcast
        of the outcomes is the barrier. Any failure raises the same WarmupError on every
        rank; a rank that does not arrive, or a leader that dies, makes every other rank
        raise the same WarmupTimeoutError (naming the missing rank when it is known).

        ``timeout`` bounds every wait: for the other ranks to arrive (counted from this
        rank's own call, so ranks may arrive in any order with any skew below it) and
        for the leader's outcomes (the leader gives up resolving a little before it).
        A warmup may run any number of times in a job, on any group; under
        torch.distributed it creates no process group (see ``_collective``), so there
        is nothing to tear down.
        """
        started = time.monotonic()
        own = list(recipes)
        coll = as_collective(group, timeout=timeout)
        return self._warmup(own, coll, per_node, timeout, compile, progress, started)

    def _warmup(
        self,
        own: list[Recipe],
        coll: Collective | None,
        per_node: bool,
        timeout: float,
        compile: bool,
        progress: bool | None,
        started: float,
    ) -> WarmupResult:
        if coll is None:
            concrete = [self.prepare(r) for r in own]
            outcomes = self.resolve_many(concrete, compile=compile, progress=bool(progress))
            _raise_first_error(outcomes, [r.key() for r in concrete], leader=self.rank)
            return self._finish(
                concrete, outcomes, leader=True, union=len(outcomes), started=started
            )

        rank, size = coll.rank, coll.world_size
        # The leader's requests name its place in this warmup's group; the cache's own
        # rank (the job's) is left as it is for everything else.
        context = {**self.context(), "rank": rank, "world_size": size}
        concrete_or_error: list[Recipe] | dict[str, Any]
        try:
            concrete_or_error = [self.prepare(r) for r in own]
            mine: Any = {
                "host": self.host,
                "recipes": [(r.key(), r.to_dict()) for r in concrete_or_error],
            }
        except Exception as exc:  # shared with everyone below, so no rank waits for this one
            concrete_or_error = _error_dict(exc, rank)
            mine = {"host": self.host, "error": concrete_or_error}
        gathered = _collective(lambda: coll.all_gather(mine), "all-gather of the recipes", 0)
        for entry in gathered:
            if "error" in entry:
                raise WarmupError.from_dict(entry["error"])
        assert isinstance(concrete_or_error, list)
        concrete = concrete_or_error

        hosts = [entry["host"] for entry in gathered]
        members = [r for r in range(size) if not per_node or hosts[r] == self.host]
        leader = members[0]
        leaders = sorted({hosts.index(host) for host in hosts}) if per_node else [0]
        payload: dict[str, Any] | None = None
        if rank == leader:
            union: dict[str, Recipe] = {}
            for member in members:
                for key, data in gathered[member]["recipes"]:
                    if key not in union:
                        union[key] = Recipe.from_dict(data)
            show = progress if progress is not None else True
            payload = self._lead(
                list(union.values()), compile, show, timeout * _LEADER_SHARE, leader, context
            )
        if per_node:
            answers = _collective(
                lambda: coll.all_gather(payload), "gather of the leaders' outcomes", leader
            )
        else:
            answers = [
                _collective(lambda: coll.broadcast(payload, 0), "broadcast of the outcomes", 0)
            ]
        # Every leader's failure is checked in rank order, so with several leaders
        # (per_node) every rank still raises the same error, not only its node's ranks.
        for r in leaders:
            if answers[r].get("error"):
                raise WarmupError.from_dict(answers[r]["error"])
        payload = answers[leader]  # leader is 0 without per_node: the broadcast's only answer
        assert isinstance(payload, dict)
        outcomes = payload["outcomes"]
        _raise_first_error(outcomes, list(outcomes), leader=leader)
        return self._finish(
            concrete, outcomes, leader=rank == leader, union=len(outcomes), started=started
        )

    def _lead(
        self,
        union: list[Recipe],
        compile: bool,
        progress: bool,
        budget: float,
        leader: int,
        context: dict[str, Any],
    ) -> dict[str, Any]:
        """Resolve the union within ``budget`` seconds; every failure becomes plain data."""
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kcache-warmup")
        future = pool.submit(
            self.resolve_many, union, compile=compile, progress=progress, context=context
        )
        try:
            return {"outcomes": future.result(timeout=budget), "error": None}
        except concurrent.futures.TimeoutError:
            error = WarmupTimeoutError(
                f"warmup: the leader (rank {leader}) did not resolve {len(union)} recipes within {budget:.0f}s",
                kind="TimeoutError",
                leader=leader,
            )
            return {"outcomes": {}, "error": error.to_dict()}
        except Exception as exc:
            return {"outcomes": {}, "error": _error_dict(exc, leader)}
        finally:
            pool.shutdown(wait=False)  # a stuck request must not hold the broadcast back

    def _finish(
        self,
        concrete: list[Recipe],
        outcomes: dict[str, dict[str, Any]],
        *,
        leader: bool,
        union: int,
        started: float,
    ) -> WarmupResult:
        # Every rank loads its own recipes through get(): memory, then the tier the
        # leader filled (a rank on another node downloads once per node instead).
        artifacts = [self.get(r) for r in concrete]
        statuses = [
            str(outcomes.get(a.recipe_key, {}).get("status", "local_hit")) for a in artifacts
        ]
        return WarmupResult(artifacts, statuses, leader, union, time.monotonic() - started)


def _raise_first_error(
    outcomes: dict[str, dict[str, Any]], order: list[str], *, leader: int
) -> None:
    for key in order:
        outcome = outcomes.get(key, {})
        if outcome.get("status") != "error":
            continue
        log = str(outcome.get("log") or "")
        detail = str(outcome.get("detail") or "")
        if outcome.get("error") == "compile_error":
            raise WarmupCompileError(
                f"warmup: recipe {key} does not compile: {detail or log.strip()[:200]}",
                kind="RemoteCompileError",
                recipe_key=key,
                log=log,
                leader=leader,
            )
        raise WarmupError(
            f"warmup: the server refused recipe {key}: {outcome.get('error')}: {detail}",
            kind=str(outcome.get("error")),
            recipe_key=key,
            log=log,
            leader=leader,
        )


def _collective(op: Any, what: str, leader: int) -> Any:
    """Run a collective; a peer that died or timed out becomes the same error on every rank.

    A WarmupError passes as it is: the built-in collectives raise one that every member
    of the call agreed on. Any other failure (a custom Collective's) is given a message
    that depends only on the step, so it too reads alike on every rank.
    """
    try:
        return op()
    except WarmupError:
        raise
    except Exception as exc:
        raise WarmupTimeoutError(
            f"warmup: the {what} failed (a rank or the leader, rank {leader}, died or timed out)",
            kind=type(exc).__name__,
            leader=leader,
        ) from exc


class _NoBar:
    def update(self, n: int) -> None:
        del n

    def close(self) -> None:
        pass


def _progress(total: int, enabled: bool, *, initial: int = 0) -> Any:
    if not enabled:
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, initial=initial, desc="kcache warmup", unit="kernel")
