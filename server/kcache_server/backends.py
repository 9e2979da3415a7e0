"""The one place where the server picks its backends from settings.

store     LocalArtifactStore(data_dir)              (a shared POSIX dir for several replicas)
          CachedArtifactStore(data_dir, <store_url's store>)
                                                     with store_url: blobs in the store it
                                                     names (s3://: a bucket), a bounded local
                                                     copy on each replica; every request to it
                                                     bounded in time (store_timeout_s,
                                                     store_retries). Which backend a URL names
                                                     is kcache.store.urls.STORE_URL_SCHEMES
index     SqlIndex(SQLite | PostgreSQL)
lock      SingleFlight(PgAdvisoryKeyLock)            on PostgreSQL: across replicas
          SingleFlight(FileKeyLock(data_dir))        on SQLite: across processes on one host
compiler  ProcessPoolCompiler                        NVRTC in worker processes with limits
                                                     (none where the server cannot compile:
                                                     kcache_server.compiler_presence)
          QuotaCompiler around it, for the engine     charges each compile to its caller (quotas)

The rest of the server sees the store through the ``ArtifactStore`` seam only
(:mod:`kcache.store.base`): serving, readiness, eviction and maintenance never ask
which backend it is.
"""

from __future__ import annotations

from dataclasses import dataclass

import sqlalchemy as sa

from kcache.engine import Engine
from kcache.eviction import default_tier_cap
from kcache.include_sets import IncludeSets
from kcache.locks import FileKeyLock, KeyLock, SingleFlight
from kcache.store.base import ArtifactStore
from kcache.store.cached import CachedArtifactStore
from kcache.store.local import LocalArtifactStore
from kcache.store.urls import open_store_url
from kcache.toolchain import Toolchain
from kcache_server.compile_pool import ProcessPoolCompiler
from kcache_server.compiler_presence import server_toolchain
from kcache_server.db import DatabaseFile, is_postgres, open_database, sqlite_path
from kcache_server.index import SqlIndex
from kcache_server.locks import PgAdvisoryKeyLock
from kcache_server.quotas import QuotaCompiler
from kcache_server.settings import Settings

__all__ = ["Backends", "maintained_store", "open_backends", "open_settings_database"]


@dataclass
class Backends:
    """The engine and the parts it runs over."""

    db: sa.Engine
    store: ArtifactStore
    index: SqlIndex
    lock: KeyLock
    compiler: ProcessPoolCompiler
    engine: Engine
    toolchain: Toolchain
    # The SQLite file, watched for vanishing under the server (None on PostgreSQL).
    db_file: DatabaseFile | None = None


def open_settings_database(settings: Settings) -> sa.Engine:
    """The database ``settings`` name (creating the data directory for SQLite)."""
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    return open_database(
        settings.database_url,
        pool_size=settings.db_pool_size,
        max_overflow=settings.db_max_overflow,
    )


def _key_lock(settings: Settings, db: sa.Engine) -> KeyLock:
    if is_postgres(db):
        return SingleFlight(PgAdvisoryKeyLock(db))
    return SingleFlight(FileKeyLock(settings.data_dir))


def _url_store(settings: Settings, url: str) -> ArtifactStore:
    """The store ``url`` names, every request bounded by the settings."""
    return open_store_url(
        url,
        timeout_s=settings.store_timeout_s,
        connect_timeout_s=settings.store_connect_timeout_s,
        retries=settings.store_retries,
        probe_timeout_s=settings.readiness_timeout_s,
    )


def _artifact_store(settings: Settings) -> ArtifactStore:
    """The store this replica serves from: its data directory, or bounded copies of ``store_url``'s."""
    if not settings.store_url:
        return LocalArtifactStore(settings.data_dir)
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    return CachedArtifactStore(
        settings.data_dir,
        _url_store(settings, settings.store_url),
        max_bytes=int(settings.store_cache_bytes or default_tier_cap(settings.data_dir)),
    )


def maintained_store(settings: Settings) -> ArtifactStore:
    """The store a server's blobs live in, for ``kcache db verify|gc``: the one ``store_url``
    names (the truth behind every replica's local copies), else the data directory."""
    if settings.store_url:
        return _url_store(settings, settings.store_url)
    return LocalArtifactStore(settings.data_dir)


def open_backends(settings: Settings, db: sa.Engine) -> Backends:
    """Build every backend; the compile pool is created but not started."""
    toolchain = server_toolchain(settings)  # one that compiles nothing, where none can
    include_sets = IncludeSets(settings.include_sets)
    store = _artifact_store(settings)
    index = SqlIndex(db)
    lock = _key_lock(settings, db)
    compiler = ProcessPoolCompiler(
        toolchain,
        include_sets,
        workers=settings.compile_workers,
        timeout_s=settings.compile_timeout_s,
        memory_mb=settings.compile_memory_mb,
        queue_limit=settings.compile_queue_limit,
        tmp_dir=settings.data_dir / "tmp",
        toolchain_dir=settings.toolchain_dir,
        retry_after_s=settings.retry_after_s,
        caller_limit=settings.compile_caller_limit,
        caller_queue_limit=settings.compile_caller_queue_limit,
        queue_timeout_s=settings.compile_queue_timeout_s,
        min_free_bytes=settings.min_free_bytes,
        compile_sandbox=settings.compile_sandbox_mode,
    )
    engine = Engine(
        store,
        index,
        lock,
        QuotaCompiler(
            compiler,
            db,
            quota_bytes=settings.token_quota_bytes,
            max_artifact_bytes=settings.max_artifact_bytes,
        ),
        lock_timeout=settings.lock_timeout_s,
        max_artifact_bytes=settings.max_artifact_bytes,
        failure_ttl_s=settings.failure_ttl_s,
    )
    path = sqlite_path(settings.database_url)
    db_file = DatabaseFile(path) if path is not None and path.exists() else None
    return Backends(db, store, index, lock, compiler, engine, toolchain, db_file)
