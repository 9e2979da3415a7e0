"""The foreign groups a process's library hooks used, for its own manifest (``KernelCache.manifest``).

Every :class:`~kcache_client._foreign.ForeignCache` of a ``KernelCache`` notes in the
cache's ledger (``KernelCache.foreign_ledger``, made when a hook first asks) each name it
answered (from memory, the node tier or the server) or was handed after the library's
compile, with its files' digests and sizes (computed once per name), and
``KernelCache.manifest()`` lists what the ledger holds. A group handed over and not yet
published is named too: the job used it, its publish follows (docs/design.md section 10).
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Mapping

from kcache.foreign import ForeignFileRef, ForeignName
from kcache.job_manifest import ManifestForeign

__all__ = ["ForeignLedger"]


class ForeignLedger:
    """The groups one cache's hooks used, by binding key (the last files seen for a name win)."""

    def __init__(self) -> None:
        self._used: dict[str, ManifestForeign] = {}
        self._lock = threading.Lock()

    def note(
        self,
        name: ForeignName,
        files: Mapping[str, bytes],
        key: str | None = None,
    ) -> None:
        """Note that the group ``files`` served ``name`` (``key``: its binding key, if known)."""
        known = self._used.get(key) if key is not None else None
        if known is not None and len(known.files) == len(files):
            return  # a name's digests are computed once; a memory hit costs a dict lookup
        refs = [ForeignFileRef(n, hashlib.sha256(d).hexdigest(), len(d)) for n, d in files.items()]
        entry = ManifestForeign.of(name, refs)
        with self._lock:
            self._used[entry.binding_key] = entry

    def entries(self) -> list[ManifestForeign]:
        """The groups noted, by binding key."""
        with self._lock:
            return [self._used[k] for k in sorted(self._used)]
