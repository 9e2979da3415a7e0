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

**When.** A ``KernelCache`` with a server asks (:class:`~kcache_client._withdrawal_watch.WithdrawalWatch`):

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
And a fetch's answer is a check: it says how far the server's withdrawals behind it go
(``X-KCache-Withdrawals-Through``, the newest withdrawal its process acted on), and where
this node has read the feed that far, the answer stands for a read that found nothing new
(:meth:`~kcache_client._withdrawal_watch.WithdrawalWatch.answered`, noted in the tier's
file as a read is, at most once a second): a cold node whose ranks fetch what they need
sends no feed request. The header is trusted as the feed is (neither is signed), and is
at most the server's poll (half a second) plus an edge cache's 2 s behind.
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

**Foreign groups** an admin removed are withdrawn the same way, by binding key and the
group's content digest (:func:`kcache.foreign.group_digest`): the tier's alias is removed
when its group's content matches, and a hook's lookup refuses such a group in memory or
the tier (:class:`~kcache_client._foreign.ForeignCache`). The server answering the pair
again (the same bytes published anew) is its word now, and the node's library compiling
the same bytes itself is the node's: :meth:`Withdrawals.reinstate`.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import Protocol

from kcache.errors import InvalidKeyError, KCacheError
from kcache.fsutil import FileIdentity, UnsafeFileError, atomic_write, read_file_identified
from kcache.keys import require_hex_key
from kcache.standing import Standing
from kcache_client._withdrawal_feed import Withdrawn, is_int

__all__ = [
    "FILE_NAME",
    "MAX_PAGES",
    "MAX_PAIRS",
    "SHARED_S",
    "Pair",
    "Withdrawals",
]


class TierPlace(Protocol):
    """What :class:`Withdrawals` reads of its node tier (a :class:`~kcache_client._tier.NodeTier`)."""

    @property
    def root(self) -> os.PathLike[str] | str: ...

    @property
    def standing(self) -> Standing: ...

    @property
    def read_only(self) -> bool: ...


_log = logging.getLogger("kcache_client")

#: The file under the tier's ``index/`` directory.
FILE_NAME = "withdrawals.json"
#: Pairs kept (the newest); an older withdrawal's entries were dropped when it was learnt.
MAX_PAIRS = 50_000
#: Servers whose last id is kept (the most recently checked).
MAX_SERVERS = 64
#: The file is read no further (MAX_PAIRS pairs take about 6.5 MB).
MAX_FILE_BYTES = 8 << 20
#: Requests one check may make (a feed longer than PAGE * this is read on at the next).
MAX_PAGES = 64
#: A check of the same server by another process of the node this recent is this one's.
SHARED_S = 2.0
_VERSION = 1
_URL_MAX = 4096


Pair = tuple[str, str]


class Withdrawals:
    """The withdrawn pairs a node tier's file holds and this process learnt (module docstring).

    :meth:`withdrawn` is what lookups ask: a set lookup, nothing when none are known. The
    file is read at the first question and again at each check (only when it changed).
    """

    def __init__(self, tier: TierPlace) -> None:
        self._tier = tier
        self.path = os.path.join(str(tier.root), "index", FILE_NAME)
        self._pairs: dict[Pair, None] = {}  # oldest first
        self._keys: dict[str, int] = {}  # key -> how many of the pairs name it
        # Pairs the server answered again after this process learnt them (reinstate).
        self._reinstated: set[Pair] = set()
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

    def names(self, recipe_key: str) -> bool:
        """Whether any withdrawn pair names ``recipe_key`` (so that a caller whose digest
        costs a hash computes it only then: a foreign group's content digest)."""
        if not self._loaded:
            self.load()
        return bool(self._keys) and recipe_key in self._keys

    def reinstate(self, pair: Pair) -> None:
        """The server answered ``pair`` again after it was withdrawn (a foreign group published
        again with the same bytes), or this node's library made those bytes again itself:
        this process stops refusing it, and leaves it out of the tier's file when it next
        writes it, until the feed withdraws it anew (another process that read the pair
        finds the server's answer on its own, once). Nothing when the pair is not withdrawn
        here."""
        if not self.withdrawn(*pair):
            return
        with self._lock:
            self._reinstated.add(pair)
            self._remove(pair)

    def _add(self, pair: Pair) -> bool:
        if pair in self._pairs or pair in self._reinstated:
            return False
        self._pairs[pair] = None
        self._keys[pair[0]] = self._keys.get(pair[0], 0) + 1
        return True

    def _remove(self, pair: Pair) -> None:
        if pair not in self._pairs:
            return
        del self._pairs[pair]
        left = self._keys.pop(pair[0]) - 1
        if left:
            self._keys[pair[0]] = left

    @property
    def trusts_file(self) -> bool:
        """Whether the file's last ids may be used (a private tier's: module docstring)."""
        return self._tier.standing.kind == "private" and not self._tier.read_only

    def load(self) -> None:
        """Merge what the file says now (when it changed since it was last read)."""
        with self._lock:
            self._loaded = True
            self._merge_file()

    def _merge_file(self) -> None:
        """:meth:`load` under the lock: what another process wrote is kept, not overwritten."""
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
            self._add(pair)
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
                self._reinstated.discard(pair)  # withdrawn anew: the feed is newer
                if self._add(pair):
                    new.append(pair)
            self._trim()
            previous = self._mine.get(url, (0, 0.0))[0]
            self._mine[url] = (max(previous, last_id), now)
            self._save(url, now)
        return new

    def _trim(self) -> None:
        while len(self._pairs) > MAX_PAIRS:
            self._remove(next(iter(self._pairs)))

    def _save(self, url: str, now: float) -> None:
        tier = self._tier
        if not tier.standing.writable or tier.read_only:
            return
        # What others wrote since this process last read the file goes into what it writes
        # (a check holds the node's lock for its server, a fetch's answer and other servers
        # do not): a pair another process learnt is never lost from the file.
        self._merge_file()
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
        if is_int(last) and last >= 0 and isinstance(at, (int, float)) and not isinstance(at, bool):
            servers[url] = (last, float(at))
    return pairs[-MAX_PAIRS:], dict(list(servers.items())[:MAX_SERVERS])
