"""Withdrawn bindings as a client knows them: learnt from the server's feed, kept in the node
tier, refused by every lookup.

A binding is a recipe key's answer, key -> digest. When the server's verification finds
one wrong (a fresh compile of the recipe is other bytes), it withdraws it: a row of its
``withdrawals`` table, published as ``GET /v1/withdrawals?after=ID`` (read scope; rows in
id order, ``last_id`` the largest returned). A client that was served the binding before
keeps it in memory, in its node tier (an alias, or an entry of a prefetch's pack), in
read-only layers, and keeps the server's signature of it, which stays valid: a signature
says who vouched, not that the binding still holds. So the client learns withdrawals
from the feed (:meth:`~kcache_client._remote.Remote.withdrawals`) and refuses every
withdrawn (recipe key, digest) pair wherever it finds one; the lookup then goes to the
server, which answers the fresh binding.

**Why a feed, not expiring signatures** (docs/design.md, "What a binding rests on"): what
changes is whether a binding is still right, which only the server learns. Signatures
that expire would make every node tier revalidate every entry it holds (a request per
kernel per interval, or per job start); the feed is one small request per job start,
usually answered with nothing, and costs nothing per entry.

**When.** A ``KernelCache`` with a server asks (:class:`WithdrawalWatch`):

- before the first answer a tier would give in a process (node tier, pack, layer): an
  answer the server gives needs no feed, it is the server's own word now (so a cold tier
  costs no request);
- at every warmup (a job start), before its first answer from a tier or memory, however
  recent the last check; and at every prefetch of a manifest the tiers hold some of
  (what they hold of it may have been withdrawn);
- again before a tier or memory answer once ``withdrawal_check_s``
  (``KCACHE_WITHDRAWAL_CHECK_S``, 60 s) has passed since the last check (for memory,
  since the cache was made if it never checked: what memory holds came from the server
  then, or from a tier after a check).

A check another process of the node made less than :data:`SHARED_S` ago (written in the
tier's file) counts as this process's own, and processes that check at once take the
tier's lock for it, so a node's ranks starting together send one request, not one each.
A server that does not answer, or answers what cannot be read, leaves the cache with what
it knew (no exception: the next check is due after the interval); one that answers 404
for the route predates withdrawals and has none to tell.

**Kept** in ``<tier>/index/withdrawals.json``: the pairs (the newest :data:`MAX_PAIRS`),
and per server URL the last id read and when (the newest :data:`MAX_SERVERS`), written
atomically, read with the tier's rules (``O_NOFOLLOW``, a regular file, at most
:data:`MAX_FILE_BYTES`; anything else reads as empty). The pairs stored in a tier others
can write are used as they are: the feed is not signed either, and all a pair can do is
make a lookup refuse an entry and ask the server, which whoever can write the tier can
already cause by deleting files. The last ids are another matter (one raised by someone
else would make this client skip withdrawals), so they are read from the file only in a
private tier; elsewhere a process reads the feed from its start at its first check.

**Acting** on a pair learnt: the node tier's alias naming it is removed (and the
artifact's record, when no other alias names the digest: other recipes whose bytes are
the same keep their binding), the process's memory forgets it; a pack entry cannot be
removed in place (the pack would be written again), so it is refused at every lookup, as
are a layer's entries, a bundle's entries being unpacked (:meth:`NodeTier.publish`
refuses the pair) and a signed answer replayed into a shared tier by someone else.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, TypeGuard

from kcache.artifact import ArtifactMeta
from kcache.errors import InvalidKeyError, KCacheError, LockTimeoutError
from kcache.fsutil import FileIdentity, UnsafeFileError, atomic_write, read_file_identified
from kcache.index.file import MAX_ENTRY_BYTES
from kcache.keys import require_hex_key, sha256_hex
from kcache_client.errors import ClientError, RemoteNotFoundError

if TYPE_CHECKING:
    from kcache_client._remote import Remote
    from kcache_client._settings import RetryPolicy
    from kcache_client._stats import CacheStats
    from kcache_client._tier import NodeTier

__all__ = [
    "FILE_NAME",
    "MAX_PAIRS",
    "PAGE",
    "SHARED_S",
    "Pair",
    "WithdrawalPage",
    "WithdrawalWatch",
    "Withdrawals",
    "Withdrawn",
    "parse_page",
]

_log = logging.getLogger("kcache_client")

#: The file under the tier's ``index/`` directory.
FILE_NAME = "withdrawals.json"
#: Pairs kept (the newest); an older withdrawal's entries were dropped when it was learnt.
MAX_PAIRS = 50_000
#: Servers whose last id is kept (the most recently checked).
MAX_SERVERS = 64
#: The file is read no further (MAX_PAIRS pairs take about 6.5 MB).
MAX_FILE_BYTES = 8 << 20
#: Rows asked for per request (the server's most).
PAGE = 10_000
#: Requests one check may make (a feed longer than PAGE * this is read on at the next).
MAX_PAGES = 64
#: A check of the same server by another process of the node this recent is this one's.
SHARED_S = 2.0
_VERSION = 1
_URL_MAX = 4096


@dataclass(frozen=True)
class Withdrawn:
    """One row of the feed: ``recipe_key`` no longer answers ``digest``."""

    id: int
    recipe_key: str
    digest: str
    at: str
    reason: str


@dataclass(frozen=True)
class WithdrawalPage:
    """One answer of ``GET /v1/withdrawals``: its rows, in id order, and the last id."""

    rows: tuple[Withdrawn, ...]
    last_id: int


def _int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_page(body: Any, after: int, limit: int) -> WithdrawalPage:
    """The checked answer of ``GET /v1/withdrawals?after=after&limit=limit``; ValueError
    naming what is wrong with it.

    Rows are objects of an int ``id`` above ``after`` and above the row before, a
    ``recipe_key`` and a ``digest`` of 64 lowercase hex digits, an RFC 3339 ``at`` and a
    string ``reason``; at most ``limit`` of them; ``last_id`` the last row's id, or
    ``after`` when there are none.
    """
    if not isinstance(body, dict):
        raise ValueError("the answer is not a JSON object")
    rows = body.get("withdrawals")
    last_id = body.get("last_id")
    if not isinstance(rows, list):
        raise ValueError("its withdrawals are not a list")
    if not _int(last_id):
        raise ValueError(f"its last_id is not an integer: {last_id!r}"[:200])
    if len(rows) > limit:
        raise ValueError(f"{len(rows)} rows, more than the {limit} asked for")
    out: list[Withdrawn] = []
    before = after
    for n, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ValueError(f"row {n} is not an object")
        ident = row.get("id")
        if not _int(ident) or ident <= before:
            raise ValueError(f"row {n} has id {ident!r}, not an integer above {before}"[:200])
        try:
            key = require_hex_key(row.get("recipe_key"), "recipe_key")
            digest = require_hex_key(row.get("digest"), "digest")
        except InvalidKeyError as exc:
            raise ValueError(f"row {n}: {exc}") from None
        at, reason = row.get("at"), row.get("reason")
        if not isinstance(at, str) or not isinstance(reason, str):
            raise ValueError(f"row {n} has no string at and reason")
        try:
            datetime.fromisoformat(at)
        except ValueError:
            raise ValueError(f"row {n} has at {at[:40]!r}, not an RFC 3339 time") from None
        out.append(Withdrawn(ident, key, digest, at, reason))
        before = ident
    if last_id != before:
        raise ValueError(f"its last_id is {last_id}, its rows end at {before}")
    return WithdrawalPage(tuple(out), last_id)


Pair = tuple[str, str]


class Withdrawals:
    """The withdrawn pairs a node tier's file holds and this process learnt (module docstring).

    :meth:`withdrawn` is what lookups ask: a set lookup, nothing when none are known. The
    file is read at the first question and again at each check (only when it changed).
    """

    def __init__(self, tier: NodeTier) -> None:
        self._tier = tier
        self.path = os.path.join(str(tier.root), "index", FILE_NAME)
        self._pairs: dict[Pair, None] = {}  # oldest first
        # url -> (last id, when checked, epoch s): this process's, and the file's (trusted or not).
        self._mine: dict[str, tuple[int, float]] = {}
        self._filed: dict[str, tuple[int, float]] = {}
        self._seen: FileIdentity | None = None
        self._loaded = False
        self._lock = threading.Lock()

    def __len__(self) -> int:
        if not self._loaded:
            self.load()
        return len(self._pairs)

    def withdrawn(self, recipe_key: str, digest: str) -> bool:
        """Whether ``recipe_key`` -> ``digest`` is withdrawn, as far as this process knows."""
        if not self._loaded:
            self.load()
        return bool(self._pairs) and (recipe_key, digest) in self._pairs

    @property
    def trusts_file(self) -> bool:
        """Whether the file's last ids may be used (a private tier's: module docstring)."""
        return self._tier.standing.kind == "private" and not self._tier.read_only

    def load(self) -> None:
        """Merge what the file says now (when it changed since it was last read)."""
        with self._lock:
            self._loaded = True
            try:
                raw, seen = read_file_identified(self.path, MAX_FILE_BYTES)
            except FileNotFoundError:
                return
            except (OSError, UnsafeFileError) as exc:
                _log.debug("kcache: not reading %s: %s", self.path, exc)
                return
            if seen == self._seen:
                return
            self._seen = seen
            pairs, servers = _parse_file(raw)
            for pair in pairs:
                self._pairs.setdefault(pair, None)
            self._trim()
            self._filed = servers

    def last(self, url: str) -> tuple[int, float | None]:
        """(the last id read from ``url``, when it was read, epoch s or None): this process's,
        or in a private tier the file's (another process's) where that is newer."""
        known = [self._mine.get(url)]
        if self.trusts_file:
            known.append(self._filed.get(url))
        states = [state for state in known if state is not None]
        if not states:
            return 0, None
        return max(s[0] for s in states), max(s[1] for s in states)

    def shared_at(self, url: str) -> float | None:
        """When another process of the node last read ``url``'s feed, as the tier's file says
        (a private tier's only), if that is later than this process did; else None."""
        if not self.trusts_file:
            return None
        filed = self._filed.get(url)
        mine = self._mine.get(url)
        if filed is None or (mine is not None and filed[1] <= mine[1]):
            return None
        return filed[1]

    def learn(self, url: str, rows: Sequence[Withdrawn], last_id: int) -> list[Pair]:
        """Note ``rows`` read from ``url`` up to ``last_id`` (now); the pairs new here. Written
        to the tier's file where this process may write it."""
        new: list[Pair] = []
        now = time.time()
        with self._lock:
            for row in rows:
                pair = (row.recipe_key, row.digest)
                if pair not in self._pairs:
                    self._pairs[pair] = None
                    new.append(pair)
            self._trim()
            previous = self._mine.get(url, (0, 0.0))[0]
            self._mine[url] = (max(previous, last_id), now)
            self._save(url, now)
        return new

    def _trim(self) -> None:
        while len(self._pairs) > MAX_PAIRS:
            del self._pairs[next(iter(self._pairs))]

    def _save(self, url: str, now: float) -> None:
        tier = self._tier
        if not tier.standing.writable or tier.read_only:
            return
        servers = dict(self._filed) if self.trusts_file else {}
        servers[url] = self._mine[url]
        kept = sorted(servers.items(), key=lambda item: -item[1][1])[:MAX_SERVERS]
        body = {
            "version": _VERSION,
            "servers": {u: {"last_id": i, "checked_at": t} for u, (i, t) in kept},
            "pairs": [f"{k}:{d}" for k, d in self._pairs],
        }
        try:
            atomic_write(self.path, json.dumps(body).encode(), durable=False)
        except (OSError, KCacheError) as exc:  # another user's file in a shared tier, a full disk
            _log.debug("kcache: could not write %s: %s", self.path, exc)
            return
        self._filed = dict(kept)
        self._seen = None  # read again at the next load (cheap; another may write it next)


def _parse_file(raw: bytes) -> tuple[list[Pair], dict[str, tuple[int, float]]]:
    """The pairs and server states of a file; whatever is malformed is left out."""
    try:
        body = json.loads(raw)
    except ValueError:
        return [], {}
    if not isinstance(body, dict) or body.get("version") != _VERSION:
        return [], {}
    pairs: list[Pair] = []
    listed = body.get("pairs")
    for item in listed if isinstance(listed, list) else ():
        if isinstance(item, str) and len(item) == 129 and item[64] == ":":
            key, digest = item[:64], item[65:]
            try:
                pairs.append((require_hex_key(key, "key"), require_hex_key(digest, "digest")))
            except InvalidKeyError:
                continue
    servers: dict[str, tuple[int, float]] = {}
    found = body.get("servers")
    for url, state in found.items() if isinstance(found, dict) else ():
        if not (isinstance(url, str) and len(url) <= _URL_MAX and isinstance(state, dict)):
            continue
        last, at = state.get("last_id"), state.get("checked_at")
        if _int(last) and last >= 0 and isinstance(at, (int, float)) and not isinstance(at, bool):
            servers[url] = (last, float(at))
    return pairs[-MAX_PAIRS:], dict(list(servers.items())[:MAX_SERVERS])


def drop_from_tier(tier: NodeTier, pairs: Iterable[Pair]) -> int:
    """Remove the aliases of ``tier`` that name a withdrawn pair (and each artifact record no
    alias names any more); how many aliases. Nothing in a tier this process may not write."""
    if not tier.standing.writable or tier.read_only:
        return 0
    gone: set[str] = set()
    for key, digest in pairs:
        path = tier.index.alias_path(key)
        try:
            raw, seen = read_file_identified(path, MAX_ENTRY_BYTES)
            entry, _ = tier.index.parse_signed_alias(key, raw)
            if not isinstance(entry, ArtifactMeta) or entry.digest != digest:
                continue
            if os.lstat(path).st_ino != seen[1]:  # replaced meanwhile (a fresh publish)
                continue
            os.unlink(path)
        except (OSError, UnsafeFileError, KCacheError):
            continue
        gone.add(digest)
    if gone:
        named = tier._aliases()  # the tier's own walk of its aliases
        for digest in gone - named.keys():
            with contextlib.suppress(OSError):
                os.unlink(tier._record_path(digest))
    return len(gone)


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
        """Whether a tier's answer of ``recipe_key`` -> ``digest`` may be given; read the feed
        first when this process never did, or did ``interval_s`` ago."""
        last = self._checked
        if last is None or self._expired or time.monotonic() - last >= self.interval_s:
            self.check(force=self._expired)
        return not self.known.withdrawn(recipe_key, digest)

    def memory_holds(self, recipe_key: str, digest: str) -> bool:
        """Whether a memory answer of ``recipe_key`` -> ``digest`` may be given; read the feed
        first when ``interval_s`` passed since the last check (or since the cache was made)."""
        last = self._checked if self._checked is not None else self._made
        if self._expired or time.monotonic() - last >= self.interval_s:
            self.check(force=self._expired)
        return not self.known.withdrawn(recipe_key, digest)

    def expire(self, expired: bool = True) -> None:
        """Read the feed before the next answer from a tier or memory, however recent the last
        check (``expired``: a warmup, whose answers all came from the server needs none, and
        clears it at its end)."""
        self._expired = expired

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
            with tier.hold_unless(
                lock_key, self._published, watch=os.path.dirname(self.known.path)
            ) as found:
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
                _log.info(
                    "kcache: the withdrawals of %s could not be read (%s); going on with the "
                    "%d known",
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
