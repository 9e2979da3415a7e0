"""When a ``KernelCache`` reads its server's withdrawals, and what the node tier drops then.

The rules are :mod:`kcache_client._withdrawals`'s docstring ("When", "Acting"); the feed's
wire form is :mod:`kcache_client._withdrawal_feed`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence

from kcache.artifact import ArtifactMeta
from kcache.errors import KCacheError, LockTimeoutError
from kcache.fsutil import UnsafeFileError, read_file_identified
from kcache.index.file import MAX_ENTRY_BYTES
from kcache.keys import sha256_hex
from kcache_client._foreign_groups import content_digest, read_group
from kcache_client._http import OFFLINE_CAUSE
from kcache_client._remote import Remote
from kcache_client._settings import RetryPolicy
from kcache_client._stats import CacheStats
from kcache_client._tier import NodeTier
from kcache_client._withdrawal_feed import PAGE, Withdrawn
from kcache_client._withdrawals import MAX_PAGES, SHARED_S, Pair
from kcache_client.errors import ClientError, RemoteNotFoundError, ServerUnavailableError

__all__ = ["WithdrawalWatch", "drop_from_tier"]

_log = logging.getLogger("kcache_client")


def drop_from_tier(tier: NodeTier, pairs: Iterable[Pair]) -> int:
    """Remove the aliases of ``tier`` that name a withdrawn pair (and each artifact record no
    alias names any more); how many aliases. Nothing in a tier this process may not write.
    A foreign group's alias names its blob; the pair names the group's content digest."""
    if not tier.standing.writable or tier.read_only:
        return 0
    gone: set[str] = set()
    for key, digest in pairs:
        path = tier.index.alias_path(key)
        try:
            raw, seen = read_file_identified(path, MAX_ENTRY_BYTES)
            entry, _ = tier.index.parse_signed_alias(key, raw)
            if not isinstance(entry, ArtifactMeta) or not _names(tier, key, entry, digest):
                continue
            if os.lstat(path).st_ino != seen[1]:  # replaced meanwhile (a fresh publish)
                continue
            os.unlink(path)
        except (OSError, UnsafeFileError, KCacheError):
            continue
        gone.add(entry.digest)
    if gone:
        named = tier.size.aliases()  # the tier's own walk of its aliases
        for digest in gone - named.keys():
            with contextlib.suppress(OSError):
                os.unlink(tier.record_path(digest))
    return len(gone)


def _names(tier: NodeTier, key: str, entry: ArtifactMeta, digest: str) -> bool:
    """Whether the alias of ``key`` (``entry``) is the withdrawn pair's ``digest``."""
    if entry.kind != "foreign":
        return entry.digest == digest
    group = read_group(tier, key)
    return group is not None and content_digest(group) == digest


