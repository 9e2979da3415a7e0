"""``KernelCache``: cubins by recipe, through memory, the node-local tier and the server.

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
leader runs; :mod:`~kcache_client._warmup` is the warmup). When the server cannot be
reached the tier still answers, and a worker with NVRTC and local compiles enabled
compiles with the core engine over the tier (:mod:`~kcache_client._local`). The
server's side of each exchange, with every answer checked, is :mod:`~kcache_client._remote`.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import httpx

from kcache.artifact import ArtifactMeta
from kcache.artifact_header import (
    CONTEXT_HEADER,
    ON_MISS_HEADER,
    ON_MISS_RESOLVE,
    encode_context,
)
from kcache.errors import CompileError, IncludeSetChangedError, KCacheError, ToolchainError
from kcache.job_manifest import JobManifest, ManifestKernel
from kcache.lru import LruCache
from kcache.recipe import Recipe
from kcache.signing import Signature, load_backend
from kcache_client import _tier_stats
from kcache_client._artifact import Artifact, ArtifactOrigin, Judgement
from kcache_client._bundle import PrefetchResult, open_layers, prefetch
from kcache_client._event_spool import NodeEventSpool
from kcache_client._events import EventSink, tally_key
from kcache_client._fanout import prefetch_in_group
from kcache_client._freeze import FreezeMode, Freezer, after_warmup_mode, parse_mode
from kcache_client._http import RetryNotice, Transport
from kcache_client._include_pins import IncludeSetPins, server_set_digests
from kcache_client._local import LocalCompiler
from kcache_client._remote import Remote, ResolveAnswer
from kcache_client._server_facts import kept_default, signed_default
from kcache_client._settings import ClientSettings
from kcache_client._stats import CacheStats
from kcache_client._tier import NodeTier
from kcache_client._trust import Trust
from kcache_client._warmup import WarmupResult, warmup
from kcache_client._withdrawal_watch import WithdrawalWatch
from kcache_client._withdrawals import Pair
from kcache_client.errors import (
    RecipeRefusedError,
    RemoteNotFoundError,
    ServerResponseError,
    ServerUnavailableError,
)

__all__ = ["OFFLINE_LOGGER", "KernelCache"]

#: Recipes per ``/v1/resolve/batch`` request: big enough for the server to compile
#: in parallel, small enough for the progress bar to move.
_BATCH = 8
#: The logger of the one line a process logs when its server first fails it (``kcache``
#: commands, which say so in their own words, silence it).
OFFLINE_LOGGER = "kcache_client.offline"
_offline_log = logging.getLogger(OFFLINE_LOGGER)
_offline_told = threading.Lock()  # held for good once the line is logged: once per process
#: The server's code for a recipe pinned to an include set's earlier contents (409).
INCLUDE_SET_CHANGED = "include_set_changed"
_ORIGIN_OF_STATUS: dict[str, ArtifactOrigin] = {
    "hit": "server",
    "compiled": "compiled",
    "waited": "waited",
}


def _tell_offline(offline: ServerUnavailableError, answer: str) -> None:
    """Log, once per process, that the server did not answer and how the cache answered instead.

    A training job whose server is down keeps running on its node tier (and local
    compiles, where enabled), which is the point; but it should not do so without a
    word, and a word per kernel would flood its log. A warning, so that a program
    that configured no logging still shows it (Python's last-resort handler).
    """
    if not _offline_told.acquire(blocking=False):
        return
    _offline_log.warning(
        "kcache server %s is unreachable (%s); %s. Logged once per process: later "
        "answers without the server are not logged (KernelCache.stats counts them).",
        offline.url,
        offline.cause,
        answer,
    )


def _nothing() -> None:
    """A look that finds nothing (``refresh``: the server is asked whatever the tier holds)."""


def _needs(recipe: Recipe) -> tuple[bool, bool]:
    """(needs an auto target, needs a toolchain), looking into linked recipes too."""
    auto, toolchain = recipe.target == "auto", recipe.toolchain is None
    for item in recipe.link:
        if item.recipe is not None:
            a, t = _needs(item.recipe)
            auto, toolchain = auto or a, toolchain or t
    return auto, toolchain


class KernelCache:
    """Fetch or request compiled kernels by recipe; one per process, shared by its threads.

    ``url``, ``token`` and ``cache_dir`` are shorthands for the same fields of
    ``settings`` (:class:`~kcache_client.ClientSettings`, by default read from the
    environment: ``KCACHE_URL``, ``KCACHE_TOKEN``, ``KCACHE_CACHE_DIR``, ...), and
    override them. ``http_client`` is an ``httpx.Client`` to send every request with,
    used as it is (its timeouts, limits, proxies, event hooks) and never closed here.
    ``on_retry`` is told (a :class:`~kcache_client._http.RetryNotice`) before each wait
    for a retry of a request to the server, and ``give_up_after_outage`` makes requests
    try once each after one went unanswered (what a command, whose user waits, wants;
    :class:`~kcache_client._http.Transport`).

    A miss the server cannot answer because it is unreachable (or because there is no
    URL) is compiled here when local compiles are on and NVRTC is installed: by default
    that is without a server (``ClientSettings.local_compile`` decides otherwise).
    """

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        *,
        settings: ClientSettings | None = None,
        http_client: httpx.Client | None = None,
        on_retry: Callable[[RetryNotice], None] | None = None,
        give_up_after_outage: bool = False,
    ) -> None:
        if settings is None:
            settings = ClientSettings.from_env(url=url, token=token, cache_dir=cache_dir)
        else:
            settings = settings.located(url, token, cache_dir)
        self.settings = settings
        self.url = settings.url
        #: Whose signatures artifacts must carry (given keys, or the keys pinned for this
        #: cache's server: a key pinned for another URL vouches for nothing here).
        self.trust = Trust.from_settings(
            settings.trusted_keys, settings.known_servers, settings.url
        )
        self.tier = NodeTier(
            settings.cache_dir,
            lock_timeout=settings.lock_timeout_s,
            max_bytes=settings.cache_max_bytes,
            trust=self.trust,
        )
        self.stats = CacheStats()
        _tier_stats.track(self.tier, self.stats)  # written at exit: kcache cache stats
        self.host = settings.hostname
        self.client_id = settings.client_id or f"{self.host}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.rank = int(os.environ.get("RANK", "0") or 0)
        self.world_size = int(os.environ.get("WORLD_SIZE", "1") or 1)
        self._transport = (
            Transport(
                settings.url,
                settings.token,
                retry=settings.retry,
                timeout=settings.timeout,
                client=http_client,
                # Every request says that a fetch that misses is followed by a resolve
                # (only the fetch route reads it): the transport sends no per-request headers.
                headers={
                    ON_MISS_HEADER: ON_MISS_RESOLVE,
                    # Who asks, as a resolve's context says: a fetch's audit event carries it.
                    CONTEXT_HEADER: encode_context(self.context()),
                },
                on_retry=on_retry,
                give_up_after_outage=give_up_after_outage,
                offline=settings.offline,
            )
            if settings.url
            else None
        )
        self._remote = (
            Remote(
                self._transport,
                self.stats,
                max_artifact_bytes=settings.max_artifact_bytes,
                trust=self.trust,
            )
            if self._transport
            else None
        )
        self._local = LocalCompiler(self.tier, settings)
        self._events = (
            # One sender per node where the tier is this user's (kcache_client._event_spool).
            EventSink(
                self._transport,
                spool=NodeEventSpool.for_tier(self.tier, self._transport.url, settings.token),
            )
            if self._transport is not None and settings.send_events and not settings.offline
            else None
        )
        self._memory: LruCache[str, Artifact] = LruCache(max_entries=settings.memory_entries)
        #: Read-only layers under the node tier, looked up after it in order (kcache_client._bundle).
        self.layers = open_layers(
            settings.layers,
            settings.cache_dir,
            self.trust,
            max_entry_bytes=settings.max_artifact_bytes,
        )
        for layer in self.layers:  # the layers refuse what the node tier knows withdrawn
            layer.withdrawals = self.tier.withdrawals
        if self._remote is not None:
            # A cache with a server checks its answers' signatures: the verifier is made now
            # (0.4 ms: kcache.signing.verifier), not in a rank's first fetch. Without a server
            # nothing is made until a signature is met (a private tier's hits meet none).
            load_backend()
            # A tier entry signed by a key not pinned yet, met before this user ever talked to
            # the server, is looked up there first (its first contact pins it): one try, short.
            contact_retry = replace(
                settings.retry, attempts=1, deadline_s=min(settings.retry.deadline_s, 10.0)
            )
            transport = self._remote.transport
            self.trust.contact = functools.partial(
                transport.request_json, "GET", "/v1/keys", retry=contact_retry
            )
        #: When the server's withdrawals are read, and what is done with them
        #: (kcache_client._withdrawals); None without a server.
        self._withdrawal_watch = (
            WithdrawalWatch(
                self._remote,
                self.tier,
                settings.withdrawal_check_s,
                self.stats,
                self._forget_withdrawn,
                retry=replace(
                    settings.retry, attempts=1, deadline_s=min(settings.retry.deadline_s, 10.0)
                ),
            )
            if self._remote is not None
            else None
        )
        # What this process was served, by recipe key: its manifest (KernelCache.manifest).
        self._used: dict[str, ManifestKernel] = {}
        self._freezer = Freezer(self.stats, self._events, self.context)
        self._toolchain_default: str | None = None
        self._toolchain_lock = threading.Lock()
        #: What include sets are pinned to before keying (kcache_client._include_pins).
        self.include_pins = IncludeSetPins(settings.include_sets, self._server_set_digests)
        self._closed = False
        # atexit holds only a weak reference, so an unused cache can still be collected.
        ref = weakref.ref(self)
        self._atexit = lambda: (lambda c: c.close() if c is not None else None)(ref())
        atexit.register(self._atexit)

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Write the tier's pending records, deliver queued audit events (bounded wait) and
        close connections; idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._atexit)
        self.tier.flush()  # the records of this process's last publishes
        for tier in (self.tier, *self.layers):
            tier.close()
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
        """The audit-event sink (None without a server or with ``send_events`` off)."""
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
        if self.settings.auto_target:
            return self.settings.auto_target
        from kcache_client._device import auto_target

        return auto_target(self.settings.device)

    def default_toolchain(self) -> str:
        """The server's default toolchain id (``GET /v1/toolchains``), cached for the process.

        It is also saved in the node tier with the server's signature: a process that starts
        while that is young takes it from there without asking (kcache_client._server_facts),
        and one started while the server is down still keys recipes as it did; failing
        that, a local NVRTC's id is used when local compiles are enabled.
        """
        with self._toolchain_lock:
            if self._toolchain_default is not None:
                return self._toolchain_default
            facts = self.tier.load_server_facts(self.url) if self.url is not None else None
            default = kept_default(facts, self.trust)
            if default is None:
                try:
                    default = str(self.toolchains()["default"])
                except ServerUnavailableError as exc:
                    default = self._offline_toolchain(exc)
            self._toolchain_default = default
            return default

    def toolchains(self) -> dict[str, Any]:
        """The server's ``GET /v1/toolchains`` answer (also saved in the tier for offline keying)."""
        remote = self._require_server()
        body = remote.toolchains()
        self.tier.save_server_facts(
            remote.url,
            {
                "default_toolchain": body["default"],
                "include_set_digests": server_set_digests(body),
                **signed_default(body),
            },
        )
        return body

    def _server_set_digests(self) -> dict[str, str]:
        """The server's include sets' digests now; offline, the last ones the tier kept."""
        if self.url is None:
            return {}  # no server: only this process's own sets can be pinned
        try:
            return server_set_digests(self.toolchains())
        except ServerUnavailableError as exc:
            facts = self.tier.load_server_facts(self.url) if self.url is not None else None
            if facts and isinstance(facts.get("include_set_digests"), dict):
                return server_set_digests(facts)
            raise ServerUnavailableError(
                exc.url,
                f"{exc.cause}; the recipe names a server include set, whose contents are not "
                f"known in {self.tier.root} yet",
            ) from exc

    def _offline_toolchain(self, cause: ServerUnavailableError) -> str:
        if self.url is not None:
            facts = self.tier.load_server_facts(self.url)
            if facts and isinstance(facts.get("default_toolchain"), str):
                return str(facts["default_toolchain"])
        if self._local.enabled:
            try:
                return self._local.engine().toolchain_id
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
        """The concrete recipe: ``auto`` resolved to this device, the toolchain to the server's,
        and each include set pinned to its contents (:mod:`~kcache_client._include_pins`)."""
        auto, toolchain = _needs(recipe)
        unpinned = recipe.unpinned_include_sets()
        if not (auto or toolchain or unpinned):
            return recipe  # concrete already (what with_defaults would answer, built first)
        target = self.auto_target() if auto else None
        tc = self.default_toolchain() if toolchain else None
        sets = self.include_pins.digests(unpinned) if unpinned else None
        return recipe.with_defaults(target=target, toolchain=tc, include_sets=sets)

    def key(self, recipe: Recipe) -> str:
        """The recipe key of the concrete recipe."""
        return self.prepare(recipe).key()

    # ------------------------------------------------------------------ get
    def get(self, recipe: Recipe, *, compile: bool = True, refresh: bool = False) -> Artifact:
        """The verified artifact for ``recipe``; its ``origin`` says where it was found.

        Memory, the node tier, then the server: one request fetches a kernel the server
        holds; a miss is compiled there (``compile=False`` only fetches). ``refresh``
        asks the server even when memory or the tier hold the kernel (what ``kcache
        compile --server`` does), and takes the tier's copy only if the server cannot
        be reached.

        Raises RemoteCompileError (a CompileError) when the recipe does not compile,
        RemoteNotFoundError when absent and ``compile`` is false, ServerUnavailableError
        (naming the URL and cause) when only the unreachable server could have answered,
        MetadataError or DigestMismatchError when the server's answer cannot be trusted,
        LateCompileError when the cache is frozen with ``error`` and its tiers lack the kernel.
        """
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
            late = self._freezer.late(key, concrete)  # frozen: reported, or refused here
            if late is not None:
                raise late
        offline: ServerUnavailableError
        # The per-key lock makes the node download once however many ranks ask; it
        # guards no correctness (publishing is atomic), so a lock timeout only costs time.
        # A rank waiting for another's download takes the entry from the tier as soon as
        # it is published, without queueing for the lock (hold_unless).
        published: Callable[[], Artifact | None] = (
            _nothing if refresh else lambda: self._from_tier(key, concrete)
        )
        with self.tier.hold_unless(key, published) as art:
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
                        _tell_offline(offline, f"answered from the node tier {self.tier.root}")
                    return art
        # Outside the lock: the local engine takes the same per-key lock itself.
        return self._compile_locally(concrete, key, compile, offline)

    def get_many(
        self,
        recipes: Sequence[Recipe],
        *,
        compile: bool = True,
        progress: bool = False,
        context: Mapping[str, Any] | None = None,
    ) -> list[Artifact | KCacheError]:
        """An artifact, or the typed error of that recipe, for each of ``recipes``, in order.

        What memory and the node tier hold costs no request; the rest is resolved
        through ``/v1/resolve/batch`` (misses compiled in parallel on the server, a
        ``progress`` bar on stderr) and downloaded into the tier, verified. A recipe's
        own failure is its result: RemoteCompileError (a CompileError),
        RemoteNotFoundError (absent, ``compile`` false), RecipeRefusedError (any other
        code), LateCompileError (frozen with ``error``: :meth:`freeze`), or the core's
        CompileError from a local compile. The call itself raises
        when it cannot proceed: no server and no local compiles, authentication, a
        recipe that cannot be keyed here. When the server cannot be reached and local
        compiles are on, the rest are compiled here, one by one. ``context`` overrides
        fields of :meth:`context` in the requests (a warmup names its group rank).
        """
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
                late = None if found is not None else self._freezer.late(key, recipe)
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
                    answers = self._require_server().resolve_batch(
                        chunk, compile=compile, context=asked
                    )
                except ServerUnavailableError as exc:
                    if not (self._local.enabled and compile):
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

    def warmup(
        self,
        recipes: Iterable[Recipe],
        group: Any = None,
        *,
        per_node: bool = False,
        timeout: float = 1800.0,
        compile: bool = True,
        progress: bool | None = None,
        manifest: JobManifest | None = None,
        then: str | None = None,
    ) -> WarmupResult:
        """Resolve every rank's recipes once per job (or node), then load them from the tier.

        Design §8, :mod:`kcache_client._warmup`. ``group`` is a torch process group, any
        :class:`~kcache_client.Collective`, or None (torch's default group when one is
        initialised, else this process alone). Every rank resolves ``auto`` for its own
        device; the ranks all-gather their concrete recipes; the leader (rank 0, or the
        lowest rank of each host with ``per_node``) resolves the union through
        :meth:`get_many` with a progress bar and fills its node tier; its broadcast of
        the outcomes is the barrier. Any failure raises the same WarmupError on every
        rank; a rank that does not arrive, or a leader that dies, makes every other rank
        raise the same WarmupTimeoutError (naming the missing rank when it is known).

        ``timeout`` bounds every wait: for the other ranks to arrive (counted from this
        rank's own call, so ranks may arrive in any order with any skew below it) and
        for the leader's outcomes (the leader gives up resolving a little before it).
        A warmup may run any number of times in a job, on any group; under
        torch.distributed it creates no process group (see ``_collective``), so there
        is nothing to tear down.

        ``manifest`` (a :class:`~kcache.job_manifest.JobManifest`, e.g. a previous run's) is
        prefetched first: over a torch process group, one bundle request per job, its
        bytes broadcast to the nodes that lack it and checked there as the server's answer
        (:mod:`~kcache_client._fanout`; every rank passes the manifest); else as
        :meth:`prefetch` (one request per node). A node that holds it asks nothing;
        ``recipes`` may then be empty, and the warmup is the barrier.
        ``then``: what the cache does after the barrier with a kernel its tiers lack
        (:mod:`~kcache_client._freeze`): ``"freeze"`` (the mode KCACHE_AFTER_WARMUP names,
        else ``warn``), ``"warn"``, ``"error"``, ``"allow"``, or None (KCACHE_AFTER_WARMUP's
        word, else nothing changes). A warmup thaws the cache for its own lookups.
        """
        mode = after_warmup_mode(then, self.settings.after_warmup)
        self.include_pins.refresh()  # a job start: the server's include sets as they are now
        watch = self._withdrawal_watch
        before = self._freezer.mode
        self._freezer.set("allow")
        try:
            if watch is not None:  # a job start: its first local answer reads withdrawals first
                watch.expire(True)
            if manifest is not None:  # one request per job, fanned out over the group
                prefetch_in_group(self, manifest, group, timeout=timeout, host=self.host)
            result = warmup(
                self,
                recipes,
                group,
                per_node=per_node,
                timeout=timeout,
                compile=compile,
                progress=progress,
            )
        finally:
            self._freezer.set(before)  # a failed warmup leaves the cache as it was
            if watch is not None:  # what the server answered needs no read; nor what follows
                watch.expire(False)
        if mode is not None:
            self._freezer.set(mode)
        return result

    # ------------------------------------------------------------------ jobs
    def freeze(self, mode: FreezeMode | str = "error") -> None:
        """From now on, a kernel neither memory nor the node's tiers hold is late
        (:mod:`~kcache_client._freeze`): ``warn`` reports it and goes on, ``error`` refuses it
        with :class:`~kcache_client.errors.LateCompileError` (both audit an outcome ``late``);
        ``allow`` thaws."""
        self._freezer.set(parse_mode(mode))

    @property
    def frozen(self) -> FreezeMode:
        """The freeze mode now (``allow``: not frozen)."""
        return self._freezer.mode

    def manifest(self, job_id: str | None = None) -> JobManifest:
        """What this process was served so far (every ``get``, ``get_many`` and warmup), as a
        :class:`~kcache.job_manifest.JobManifest` of ``job_id`` (default the settings' job)."""
        return JobManifest.of(list(self._used.values()), job_id or self.settings.job_id)

    def job_manifest(self, job_id: str | None = None) -> JobManifest:
        """The server's manifest of ``job_id`` (default this cache's job): every kernel its
        audit events name (``GET /v1/jobs/{job}/manifest``)."""
        job = job_id or self.settings.job_id
        if not job:
            raise KCacheError("no job id: pass one, or set KCACHE_JOB_ID")
        from urllib.parse import quote

        body = self._require_server().transport.request_json(
            "GET", f"/v1/jobs/{quote(job, safe='')}/manifest"
        )
        return JobManifest.from_dict(body)

    def prefetch(
        self, manifest: JobManifest, group: Any = None, *, timeout: float = 1800.0
    ) -> PrefetchResult:
        """Every artifact of ``manifest`` this node's tiers lack, in one streamed request.

        Design: Bundles (:mod:`~kcache_client._bundle`). Each entry is checked (digest and
        the server's signature) before it is published into the node tier; a tier whose
        completeness marker names the manifest makes no request at all. Keys the server
        has no artifact for are the result's ``missing`` (they are looked up as usual later).
        ``group`` (a torch process group or a Collective; every member calls this): one
        request per job, fanned out to the nodes that lack it (:mod:`~kcache_client._fanout`),
        every wait bounded by ``timeout`` as a warmup's.
        """
        if group is None:
            return prefetch(self, manifest)
        return prefetch_in_group(self, manifest, group, timeout=timeout, host=self.host)

    # ------------------------------------------------------------------ tiers
    def check_withdrawals(self) -> None:
        """Read the server's withdrawals now and drop what they name from memory and the node
        tier (:mod:`~kcache_client._withdrawals`); a prefetch does it first when the tiers hold
        some of its manifest. Never raises for the server's sake; nothing without a server."""
        if self._withdrawal_watch is not None:
            self._withdrawal_watch.check(force=True)

    def _forget_withdrawn(self, pairs: Sequence[Pair]) -> None:
        for key, digest in pairs:
            art = self._memory.get(key)
            if art is not None and art.digest == digest:
                self._memory.discard(key)

    def forget_memory(self) -> None:
        """Drop the in-process copies (the node tier keeps its own)."""
        self._memory.clear()

    def _local_hit(self, key: str, concrete: Recipe, started: float) -> Artifact | None:
        """Memory, then the node tier, audited as a ``local_hit``; None when neither holds it."""
        art = self._memory.get(key)
        watch = self._withdrawal_watch
        if art is not None and watch is not None and not watch.memory_holds(key, art.digest):
            self._memory.discard(key)
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
        watch = self._withdrawal_watch  # what the server withdrew, read first when due
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
        a local compile), which ``load()`` relies on (:class:`Judgement`)."""
        trust = self.trust
        if origin == "local_compile":
            how = "compiled here"
        elif origin in ("node", "memory"):
            how = (tier or self.tier).standing.kind  # private, shared, untrusted: its tier's
        else:
            how = "signed"
        return Artifact(
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
            materialize=functools.partial(self._checked_file, meta.digest, data),
            judged=Judgement(trust, key, meta, signature, data, how),
        )

    def _checked_file(self, digest: str, data: bytes) -> str:
        """A file holding exactly ``data`` (bytes of ``digest`` checked when they were found),
        for ``Artifact.path``: the node tier's blob where the tier is private to this user,
        else a file written from ``data`` into this user's own private tier (a shared tier's
        file could be rewritten by its owner between a check and a load)."""
        found = self.tier.checked_file(digest, data)
        if found is None:
            found = self._local.tier.checked_file(digest, data)
        if found is None:
            raise KCacheError(f"no private directory to write the kernel {digest} into")
        return found

    def _remember(self, art: Artifact) -> Artifact:
        """Keep ``art`` in memory, where later calls find it (as from ``memory``), and in the
        process's manifest."""
        self._memory.put(art.recipe_key, art.found_in("memory"))
        meta = art.metadata
        self._used[art.recipe_key] = ManifestKernel(
            art.recipe_key,
            meta.digest,
            meta.kernel,
            meta.target,
            meta.toolchain,
            meta.kind,
            meta.size,
        )
        return art

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
    def _require_server(self) -> Remote:
        if self._remote is None:
            raise ServerUnavailableError(
                "(none)", "no server configured: set KCACHE_URL or pass url="
            )
        return self._remote

    def _from_server(self, concrete: Recipe, key: str, *, compile: bool, refresh: bool) -> Artifact:
        """By key in one round trip; on a miss (or with ``refresh``) a resolve. Publishes into the tier."""
        remote = self._require_server()
        if not refresh:
            fetched = remote.fetch(concrete, key)
            if fetched is not None:
                meta, data, signature = fetched
                return self._publish(key, concrete, meta, data, "server", signature)
        return self._resolve(concrete, key, compile)

    def _resolve(self, concrete: Recipe, key: str, compile: bool) -> Artifact:
        remote = self._require_server()
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
        remote = self._require_server()
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
        origin, meta, data = self._local.compile(concrete, key, compile=compile, offline=offline)
        if origin != "node":
            self.stats.add("local_compiles")
        if self.url is not None:
            _tell_offline(
                offline,
                f"answered from the node tier {self.tier.root}"
                if origin == "node"
                else f"compiled here into the node tier {self.tier.root} (local compiles are on)",
            )
        art = self._artifact(key, concrete, meta, data, origin, None, self._local.tier)
        return self._remember(art)

    def _compile_one_locally(
        self, concrete: Recipe, key: str, offline: ServerUnavailableError
    ) -> Artifact | KCacheError:
        """One recipe of a batch compiled here because the server is unreachable."""
        try:
            return self._compile_locally(concrete, key, True, offline)
        except CompileError as exc:
            return exc

    # ------------------------------------------------------------------ events
    def _event(self, art: Artifact, started: float) -> None:
        """Report a memory or node-tier hit: the server never sees those otherwise."""
        events = self._events
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
