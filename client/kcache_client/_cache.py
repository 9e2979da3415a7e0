"""``KernelCache``: cubins by recipe, through memory, the node-local tier and the server.

The public façade, and what its jobs share: settings, the transport and the server
(:mod:`~kcache_client._remote`), the node tier and its read-only layers, trust, events,
and keying (the device's target, the server's default toolchain, include sets pinned).
The get path, ``get`` and ``get_many``, is :mod:`~kcache_client._lookup`; the job
façade's steps (warmup, prefetch, the server's manifest) are :mod:`~kcache_client._jobs`,
imported when first used: a process that only gets kernels (B7) loads none of them.
"""

from __future__ import annotations

import atexit
import functools
import os
import threading
import uuid
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from kcache.artifact_header import (
    CONTEXT_HEADER,
    ON_MISS_HEADER,
    ON_MISS_RESOLVE,
    encode_context,
)
from kcache.errors import KCacheError
from kcache.job_manifest import JobManifest
from kcache.recipe import Recipe
from kcache_client import _tier_stats
from kcache_client._artifact import Artifact
from kcache_client._bundle import open_layers
from kcache_client._event_spool import NodeEventSpool
from kcache_client._events import EventSink
from kcache_client._freeze import FreezeMode, parse_mode
from kcache_client._http import RetryNotice, Transport
from kcache_client._include_pins import IncludeSetPins, server_set_digests
from kcache_client._local import LocalCompiler
from kcache_client._lookup import Lookup, require_recipe
from kcache_client._offline import OFFLINE_LOGGER, offline_set_digests, offline_toolchain
from kcache_client._remote import Remote
from kcache_client._server_facts import kept_default, signed_default
from kcache_client._settings import ClientSettings, _env_int
from kcache_client._stats import CacheStats
from kcache_client._tier import NodeTier
from kcache_client._trust import Trust
from kcache_client.errors import CacheClosedError, ServerUnavailableError

if TYPE_CHECKING:  # the job façade's results: kcache_client._jobs is imported when first used
    import httpx  # a caller's own client only: kcache's requests never import it

    from kcache_client._bundle import PrefetchResult
    from kcache_client._foreign_ledger import ForeignLedger
    from kcache_client._warmup import WarmupResult
    from kcache_client._withdrawal_watch import WithdrawalWatch

__all__ = ["OFFLINE_LOGGER", "KernelCache"]


