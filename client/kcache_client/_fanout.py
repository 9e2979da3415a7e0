"""A job's bundle crosses the network once: fan-out over the job's process group (issue 48).

``warmup(..., group=..., manifest=M)`` (:func:`prefetch_in_group`), where the group is a
:class:`~kcache_client._collective.StoreCollective` (a torch process group: the job's
key-value store) and torch's gloo backend is importable:

1. Every rank says, in one all-gather over the warmup's collective, its host, whether
   its node tier holds the manifest (its completeness marker) and whether it can take
   part (a torch store, a server, a tier it writes packs into). Each host's lowest rank
   is its node's leader, as ``warmup(per_node=True)`` elects it. Nodes whose leader
   holds the manifest are skipped: they take no part and ask nothing.
2. The leaders of the nodes that lack it (two or more that can take part) meet in a
   gloo group of their own beside the job's process group, made on the job's store
   under a prefix of this call's (``kcache/fanout/<nonce>/``: a ``ProcessGroupGloo``
   made directly, so torch's group registry, its names and ``new_group``'s collective
   creation over the whole job, issue 18, are never involved; gloo on CPU whatever the
   job's own backend, NCCL included: docs/design.md §8 says why). The lowest of them
   (the source) asks the server for the manifest's keys in one ``POST /v1/bundle``,
   checking and keeping the answer in its own tier as any prefetch does while it
   copies the answer's bytes to a spool file, then broadcasts the spool: its length,
   then pieces of :data:`CHUNK` bytes. Each other leader spools what it receives (on
   disk: memory stays a piece, whatever the size) and checks it exactly as the
   server's answer to its own request (:func:`~kcache_client._bundle.publish_received`,
   the code path of :func:`~kcache_client._bundle.prefetch`: framing, sizes, digests,
   only keys of the manifest, each once, and the server's signature over all entries by
   a key this client trusts for the server), then keeps it as a pack of its node tier.
3. Every leader then runs the node's ordinary prefetch: a node the fan-out filled marks
   the manifest complete without a request; a node whose broadcast failed (a peer that
   died, sent other bytes, or a pack a trusted key did not sign) or did not finish
   within its budget makes its own request, as without a group. A second all-gather
   is the barrier: the node's other ranks then read the tier its leader filled (their
   prefetch finds its marker). A leader's prefetch that fails is shared there, so every
   rank raises the same :class:`~kcache_client.errors.WarmupError`; a rank that never
   arrives (killed) is the collective's :class:`~kcache_client.errors.WarmupTimeoutError`
   on every rank, within the warmup's timeout.

The broadcast is bounded: the side group's every operation and the whole exchange (the
source's request, then the broadcast) by :func:`budget`, the smaller of half the
warmup's timeout and two request deadlines (``KCACHE_REQUEST_DEADLINE_S``: the source's
one request, then the same bytes over the job's network); the exchange runs in a thread
of its own that the leader stops waiting for at the budget, then falls back to its own
request. A length announced past what the manifest can weigh (:func:`bound`) is refused.
"""

from __future__ import annotations

import logging
import secrets
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any, BinaryIO

from kcache.bundle_format import MAX_LINE_BYTES, read_chunks
from kcache.job_manifest import JobManifest
from kcache_client._bundle import (
    BundleCache,
    PrefetchResult,
    Received,
    fetch_teed,
    marked_complete,
    prefetch,
    publish_received,
)
from kcache_client._collective import StoreCollective, as_collective
from kcache_client._warmup import error_dict, malformed, run_collective
from kcache_client.errors import WarmupError

__all__ = ["CHUNK", "bound", "budget", "prefetch_in_group"]

_log = logging.getLogger(__name__)

#: Bytes per broadcast of the pack (a tensor of this many bytes at a time, in memory).
CHUNK = 4 << 20
#: The length a source broadcasts when it has nothing to send (its request failed).
_NOTHING = -1
#: Share of the warmup's timeout the fan-out may take, at most: the rest is the fallback's.
_SHARE = 0.5


def budget(timeout: float, deadline_s: float) -> float:
    """How long the fan-out may take: half the warmup's timeout, at most two request deadlines."""
    return max(0.1, min(timeout * _SHARE, 2 * deadline_s))


def bound(manifest: JobManifest, max_artifact_bytes: int) -> int:
    """The most bytes a bundle of ``manifest``'s keys can have: a header line and a trailer,
    and per key a header line, its bytes and a newline (or a missing line); with foreign
    groups, their section's header and end lines and per group a line, its files and a
    newline (kcache.foreign_section)."""
    kernels = (len(manifest) + 2) * (MAX_LINE_BYTES + 1) + len(manifest) * (max_artifact_bytes + 1)
    groups = manifest.foreign
    if not groups:
        return kernels
    files = sum(len(g.files) for g in groups)
    return (
        kernels
        + (len(groups) + 2) * (MAX_LINE_BYTES + 1)
        + files * max_artifact_bytes
        + len(groups)
    )


