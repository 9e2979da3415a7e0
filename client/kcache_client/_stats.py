"""Counters of where a ``KernelCache``'s answers came from, for diagnostics and the CLI."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

__all__ = ["CacheStats"]


@dataclass
class CacheStats:
    """How many ``get()`` answers came from memory, the node tier, the server, a local compile.

    ``digest_mismatches`` counts downloads refused because their bytes did not hash to
    their digest (each was fetched again).
    """

    memory_hits: int = 0
    node_hits: int = 0
    server_fetches: int = 0
    local_compiles: int = 0
    digest_mismatches: int = 0
    #: Lookups a frozen cache missed its tiers for (``KernelCache.freeze``): warned or refused.
    late_lookups: int = 0
    #: ``POST /v1/bundle`` requests a prefetch sent, and the entries they published.
    bundle_requests: int = 0
    bundle_entries: int = 0
    #: Bundles this process forwarded over the job's process group, received from a peer
    #: and kept, and fan-outs it took part in that failed (its node then asked the server
    #: itself): kcache_client._fanout.
    fanout_sent: int = 0
    fanout_received: int = 0
    fanout_failures: int = 0
    #: ``GET /v1/withdrawals`` requests sent (kcache_client._withdrawals).
    withdrawal_requests: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, name: str, n: int = 1) -> None:
        """Thread-safe increment."""
        with self._lock:
            setattr(self, name, getattr(self, name) + n)