def _require_manifest(manifest: object, where: str) -> None:
    """TypeError naming ``where`` unless ``manifest`` is a JobManifest."""
    if not isinstance(manifest, JobManifest):
        raise TypeError(
            f"{where} takes a kcache.job_manifest.JobManifest (KernelCache.manifest(), "
            f"job_manifest() or JobManifest.load), not {type(manifest).__name__}"
        )


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
        # The launcher's (torchrun, SLURM wrappers): a value that is no number is refused
        # here, by name, not at some later int() deep in a request.
        self.rank = _env_int("RANK", 0, 0)
        self.world_size = _env_int("WORLD_SIZE", 1, 1)
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
            # The Ed25519 verifier is made when a signature is first met (a fetch's answer, a
            # shared tier's entry), not here: a process whose kernels are all in its private
            # tier meets none, server or not (B7), and a rank that fetches pays it once.
            # A tier entry signed by a key not pinned yet, met before this user ever talked to
            # the server, is looked up there first (its first contact pins it): one try, short.
            contact_retry = replace(
                settings.retry, attempts=1, deadline_s=min(settings.retry.deadline_s, 10.0)
            )
            transport = self._remote.transport
            self.trust.contact = functools.partial(
                transport.request_json, "GET", "/v1/keys", retry=contact_retry
            )
        self._toolchain_default: str | None = None
        self._toolchain_lock = threading.Lock()  # and the foreign ledger's making
        self._foreign_ledger: ForeignLedger | None = None
        #: What include sets are pinned to before keying (kcache_client._include_pins).
        self.include_pins = IncludeSetPins(settings.include_sets, self._server_set_digests)
        #: The get path: memory, the node tier, the server, local compiles (kcache_client._lookup).
        self._lookup = Lookup(
            settings,
            tier=self.tier,
            layers=self.layers,
            trust=self.trust,
            stats=self.stats,
            remote=self._remote,
            local=self._local,
            events=self._events,
            context=self.context,
            prepare=self._prepare,  # the lookups check their recipes and the cache first
            include_pins=self.include_pins,
        )
        self._closed = False
        # atexit holds only a weak reference, so an unused cache can still be collected.
        ref = weakref.ref(self)
        self._atexit = lambda: (lambda c: c.close() if c is not None else None)(ref())
        atexit.register(self._atexit)

    @functools.cached_property
    def host(self) -> str:
        """This machine's name as the audit records it (``ClientSettings.hostname``)."""
        return self.settings.hostname

    @functools.cached_property
    def client_id(self) -> str:
        """Who this cache is in the audit: ``ClientSettings.client_id``, else host, pid and a
        random part (worked out when first sent: a cache that only reads its tier never asks)."""
        return self.settings.client_id or f"{self.host}-{os.getpid()}-{uuid.uuid4().hex[:8]}"

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Write the tier's pending records, deliver queued audit events (bounded wait) and
        close connections; idempotent.

        A closed cache serves nothing, with a server or without, from memory too: ``get``,
        ``get_many``, ``warmup``, ``prefetch``, ``job_manifest``, ``toolchains``, ``prepare``,
        ``key`` and ``check_withdrawals`` raise
        :class:`~kcache_client.errors.CacheClosedError`; make a new ``KernelCache``. What
        needs nothing of it still answers: ``stats``, ``manifest()``, ``settings``. Artifacts
        it returned before stay usable (their bytes are in memory)."""
        if self._closed:
            return
        self._closed = True
        self._lookup.closed = True
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

    def _check_open(self, doing: str) -> None:
        """CacheClosedError after :meth:`close` (see its docstring)."""
        if self._closed:
            raise CacheClosedError(doing)

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
        self._check_open("default_toolchain()")
        with self._toolchain_lock:
            if self._toolchain_default is not None:
                return self._toolchain_default
            facts = self.tier.load_server_facts(self.url) if self.url is not None else None
            default = kept_default(facts, self.trust)
            if default is None:
                try:
                    default = str(self.toolchains()["default"])
                except ServerUnavailableError as exc:
                    default = offline_toolchain(self.tier, self.url, self._local, exc)
            self._toolchain_default = default
            return default

    def toolchains(self) -> dict[str, Any]:
        """The server's ``GET /v1/toolchains`` answer (also saved in the tier for offline keying)."""
        self._check_open("toolchains()")
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
            return offline_set_digests(self.tier, self.url, exc)

    def prepare(self, recipe: Recipe) -> Recipe:
        """The concrete recipe: ``auto`` resolved to this device, the toolchain to the server's,
        and each include set pinned to its contents (:mod:`~kcache_client._include_pins`)."""
        if not isinstance(recipe, Recipe):
            require_recipe(recipe, "recipe")
        if self._closed:
            raise CacheClosedError("prepare()")
        return self._prepare(recipe)

    def _prepare(self, recipe: Recipe) -> Recipe:
        """:meth:`prepare` of a recipe and an open cache checked already (by the lookups)."""
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
        return self._lookup.get(recipe, compile=compile, refresh=refresh)

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
        return self._lookup.get_many(recipes, compile=compile, progress=progress, context=context)

    # ------------------------------------------------------------------ jobs
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
        self._check_open("warmup()")
        if isinstance(recipes, Recipe | str | bytes | Mapping) or not isinstance(recipes, Iterable):
            raise TypeError(
                f"warmup(recipes=...) takes an iterable of kcache Recipe objects, not "
                f"{type(recipes).__name__}"
            )
        recipes = [require_recipe(r, f"warmup recipes[{i}]") for i, r in enumerate(recipes)]
        if manifest is not None:
            _require_manifest(manifest, "warmup(manifest=...)")
        from kcache_client._jobs import run_warmup

        return run_warmup(
            self,
            recipes,
            group,
            freezer=self._lookup.freezer,
            watch=self._lookup.watch,
            per_node=per_node,
            timeout=timeout,
            compile=compile,
            progress=progress,
            manifest=manifest,
            then=then,
        )

    def freeze(self, mode: FreezeMode | str = "error") -> None:
        """From now on, a kernel neither memory nor the node's tiers hold is late
        (:mod:`~kcache_client._freeze`): ``warn`` reports it and goes on, ``error`` refuses it
        with :class:`~kcache_client.errors.LateCompileError` (both audit an outcome ``late``);
        ``allow`` thaws."""
        self._lookup.freezer.set(parse_mode(mode))

    @property
    def frozen(self) -> FreezeMode:
        """The freeze mode now (``allow``: not frozen)."""
        return self._lookup.freezer.mode

    def manifest(self, job_id: str | None = None) -> JobManifest:
        """What this process was served so far (every ``get``, ``get_many`` and warmup) and the
        foreign groups its library hooks used (:mod:`~kcache_client._foreign_ledger`), as a
        :class:`~kcache.job_manifest.JobManifest` of ``job_id`` (default the settings' job)."""
        ledger = self._foreign_ledger
        return JobManifest.of(
            self._lookup.manifest_kernels(),
            job_id or self.settings.job_id,
            foreign=ledger.entries() if ledger is not None else (),
        )

    @property
    def foreign_ledger(self) -> ForeignLedger:
        """The foreign groups this cache's library hooks used (made when a hook first asks)."""
        if self._foreign_ledger is None:
            from kcache_client._foreign_ledger import ForeignLedger

            with self._toolchain_lock:
                if self._foreign_ledger is None:
                    self._foreign_ledger = ForeignLedger()
        return self._foreign_ledger

    def job_manifest(self, job_id: str | None = None) -> JobManifest:
        """The server's manifest of ``job_id`` (default this cache's job): every kernel its
        audit events name (``GET /v1/jobs/{job}/manifest``)."""
        self._check_open("job_manifest()")
        from kcache_client._jobs import server_manifest

        return server_manifest(self, job_id)

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
        self._check_open("prefetch()")
        _require_manifest(manifest, "prefetch(manifest)")
        from kcache_client._jobs import prefetch_manifest

        return prefetch_manifest(self, manifest, group, timeout=timeout, host=self.host)

    # ------------------------------------------------------------------ tiers
    @property
    def withdrawal_watch(self) -> WithdrawalWatch | None:
        """When the server's withdrawals are read (kcache_client._withdrawal_watch); None
        without a server. The library hooks' lookups ask it as ``get``'s do."""
        return self._lookup.watch

    def check_withdrawals(self) -> None:
        """Read the server's withdrawals now and drop what they name from memory and the node
        tier (:mod:`~kcache_client._withdrawals`); a prefetch does it first when the tiers hold
        some of its manifest. Never raises for the server's sake; nothing without a server."""
        self._check_open("check_withdrawals()")
        watch = self.withdrawal_watch
        if watch is not None:
            watch.check(force=True)

    def forget_memory(self) -> None:
        """Drop the in-process copies (the node tier keeps its own)."""
        self._lookup.memory.clear()

    # ------------------------------------------------------------------ server
    def _require_server(self) -> Remote:
        """The server, or ServerUnavailableError without one (the jobs' modules ask for it)."""
        return self._lookup.require_server()
