"""``ServerState``: what every request needs, built once per server process by ``create_app``.

The engine is synchronous (NVRTC, file and database I/O); routes call it on worker
threads through one bounded limiter, so a burst of compiles cannot exhaust threads,
and through a per-caller share of it, so one caller's parked requests cannot either
(:meth:`ServerState.run`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import anyio
from anyio import to_thread

from kcache_server.auditing.retention import RetentionWorker
from kcache_server.auditing.writer import AuditLog
from kcache_server.auth import TokenStore
from kcache_server.backends import Backends
from kcache_server.fairness import CallerSlots, current_caller
from kcache_server.foreign import ForeignStore
from kcache_server.metrics import ServerMetrics
from kcache_server.recipe_checks import RecipeChecks
from kcache_server.recipe_records import RecipeRecords
from kcache_server.resolving import Resolver
from kcache_server.settings import Settings
from kcache_server.signer import ArtifactSigner
from kcache_server.signing_keys import record_at_start

__all__ = ["ServerState"]


@dataclass
class ServerState:
    """The settings, backends, tokens, audit writer, metrics and resolver of one server process."""

    settings: Settings
    backends: Backends
    tokens: TokenStore
    audit: AuditLog
    metrics: ServerMetrics
    retention: RetentionWorker
    #: Engine calls running at once; created by the lifespan, inside the event loop.
    limiter: anyio.CapacityLimiter | None = None
    caller_slots: CallerSlots = field(init=False)
    resolver: Resolver = field(init=False)
    recipes: RecipeChecks = field(init=False)
    #: Signs every key -> artifact answer (kcache_server.signer).
    signer: ArtifactSigner = field(init=False)
    #: Recipes compiled or served, kept to explain misses (written by the audit writer's thread).
    recipe_records: RecipeRecords = field(init=False)
    #: Foreign artifacts: what library cache hooks published (docs/design.md section 10).
    foreign: ForeignStore = field(init=False)

    def __post_init__(self) -> None:
        threads = self.settings.request_threads
        self.caller_slots = CallerSlots(self.settings.caller_threads or max(1, threads // 2))
        self.recipe_records = RecipeRecords(self.backends.db)
        self.recipe_records.failure_listeners.append(self.metrics.recipe_record_failed)
        self.audit.preparers.append(self.recipe_records.prepare)
        settings = self.settings
        self.signer = ArtifactSigner.load(
            settings.signing_key_path,
            settings.signing_previous_key_file,
            create=settings.signing_key_file is None,
        )
        # Refuses to start beside another key in use on this database (kcache_server.signing_keys).
        record_at_start(self.backends.db, self.signer, settings)
        self.resolver = Resolver(
            self.backends,
            self.audit,
            self.run,
            self.settings.blob_cache_bytes,
            self.signer,
            recipe_records=self.recipe_records,
        )
        self.recipes = RecipeChecks(self.backends)
        self.foreign = ForeignStore(self.backends.db, self.backends.store, self.signer)

    async def run(self, func: Any, *args: Any, **kwargs: Any) -> Any:
        """Run a blocking call on a worker thread under the shared limiter and the caller's share."""
        async with self.caller_slots.hold(current_caller.get()):
            return await to_thread.run_sync(lambda: func(*args, **kwargs), limiter=self.limiter)