def prefetch_in_group(
    cache: BundleCache, manifest: JobManifest, group: Any, *, timeout: float, host: str
) -> PrefetchResult:
    """``manifest`` into this node's tier, the job's bundle fanned out over ``group`` (module
    docstring); without a group (or with a single process), :func:`prefetch` alone."""
    coll = as_collective(group, timeout=timeout)
    if coll is None:
        return prefetch(cache, manifest)
    tiers = [cache.tier, *cache.layers]
    for tier in tiers:
        tier.packs.refresh()
    mine = {
        "host": host,
        "complete": marked_complete(tiers, manifest),
        "able": _able(cache, coll),
        "nonce": secrets.token_hex(10),
    }
    gathered = run_collective(
        lambda: coll.all_gather(mine), "all-gather of the nodes' manifests (fan-out)", 0
    )
    _check_gathered(gathered, coll.world_size)
    hosts = [entry["host"] for entry in gathered]
    leader = hosts.index(host)
    leaders = sorted({hosts.index(h) for h in hosts})
    lacking = [r for r in leaders if not gathered[r]["complete"]]
    takers = [r for r in lacking if gathered[r]["able"]]
    error: dict[str, Any] | None = None
    if coll.rank == leader and leader in lacking:
        try:
            if leader in takers and len(takers) >= 2:
                assert isinstance(coll, StoreCollective)  # _able said so
                _fan_out(cache, manifest, coll, takers, gathered[takers[0]]["nonce"], timeout)
            prefetch(cache, manifest)  # the node's own request where the fan-out left a gap
        except Exception as exc:  # shared below, so that every rank raises the same
            error = error_dict(exc, coll.rank)
    answers = run_collective(
        lambda: coll.all_gather({"error": error}), "gather of the nodes' prefetches", leader
    )
    if not isinstance(answers, list) or len(answers) != coll.world_size:
        raise malformed("gather of the nodes' prefetches", 0, "not one entry per rank")
    for rank, answer in enumerate(answers):
        if not isinstance(answer, dict):
            raise malformed("prefetch", rank, "not an object")
        failed = answer.get("error")
        if failed is not None:
            if not isinstance(failed, dict) or not isinstance(failed.get("message"), str):
                raise malformed("prefetch", rank, "an error without a message")
            raise WarmupError.from_dict(failed)
    return prefetch(cache, manifest)  # the node's other ranks: the tier its leader filled


