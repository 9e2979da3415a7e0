"""No JIT after the barrier: what a frozen ``KernelCache`` does with a kernel its tiers lack.

After a warmup a job's kernels are all on the node (its tiers); a lookup that misses
them is a kernel the warmup did not cover, and in a synchronous training step it is a
stall on every rank that waits for this one. ``KernelCache.freeze(mode)`` (or
``warmup(..., then="freeze")``) says what such a *late* lookup does:

- ``warn``: it goes on (fetched, or compiled, as before), with one warning per recipe
  key per process and an audit event of its own, outcome ``late`` (the fetch or compile
  that follows is recorded by the server as well);
- ``error``: it is refused before any request, with :class:`LateCompileError` naming
  the recipe, and the same ``late`` event (its only record);
- ``allow``: nothing (a thawed cache).

``KCACHE_AFTER_WARMUP=warn|error|allow`` is the operator's word: it decides the mode of
``then="freeze"`` (default ``warn``), and with ``warn`` or ``error`` freezes after
every warmup even when the code asks for nothing; ``allow`` keeps every warmup from
freezing, an escape hatch for a job that a too-strict freeze stops. An explicit
``freeze(mode)`` is taken as given. ``/v1/stats?group_by=job`` counts ``late`` per job.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Literal

from kcache.errors import KCacheError
from kcache.lru import LruCache
from kcache.nvrtc import kernel_name
from kcache.recipe import Recipe
from kcache_client._events import EventSink
from kcache_client._stats import CacheStats
from kcache_client.errors import LateCompileError

__all__ = ["FREEZE_MODES", "FreezeMode", "Freezer", "after_warmup_mode", "parse_mode"]

FreezeMode = Literal["warn", "error", "allow"]
FREEZE_MODES: tuple[FreezeMode, ...] = ("warn", "error", "allow")
#: What ``warmup(then=...)`` accepts: a mode, or ``freeze`` (the configured mode, else warn).
_THEN = ("freeze", *FREEZE_MODES)

_log = logging.getLogger("kcache_client")
#: Recipe keys warned about per process (one line each, then silence).
_WARNED_MAX = 10_000


def parse_mode(value: object, field: str = "mode") -> FreezeMode:
    """``value`` as a :data:`FreezeMode`, else KCacheError naming ``field`` and the choices."""
    for mode in FREEZE_MODES:
        if value == mode:
            return mode
    raise KCacheError(f"{field} must be one of {', '.join(FREEZE_MODES)}, not {value!r}")


def after_warmup_mode(then: str | None, configured: str | None) -> FreezeMode | None:
    """The mode a warmup leaves the cache in (None: unchanged); see the module docstring."""
    if then is not None and then not in _THEN:
        raise KCacheError(f"then must be one of {', '.join(_THEN)} or None, not {then!r}")
    setting = parse_mode(configured, "KCACHE_AFTER_WARMUP") if configured else None
    if setting is not None:
        return setting if then is not None or setting != "allow" else None
    if then == "freeze":
        return "warn"
    return parse_mode(then) if then is not None else None


class Freezer:
    """A cache's freeze mode and its late lookups (thread-safe)."""

    def __init__(self, stats: CacheStats, events: EventSink | None, context: Any) -> None:
        self.mode: FreezeMode = "allow"
        self._stats = stats
        self._events = events
        self._context = context  # a callable: the cache's audit context
        self._warned: LruCache[str, bool] = LruCache(max_entries=_WARNED_MAX)
        self._lock = threading.Lock()

    def set(self, mode: FreezeMode) -> None:
        """Freeze in ``mode`` (``allow`` thaws)."""
        with self._lock:
            self.mode = mode

    def late(self, recipe_key: str, concrete: Recipe) -> LateCompileError | None:
        """A lookup that missed every tier: None to go on (``allow``, ``warn``), else the error.

        Reported (an event, a warning once per key) unless the cache is thawed.
        """
        mode = self.mode
        if mode == "allow":
            return None
        self._stats.add("late_lookups")
        kernel = kernel_name(concrete)[:1024]
        self._report(recipe_key, concrete, kernel)
        if mode == "error":
            return LateCompileError(recipe_key, kernel, concrete.target)
        with self._lock:
            told = self._warned.get(recipe_key) is not None
            if not told:
                self._warned.put(recipe_key, True)
        if not told:
            _log.warning(
                "kcache: late lookup after the warmup: kernel %s for %s (recipe %s) is not in "
                "this node's tiers; it is fetched or compiled now (the cache is frozen with "
                "'warn'). Add it to the warmup or its manifest.",
                kernel or "(unnamed)",
                concrete.target,
                recipe_key,
            )
        return None

    def _report(self, recipe_key: str, concrete: Recipe, kernel: str) -> None:
        if self._events is None:
            return
        self._events.record(
            {
                "time": time.time(),
                "outcome": "late",
                "tier": "node",
                "recipe_key": recipe_key,
                "base_key": concrete.base_key(),
                "kernel": kernel,
                "target": concrete.target,
                "toolchain": concrete.toolchain,
                **self._context(),
                "latency_ms": 0.0,
            }
        )
