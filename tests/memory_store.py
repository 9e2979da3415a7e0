"""A blob backend that the tests add: objects in this process's memory, named ``mem://NAME``.

It stands for the next real backend (a GCS or Azure bucket): it implements the
:class:`~kcache.store.base.ArtifactStore` seam and nothing else, lives outside the
server, and is plugged in with one line, ``STORE_URL_SCHEMES["mem"] = MEMORY_BACKEND``
(:mod:`kcache.store.urls`). The store contract runs on it (tests/core/test_store.py)
and a server evicts through it (tests/server/test_eviction.py).

Like a bucket it keeps no local files (:meth:`path` refuses, :meth:`local_file` is
None) and cannot rename, so it collects as a bucket does: the index asked first, then
the object's age, then the delete. Stores of one name share their objects (two
replicas in one test process see one bucket).
"""

from __future__ import annotations

import hashlib
import re
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from kcache.errors import ArtifactNotFoundError, CorruptArtifactError, StoreUnavailableError
from kcache.keys import require_hex_key
from kcache.store.base import COLLECT_BATCH, ArtifactStore, BlobInfo, Collected, Leftovers, NamedNow
from kcache.store.urls import UrlBackend

__all__ = ["MEMORY_BACKEND", "MemoryArtifactStore", "parse_memory_url"]

_NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")


def parse_memory_url(url: str) -> str:
    """The name in ``mem://NAME``; a ValueError saying what is wrong."""
    name = url.removeprefix("mem://")
    if not url.startswith("mem://") or not _NAME.fullmatch(name):
        raise ValueError(f"store URL {url[:80]!r} is not mem://NAME (lowercase letters, digits, -)")
    return name


class _Objects:
    """One named bucket's objects: digest -> (bytes, when written)."""

    def __init__(self) -> None:
        self.blobs: dict[str, tuple[bytes, float]] = {}
        self.quarantine: dict[str, bytes] = {}
        self.lock = threading.Lock()
        #: Set by a test: every request fails as an unreachable store's would.
        self.down = False


_BUCKETS: dict[str, _Objects] = {}
_BUCKETS_LOCK = threading.Lock()


class MemoryArtifactStore:
    """An :class:`~kcache.store.base.ArtifactStore` in this process's memory."""

    remote: ArtifactStore | None = None

    def __init__(self, name: str) -> None:
        self.url = f"mem://{name}"
        with _BUCKETS_LOCK:
            self._objects = _BUCKETS.setdefault(name, _Objects())

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        timeout_s: float,
        connect_timeout_s: float,
        retries: int,
        probe_timeout_s: float | None = None,
    ) -> MemoryArtifactStore:
        """The store ``mem://NAME`` (memory answers at once: the bounds have nothing to bound)."""
        return cls(parse_memory_url(url))

    @property
    def objects(self) -> dict[str, tuple[bytes, float]]:
        """The objects themselves, for a test to look at (or write behind the store's back)."""
        return self._objects.blobs

    def set_down(self, down: bool) -> None:
        """Make every request fail (True) as an unreachable store's would, or work again."""
        self._objects.down = down

    def _reach(self, action: str) -> _Objects:
        if self._objects.down:
            raise StoreUnavailableError(self.url, f"could not {action} its blobs")
        return self._objects

    # ------------------------------------------------------------------ the contract
    def put(self, data: bytes) -> str:
        """Store ``data`` under its sha256 once; storing it again renews its age only."""
        digest = hashlib.sha256(data).hexdigest()
        objects = self._reach("store")
        with objects.lock:
            held = objects.blobs.get(digest)
            objects.blobs[digest] = (held[0] if held else bytes(data), time.time())
        return digest

    def get(self, digest: str) -> bytes:
        """The bytes, verified; a mismatching object is moved to quarantine."""
        require_hex_key(digest, "digest")
        objects = self._reach("read")
        with objects.lock:
            held = objects.blobs.get(digest)
            if held is None:
                raise ArtifactNotFoundError(f"no blob {digest} in {self.url}")
            actual = hashlib.sha256(held[0]).hexdigest()
            if actual != digest:
                del objects.blobs[digest]
                where = f"{digest}.{time.time_ns()}"
                objects.quarantine[where] = held[0]
                raise CorruptArtifactError(digest, actual, f"{self.url}/quarantine/{where}")
        return held[0]

    def has(self, digest: str) -> bool:
        """True when an object named ``digest`` is held."""
        require_hex_key(digest, "digest")
        return digest in self._reach("look up").blobs

    def path(self, digest: str) -> Path:
        """Refused: memory has no path (a CachedArtifactStore in front has one)."""
        require_hex_key(digest, "digest")
        raise TypeError(f"blob {digest} lives in {self.url}, which has no local path")

    def local_file(self, digest: str) -> str | None:
        """None: no file on this machine."""
        require_hex_key(digest, "digest")
        return None

    def delete(self, digest: str) -> bool:
        """Remove the object; True if it was there."""
        require_hex_key(digest, "digest")
        objects = self._reach("delete")
        with objects.lock:
            return objects.blobs.pop(digest, None) is not None

    def digests(self) -> Iterator[str]:
        """Every object's digest (a snapshot)."""
        objects = self._reach("list")
        with objects.lock:
            names = list(objects.blobs)
        yield from names

    def blob_info(self, digest: str) -> BlobInfo | None:
        """Size and time written, None when absent."""
        require_hex_key(digest, "digest")
        objects = self._reach("look up")
        with objects.lock:
            held = objects.blobs.get(digest)
        return BlobInfo(len(held[0]), held[1]) if held else None

    def collect_many(
        self,
        digests: Sequence[str],
        older_than: float,
        named: NamedNow,
        *,
        dry_run: bool = False,
    ) -> Collected:
        """As a bucket collects: ``named`` once per batch, then each object's age, then the delete."""
        done = Collected()
        for start in range(0, len(digests), COLLECT_BATCH):
            batch = [require_hex_key(d, "digest") for d in digests[start : start + COLLECT_BATCH]]
            still = named(batch)
            objects = self._reach("delete")
            with objects.lock:
                for digest in batch:
                    held = objects.blobs.get(digest)
                    if digest in still or held is None:
                        continue
                    if held[1] >= older_than:
                        done.young[digest] = held[1]
                        continue
                    if not dry_run:
                        del objects.blobs[digest]
                    done.freed[digest] = len(held[0])
        return done

    def sweep_leftovers(self, older_than: float, *, dry_run: bool = False) -> Leftovers:
        """Nothing: a put leaves nothing behind."""
        return Leftovers()

    def probe(self) -> None:
        """Raise StoreUnavailableError while the test has set the store down."""
        self._reach("reach")


#: The one line a server needs: ``STORE_URL_SCHEMES["mem"] = MEMORY_BACKEND``.
MEMORY_BACKEND = UrlBackend(parse_memory_url, MemoryArtifactStore.from_url)