def _able(cache: BundleCache, coll: Any) -> bool:
    """Whether this process can take part in a fan-out: a torch store under the collective,
    torch's gloo, a server, and a tier it writes packs into."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not isinstance(coll, StoreCollective):
        return False
    tier = cache.tier
    if tier.read_only or not tier.standing.writable:
        return False
    try:
        cache._require_server()
        return bool(dist.is_available()) and isinstance(coll.store, dist.Store)
    except Exception:
        return False


def _check_gathered(gathered: Any, size: int) -> None:
    """Refuse an all-gather that is not one entry per rank as :func:`prefetch_in_group` sends them."""
    if not isinstance(gathered, list) or len(gathered) != size:
        raise malformed("all-gather of the nodes' manifests", 0, f"not a list of {size} entries")
    for rank, entry in enumerate(gathered):
        if not (
            isinstance(entry, dict)
            and isinstance(entry.get("host"), str)
            and isinstance(entry.get("complete"), bool)
            and isinstance(entry.get("able"), bool)
            and isinstance(entry.get("nonce"), str)
        ):
            raise malformed("node's manifest", rank, "not an object of host, complete, able, nonce")


def _fan_out(
    cache: BundleCache,
    manifest: JobManifest,
    coll: StoreCollective,
    takers: list[int],
    nonce: str,
    timeout: float,
) -> None:
    """This leader's part of the broadcast (module docstring, step 2); never raises for it.

    A failure (a peer gone, bytes refused, the budget spent) is logged, and the caller's
    prefetch then asks the server, as it would without a group.
    """
    remote = cache._require_server()
    index = takers.index(coll.rank)
    limit = budget(timeout, cache.settings.retry.deadline_s)
    most = bound(manifest, cache.settings.max_artifact_bytes)
    exchange = _Exchange(cache, manifest, coll.store, f"kcache/fanout/{nonce}/", index, takers)
    worker = threading.Thread(
        target=exchange.run, args=(limit, most), name="kcache-fanout", daemon=True
    )
    started = time.monotonic()
    worker.start()
    worker.join(limit)
    if worker.is_alive():
        exchange.abandoned = True
        _log.warning(
            "kcache: the bundle's fan-out over the job's process group did not end within "
            "%.3gs; this node asks the server itself",
            limit,
        )
        cache.stats.add("fanout_failures")
        return
    if exchange.failure is not None:
        _log.warning(
            "kcache: the bundle's fan-out over the job's process group failed (%s); this node "
            "asks the server itself",
            exchange.failure,
        )
        cache.stats.add("fanout_failures")
        return
    if index == 0:
        cache.stats.add("fanout_sent")
        _log.info(
            "kcache: sent the bundle of manifest %s (%d bytes) to %d nodes in %.3gs",
            manifest.digest[:12],
            exchange.size,
            len(takers) - 1,
            time.monotonic() - started,
        )
        return
    spool = exchange.spool
    assert spool is not None
    where = (
        f"{remote.url}/v1/bundle (the answer as rank {coll.job_ranks[takers[0]]} "
        "forwarded it over the job's process group)"
    )
    try:
        spool.seek(0)
        publish_received(cache, manifest, Received(read_chunks(spool, CHUNK), where))
    except Exception as exc:  # refused as the server's answer would be: ask the server
        _log.warning(
            "kcache: the bundle forwarded over the job's process group is refused (%s: %s); "
            "this node asks the server itself",
            type(exc).__name__,
            exc,
        )
        cache.stats.add("fanout_failures")
        return
    finally:
        spool.close()
    cache.stats.add("fanout_received")


class _Exchange:
    """One leader's side of the broadcast, run in a thread of its own (:meth:`run`).

    The source (index 0) fetches the bundle, copying its bytes to a spool, then
    broadcasts the spool's length and its pieces; the others receive them into a spool
    of their own. ``failure`` says what went wrong, if anything; ``abandoned`` is set
    when the leader stopped waiting (its budget spent).
    """

    def __init__(
        self,
        cache: BundleCache,
        manifest: JobManifest,
        store: Any,
        prefix: str,
        index: int,
        takers: list[int],
    ) -> None:
        self.cache = cache
        self.manifest = manifest
        self.store = store
        self.prefix = prefix
        self.index = index
        self.takers = takers
        self.spool: BinaryIO | None = None
        self.size = 0
        self.failure: str | None = None
        self.abandoned = False

    def run(self, limit: float, most: int) -> None:
        try:
            self._run(limit, most)
        except Exception as exc:  # told to the leader, which asks the server
            self.failure = f"{type(exc).__name__}: {exc}"

    def _run(self, limit: float, most: int) -> None:
        import torch
        import torch.distributed

        dist: Any = torch.distributed  # PrefixStore and Backend.broadcast are not in its stubs
        until = time.monotonic() + limit
        spool = tempfile.TemporaryFile(prefix="kcache-fanout-")  # noqa: SIM115 (closed by its reader)
        self.spool = spool
        sizes: list[int] = []
        fetcher = None
        if self.index == 0:  # the request runs while the group meets (tens of ms of each)
            fetcher = threading.Thread(
                target=lambda: sizes.append(self._fetch(spool, most)),
                name="kcache-fanout-fetch",
                daemon=True,
            )
            fetcher.start()
        group: Any = dist.ProcessGroupGloo(
            dist.PrefixStore(self.prefix, self.store),
            self.index,
            len(self.takers),
            timedelta(seconds=limit),
        )

        def broadcast(tensor: Any) -> None:
            left = until - time.monotonic()
            if left <= 0 or self.abandoned:
                raise TimeoutError("the fan-out's budget is spent")
            group.broadcast(tensor, 0, timedelta(seconds=left)).wait()

        length = torch.zeros(1, dtype=torch.int64)
        if fetcher is not None:
            fetcher.join(max(0.0, until - time.monotonic()))
            size = sizes[0] if sizes else _NOTHING  # none: the request outlived the budget
            length[0] = size
            broadcast(length)
            if size == _NOTHING:
                raise RuntimeError("the server's answer could not be had: nothing was sent")
            spool.seek(0)
            for piece in _pieces(size):
                buffer = bytearray(piece)
                if spool.readinto(buffer) != piece:
                    raise OSError("the spool file of the bundle is shorter than it was written")
                broadcast(torch.frombuffer(buffer, dtype=torch.uint8))
            self.size = size
            spool.close()
            return
        broadcast(length)
        size = int(length[0])
        if size == _NOTHING:
            raise RuntimeError(f"rank {self.takers[0]}, the source, had no answer to send")
        if not 0 < size <= most:
            raise ValueError(
                f"the source announced {size} bytes, not within the {most} a bundle of the "
                f"manifest's {len(self.manifest)} kernels may have"
            )
        for piece in _pieces(size):
            buffer = bytearray(piece)
            broadcast(torch.frombuffer(buffer, dtype=torch.uint8))
            spool.write(buffer)
        self.size = size

    def _fetch(self, spool: BinaryIO, most: int) -> int:
        """The source's one request: kept in its own tier, copied to ``spool``; its length."""
        written = 0

        def copy(piece: bytes) -> None:
            nonlocal written
            written += len(piece)
            if written > most:
                raise ValueError(f"a bundle answer longer than the {most} bytes it may have")
            spool.write(piece)

        try:
            fetch_teed(self.cache, self.manifest, copy)
        except Exception as exc:
            _log.warning(
                "kcache: the bundle request for the job's nodes failed (%s: %s)",
                type(exc).__name__,
                exc,
            )
            return _NOTHING
        spool.flush()
        return written


def _pieces(size: int) -> Iterator[int]:
    """The lengths of the broadcasts of ``size`` bytes."""
    while size > 0:
        yield min(CHUNK, size)
        size -= CHUNK
