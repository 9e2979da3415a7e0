"""Compiling here when the server cannot: the core engine over the node tier.

A worker with the NVRTC wheels and local compiles enabled (``ClientSettings.local_compile``;
on by default without a server) compiles a miss itself with the same engine the server
runs, over the node tier's own store, index and per-key lock, so every process of the
node compiles a kernel once and finds it afterwards. Recipes are keyed with this NVRTC's
toolchain id when the server's default cannot be learnt.

Only over a tier no one else can write (:mod:`kcache.standing`): an unsigned entry
compiled here proves nothing to another user, and an engine over a shared tier's
index would take another user's unsigned entry as a hit. Over a shared or untrusted
tier the engine runs over this user's own private directory instead
(``~/.cache/kcache/local``, :func:`kcache.dirs.user_cache_dir`), refused loudly when
that one is not private either.
"""

from __future__ import annotations

import threading

from kcache.artifact import ArtifactMeta
from kcache.dirs import toolchain_dir, user_cache_dir
from kcache.engine import Engine
from kcache.errors import ToolchainError
from kcache.recipe import Recipe
from kcache_client._artifact import ArtifactOrigin
from kcache_client._disk_full import refuse_full
from kcache_client._settings import ClientSettings
from kcache_client._tier import NodeTier
from kcache_client.errors import ServerUnavailableError

__all__ = ["LocalCompiler"]


class LocalCompiler:
    """The engine over ``tier``, built on first use (loading NVRTC takes a moment)."""

    def __init__(self, tier: NodeTier, settings: ClientSettings) -> None:
        self.shared_tier = tier
        self.settings = settings
        self._tier: NodeTier | None = tier if tier.standing.kind == "private" else None
        self._engine: Engine | None = None
        self._lock = threading.Lock()
        # Where this user's own tier and NVRTC's headers go, absolute now: a process that
        # changes its working directory later still uses the same ones (KCACHE_TOOLCHAIN_DIR
        # or XDG_CACHE_HOME may be relative).
        self._own_root = user_cache_dir("local")
        self._toolchain_root = toolchain_dir()

    @property
    def enabled(self) -> bool:
        """Whether misses may be compiled here (the settings; NVRTC is checked when used)."""
        return self.settings.compiles_locally

    @property
    def tier(self) -> NodeTier:
        """The tier local compiles go to: the node tier when private, else this user's own."""
        if self._tier is None:
            own = NodeTier(
                self._own_root,
                lock_timeout=self.settings.lock_timeout_s,
                max_bytes=self.settings.cache_max_bytes,
                trust=self.shared_tier.trust,
            )
            if own.standing.kind != "private":
                raise ToolchainError(
                    f"local compiles need a private directory, and {own.root} is not one "
                    f"({own.standing.reason})"
                )
            self._tier = own
        return self._tier

    def engine(self) -> Engine:
        """The core engine over the local tier (same store, index and lock); ToolchainError without NVRTC."""
        with self._lock:
            if self._engine is None:
                from kcache.compilers import InProcessCompiler
                from kcache.include_sets import IncludeSets
                from kcache.toolchain import load_toolchain

                self._engine = Engine(
                    self.tier.store,
                    self.tier.index,
                    self.tier.lock,
                    InProcessCompiler(
                        load_toolchain(self._toolchain_root),
                        IncludeSets(self.settings.include_sets, max_age_s=0),
                    ),
                )
            return self._engine

    def compile(
        self, concrete: Recipe, key: str, *, compile: bool, offline: ServerUnavailableError
    ) -> tuple[ArtifactOrigin, ArtifactMeta, bytes]:
        """The artifact of ``concrete``, compiled here (or found by the engine in the tier).

        ``offline`` is why the server did not answer; when local compiles are off, or
        ``compile`` is false, or NVRTC is missing or another toolchain, it is raised
        again with that reason added. A compile error raises the core's CompileError.
        """
        where = f"the node tier {self.shared_tier.root} has no artifact for recipe {key}"
        if not self.enabled or not compile:
            reason = (
                "local compiles are off (KCACHE_LOCAL_COMPILE=1)" if compile else "compile=False"
            )
            raise ServerUnavailableError(
                offline.url, f"{offline.cause}; {where}, and {reason}"
            ) from offline
        try:
            engine = self.engine()
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
        self.tier.flush()  # the manifest entries of this process's fetches, for the engine's match
        # The engine keeps its result only in the tier: a full disk fails the compile, said
        # with the directory and its fixes (kcache_client._disk_full).
        with refuse_full(self.tier.root, "storing a kernel compiled here"):
            result = engine.resolve(concrete)
        data = engine.read(result.artifact)
        if result.status == "compiled":
            self.tier.stored(len(data))  # the engine stored it in the tier: keep the cap
        origin: ArtifactOrigin = "local_compile"
        if result.status == "hit":
            origin = "node"  # the engine found it in the tier (through a manifest)
        elif result.status == "waited":
            origin = "waited"  # another process of the node compiled it meanwhile
        return origin, result.artifact, data