class WithdrawalWatch:
    """When a ``KernelCache`` reads its server's withdrawals, and what it does with them.

    ``forget`` drops a learnt pair from the cache's memory. ``retry`` is the policy of
    each feed request (short: a first lookup must not wait long for a server that does
    not answer; the lookup that follows has its own).
    """

    def __init__(
        self,
        remote: Remote,
        tier: NodeTier,
        interval_s: float,
        stats: CacheStats,
        forget: Callable[[Sequence[Pair]], None],
        retry: RetryPolicy | None = None,
    ) -> None:
        self.remote = remote
        self.tier = tier
        self.known = tier.withdrawals
        self.interval_s = interval_s
        self._stats = stats
        self._forget = forget
        self._retry = retry
        self._made = time.monotonic()
        self._checked: float | None = None  # monotonic, this process's last check
        self._expired = False  # a job start: check before the next local answer whatever
        self._lock = threading.Lock()
        self._told = False

    def tier_holds(self, recipe_key: str, digest: str) -> bool:
        """Whether a tier's answer of ``recipe_key`` -> ``digest`` may be given
        (:meth:`before_tier_answer` first)."""
        self.before_tier_answer()
        return not self.known.withdrawn(recipe_key, digest)

    def memory_holds(self, recipe_key: str, digest: str) -> bool:
        """Whether a memory answer of ``recipe_key`` -> ``digest`` may be given
        (:meth:`before_memory_answer` first)."""
        self.before_memory_answer()
        return not self.known.withdrawn(recipe_key, digest)

    def before_tier_answer(self) -> None:
        """Read the feed if a tier's answer is due one: this process never read it, or did
        ``interval_s`` ago (then ask :attr:`known` about the answer)."""
        last = self._checked
        if last is None or self._expired or time.monotonic() - last >= self.interval_s:
            self.check(force=self._expired)

    def before_memory_answer(self) -> None:
        """Read the feed if a memory answer is due one: ``interval_s`` passed since the last
        check (or since the cache was made)."""
        last = self._checked if self._checked is not None else self._made
        if self._expired or time.monotonic() - last >= self.interval_s:
            self.check(force=self._expired)

    def expire(self, expired: bool = True) -> None:
        """Read the feed before the next answer from a tier or memory, however recent the last
        check (``expired``: a warmup, whose answers all came from the server needs none, and
        clears it at its end)."""
        self._expired = expired

    def answered(self, through: int) -> None:
        """A fetch answer was right as of the server's withdrawal ``through``: where the node
        knows the feed that far, that is a read of it that found nothing new, noted as a
        check (and in the tier's file, for the node's other processes, as a read is);
        otherwise nothing, and the next check reads the feed. Once a second at most."""
        checked = self._checked
        if checked is not None and time.monotonic() - checked < SHARED_S / 2:
            return  # noted a moment ago: not a file write per fetch
        if not self._lock.acquire(blocking=False):
            return  # another thread is checking: it reads the feed itself, no fetch waits for it
        try:
            self.known.load()
            last, _ = self.known.last(self.remote.url)
            if through > last:
                return
            self.known.learn(self.remote.url, [], last)
            self._checked = time.monotonic()
            self._expired = False
        finally:
            self._lock.release()

    def check(self, *, force: bool = False) -> None:
        """Learn the withdrawals after the last one known; act on the new ones. Never raises
        for the server's sake (module docstring). ``force``: even when this process checked
        within ``interval_s`` (a warmup, a prefetch), though not within :data:`SHARED_S`."""
        with self._lock:
            if self._checked is not None:
                since = time.monotonic() - self._checked
                if since < SHARED_S or (not force and since < self.interval_s):
                    self._expired = False
                    return  # this process (another thread) checked just now
            self.known.load()
            if not self._shared_recently():
                self._ask_once_per_node()
            self._checked = time.monotonic()
            self._expired = False

    def _ask_once_per_node(self) -> None:
        """:meth:`_ask`, under the node's lock for this server where the tier is written
        here: processes that check at once wait for the first one's answer (the file)."""
        tier = self.tier
        if not tier.standing.writable or tier.read_only:
            self._ask()
            return
        lock_key = sha256_hex(f"kcache withdrawals\0{self.remote.url}")
        try:
            with tier.hold_unless(lock_key, self._published) as found:
                if found is None:
                    self.known.load()
                    if not self._shared_recently():
                        self._ask()
        except LockTimeoutError as exc:
            _log.debug("kcache: withdrawals read without the node's lock: %s", exc)
            self._ask()

    def _published(self) -> bool | None:
        self.known.load()
        return True if self._shared_recently() else None

    def _shared_recently(self) -> bool:
        """Whether another process of the node read the feed less than SHARED_S ago."""
        at = self.known.shared_at(self.remote.url)
        return at is not None and 0.0 <= time.time() - at < SHARED_S

    def _ask(self) -> None:
        """Read the feed from the last id known; learn what it says, act on what is new."""
        url = self.remote.url
        after, _ = self.known.last(url)
        rows: list[Withdrawn] = []
        last = after
        try:
            for _ in range(MAX_PAGES):
                self._stats.add("withdrawal_requests")
                page = self.remote.withdrawals(after=last, limit=PAGE, retry=self._retry)
                rows.extend(page.rows)
                last = page.last_id
                if len(page.rows) < PAGE:
                    break
        except RemoteNotFoundError:
            pass  # a server from before withdrawals: it has none to tell
        except ClientError as exc:  # unreachable, refused, an answer that cannot be read
            if not self._told:
                self._told = True
                # A server out of reach is a warning (the process runs on what its tier
                # holds, which it should not do without a word); one told to send nothing
                # (KCACHE_OFFLINE) is as configured.
                unreachable = isinstance(exc, ServerUnavailableError) and exc.cause != OFFLINE_CAUSE
                _log.log(
                    logging.WARNING if unreachable else logging.INFO,
                    "kcache: the withdrawals of %s could not be read (%s); going on with the "
                    "%d known, and answering from the node tier where it holds the kernel "
                    "(logged once per process)",
                    url,
                    exc,
                    len(self.known),
                )
        # Noted even when nothing could be read: the node's other processes waiting for this
        # check go on with what is known too, rather than each waiting for the server in turn.
        new = self.known.learn(url, rows, last)
        if new:
            drop_from_tier(self.tier, new)
            self._forget(new)
            _log.info(
                "kcache: %d withdrawn kernel binding(s) learnt from %s; not used from now on",
                len(new),
                url,
            )
