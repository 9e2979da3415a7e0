"""Compiles an adapter hands to its library, uncached: the decision, the warning and the audit.

Drop-in means drop-in: what kcache cannot key safely (``backend="nvcc"``, jitify, PTX
input to cuda.core, a PCH option, ...) is compiled by CuPy or cuda.core exactly as
without kcache. Each such compile is a :class:`Bypass` with a short ``reason`` (the
code the audit records, at most 64 characters) and a sentence saying why. The first
bypass of each reason in a process warns (:class:`BypassWarning`); every one is
reported to the server as an event with outcome ``bypass`` and tier ``library``, so
the dashboard shows how much of a job's JIT goes around the cache, and why.
``KCACHE_BYPASS=error`` (``ClientSettings.bypass``) raises
:class:`~kcache_client.errors.BypassRefusedError` instead, for those who want to know.
"""

from __future__ import annotations

import threading
import time
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kcache_client.errors import BypassRefusedError

if TYPE_CHECKING:
    from kcache_client._cache import KernelCache

__all__ = ["REASON_MAX", "Bypass", "BypassWarning", "check", "record"]

#: The longest reason the audit stores (the events table's ``error`` column).
REASON_MAX = 64

_warned: set[tuple[str, str]] = set()
_warned_lock = threading.Lock()


class BypassWarning(UserWarning):
    """A CuPy or cuda.core compile went to the library itself, uncached (once per reason)."""


@dataclass(frozen=True)
class Bypass:
    """Why one compile is the library's: ``library``, a short ``reason`` and a ``detail`` sentence."""

    library: str  # "cupy" or "cuda.core"
    reason: str  # "backend=nvcc", "option=--time", "code_type=ptx", ...
    detail: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "reason", self.reason[:REASON_MAX])


def check(bypass: Bypass, cache: KernelCache) -> None:
    """Refuse ``bypass`` (``KCACHE_BYPASS=error``), else warn the first time its reason is seen.

    Called where the compile is declared (``RawModule(...)``, ``Program(...)``), so a
    refusal is raised at the line that asked for it, as a refused option is.
    """
    if cache.settings.bypass == "error":
        raise BypassRefusedError(bypass.library, bypass.reason, bypass.detail)
    key = (bypass.library, bypass.reason)
    with _warned_lock:
        if key in _warned:
            return
        _warned.add(key)
    warnings.warn(
        f"kcache: {bypass.library} compiles this itself, uncached ({bypass.reason}): "
        f"{bypass.detail}. Set KCACHE_BYPASS=error to make this an error.",
        BypassWarning,
        stacklevel=3,
    )


def record(
    bypass: Bypass,
    cache: KernelCache,
    *,
    kernel: str | None = None,
    target: str | None = None,
    started: float | None = None,
) -> None:
    """Report one bypassed compile (its latency since ``started``, a ``perf_counter``) as an event."""
    events = cache.events
    if events is None:
        return
    latency_ms = 0.0 if started is None else (time.perf_counter() - started) * 1000.0
    event: dict[str, object] = {
        "time": time.time(),
        "outcome": "bypass",
        "tier": "library",
        "reason": bypass.reason,
        "toolchain": bypass.library,
        **cache.context(),
        "latency_ms": latency_ms,
    }
    if kernel:
        event["kernel"] = kernel[:1024]
    if target:
        event["target"] = target[:32]
    events.record(event)
