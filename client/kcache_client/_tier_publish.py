"""Publishing into a node tier: the per-key download lock, the entry, its records later.

The per-key lock (in-process single-flight around a record file lock per key,
:class:`~kcache.locks.FileKeyLock`) only makes the node download a blob once instead of
once per rank, and its holder lets go as soon as the entry's alias is written. It guards
no correctness: on a shared filesystem where locks are advisory or granted to everyone,
the worst is a duplicate download.

Nothing is fsynced (``durable=False``), and crash consistency holds without it: what a
reader trusts is checked on every read that could see a new file
(:mod:`kcache_client._tier`), so a write that a crash or power loss cut short (a file
empty, truncated, zeros, another file's old blocks) reads as absent: the kernel is fetched
again and its publish replaces the file (``tests/client/test_tier_crash.py``). An fsync per
file and directory was most of a cold rank's fetch time (B8); it would only make the
refetch rarer.

A tier holds one :class:`TierPublisher`, made when it is first asked for the lock or to
publish: a process that only reads never imports this module.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypeVar

from kcache.artifact import ArtifactMeta
from kcache.errors import CorruptArtifactError
from kcache.index.file import FileIndex
from kcache.locks import SingleFlight
from kcache.signing import Signature
from kcache.standing import Standing
from kcache.store.local import LocalArtifactStore
from kcache_client._disk_full import full_error, tolerate_full, warn_full
from kcache_client._withdrawals import Withdrawals

if TYPE_CHECKING:
    from kcache_client._tier_size import TierSize

_log = logging.getLogger("kcache_client")

__all__ = ["PublishingTier", "TierPublisher"]

T = TypeVar("T")

# Publishes whose record and manifest entry wait for a moment the process is idle, at most.
_PENDING_MAX = 32
#: How long after a thread's get found a key another process or thread fetched that get's
#: thread lets the fetcher claim the next key first (:meth:`TierPublisher.hold_unless`): a
#: fetch or two.
_FOLLOWING_S = 0.05


class PublishingTier(Protocol):
    """What :class:`TierPublisher` uses of its node tier (a :class:`~kcache_client._tier.NodeTier`)."""

    @property
    def root(self) -> Path: ...

    @property
    def store(self) -> LocalArtifactStore: ...

    @property
    def index(self) -> FileIndex: ...

    @property
    def lock(self) -> SingleFlight: ...

    @property
    def lock_timeout(self) -> float: ...

    @property
    def standing(self) -> Standing: ...

    @property
    def withdrawals(self) -> Withdrawals: ...

    @property
    def size(self) -> TierSize: ...

    def refuse(self, what: str, problem: str) -> None: ...


class TierPublisher:
    """The per-key lock and the publishes of one tier, and what they leave to do (module docstring)."""

    def __init__(self, tier: PublishingTier) -> None:
        self._tier = tier
        # (base key, metadata, size) of publishes whose record is not written yet (flush).
        self._pending: list[tuple[str | None, ArtifactMeta, int]] = []
        self._pending_lock = threading.Lock()
        # Per thread (a rank's gets come one after another on its thread): when its get last
        # found a key that another process or thread fetched (monotonic), as ``at``.
        self._following = threading.local()

    @contextlib.contextmanager
    def hold(self, recipe_key: str) -> Iterator[bool]:
        """The per-key download lock; yields True when another process or thread had it first."""
        with self._tier.lock.hold(recipe_key, self._tier.lock_timeout) as waited:
            yield waited

    def _write(
        self, recipe_key: str, meta: ArtifactMeta, data: bytes, signature: Signature | None
    ) -> None:
        """The blob, then the alias (what a hit reads)."""
        tier = self._tier
        digest = tier.store.put(data)
        if digest != meta.digest:  # the caller verified; this is a second line of defence
            raise CorruptArtifactError(meta.digest, digest, None)
        tier.index.write_alias(
            recipe_key, meta, signature.to_dict() if signature is not None else None
        )

    def _clear_directory(self, path: object) -> bool:
        """Remove a directory found where one of this tier's files goes (damage, a stray
        ``mkdir``), when the tier is this user's own; whether it was removed. In a shared
        tier it is another user's, and left alone (the kernel is then used from memory)."""
        tier = self._tier
        if tier.standing.kind != "private" or not isinstance(path, str | os.PathLike):
            return False
        target = os.fspath(path)
        if not target.startswith(f"{tier.root}{os.sep}") or not os.path.isdir(target):
            return False
        shutil.rmtree(target, ignore_errors=True)
        _log.warning("kcache: removed the directory %s, which stood where a file goes", target)
        return not os.path.lexists(target)

    @contextlib.contextmanager
    def hold_unless(
        self, recipe_key: str, published: Callable[[], T | None], *, follows: bool = False
    ) -> Iterator[T | None]:
        """The per-key download lock, unless another process publishes the key meanwhile.

        Yields None with the lock held, or what ``published()`` (a look in this tier)
        found while waiting, without ever taking the lock: reading the tier needs no
        lock (entries appear by atomic rename, blobs are verified), and ranks that
        each took the lock in turn only to read the entry made a convoy (B8).

        ``follows``: the key is one of a list that other processes of the node likely
        ask for in the same order (a get's). A thread that has just found such a key
        published by another process or thread (within :data:`_FOLLOWING_S`) lets it
        claim the next key first: it looks after one nap before it tries the lock
        (``defer``). Without it, a waiter that woke while the fetching rank was between
        two kernels took the next one's lock, so the fetches moved from rank to rank,
        each paying its first fetch's costs while the last fetcher napped (B8: eight
        ranks on two cores, 100-136 ms a round against 60-75 with one fetcher).
        """
        followed_at: float | None = getattr(self._following, "at", None)
        defer = (
            follows and followed_at is not None and time.monotonic() - followed_at < _FOLLOWING_S
        )
        # While this process waits for another's fetch, its own pending bookkeeping,
        # which nothing waits for, takes the waiting time (no more of it: the wait ends
        # when the entry is there, not when the bookkeeping is done).
        with self._tier.lock.hold_unless(
            recipe_key, self._tier.lock_timeout, published, self.flush, defer=defer
        ) as found:
            if follows:
                self._following.at = time.monotonic() if found is not None else None
            yield found

    def publish(
        self,
        recipe_key: str,
        base_key: str | None,
        meta: ArtifactMeta,
        data: bytes,
        signature: Signature | None = None,
    ) -> Path | None:
        """Store verified bytes and the recipe's alias (the blob first, as everywhere); the rest later.

        The alias is what a hit reads, and this thread's lock of the key is let go as
        soon as it is written: processes waiting for the key take the entry from there.
        The artifact record, the manifest entry and the size accounting (which may
        evict) wait in this process (:meth:`flush`) until it is idle anyway, waiting for
        another process's fetch (:meth:`hold_unless`), or until 32 publishes are pending,
        or until anything reads them here (listing, evicting, closing the cache). A
        rank fetching kernels one after another thus goes on to its next kernel at once
        (B8: eight ranks fetching the same kernels in turn). A record lost when a
        process ends without closing costs what a crash's would (module docstring).
        A thread of its own for that work cost a lone rank half as much time again (the
        GIL).

        ``signature`` (the server's, checked by the caller) is stored with the alias.
        Nothing is published (None) into a tier that is not writable here, nor an
        unsigned entry into one where only signed entries are used, nor where another
        user's file stands in the way in a shared tier.

        ``base_key`` None (an entry of a bundle, whose base key no signature covers): the
        entry is found by its recipe key only, and not offered to a local engine's
        manifest match under a base key it could not check.
        """
        tier = self._tier
        if (
            not tier.standing.writable
            or (signature is None and tier.standing.signed_only)
            or tier.withdrawals.withdrawn(recipe_key, meta.digest)
        ):
            tier.lock.let_go(recipe_key)
            return None
        try:
            try:
                self._write(recipe_key, meta, data, signature)
            except IsADirectoryError as exc:  # a directory where the blob or alias goes
                if not self._clear_directory(exc.filename2):
                    raise
                self._write(recipe_key, meta, data, signature)  # once more, in its place
        except OSError as exc:  # the kernel is used from memory, never a failed get
            # A full disk; another user's file at this name in a shared tier (a stale or
            # planted one); a directory there that is not this user's to remove; ...
            tier.lock.let_go(recipe_key)
            full = full_error(tier.root, exc, "keeping a kernel")
            if full is not None:
                warn_full(full)  # once per process (kcache_client._disk_full)
            else:
                tier.refuse(f"the entry of recipe {recipe_key}", f"cannot be published: {exc}")
            return None
        tier.lock.let_go(recipe_key)
        with self._pending_lock:
            self._pending.append((base_key, meta, len(data)))
            due = len(self._pending) >= _PENDING_MAX
        if due:
            self.flush()
        return tier.store.path(meta.digest)

    def flush(self, until: float | None = None) -> None:
        """Write the records and manifest entries of this process's pending publishes; may
        evict. ``until``: a monotonic time to stop at, the rest left pending (at least one
        is written)."""
        if not self._pending:
            return
        with self._pending_lock:
            pending, self._pending = self._pending, []
        for done, (base_key, meta, size) in enumerate(pending):
            if done and until is not None and time.monotonic() >= until:
                with self._pending_lock:
                    self._pending[:0] = pending[done:]
                return
            with tolerate_full(self._tier.root, "recording a kernel"):
                self._tier.size.record(base_key, meta, size)
