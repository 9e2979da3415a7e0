"""Audit events for hits the server never sees (memory and node-tier hits).

``record()`` only appends to a queue, so ``get()`` never waits on the network.
Identical hits (same recipe, digest, tier and outcome) waiting in the queue are
tallied into one event with a ``count`` and their mean latency: a training loop
that calls ``get()`` a million times sends a handful of events, not a million. A
daemon thread sends batches to ``POST /v1/events`` when a batch fills or every
``interval_s``. ``close()`` (also run at interpreter exit) sends what is left, with
a bounded wait, so a clean shutdown loses nothing. If the server is down, events
are kept (up to ``max_pending``) and sent with the next batch; past that limit the
oldest are dropped and counted in ``dropped``, because a training job must never
run out of memory over audit records.

Given a node's spool (:class:`~kcache_client._event_spool.NodeEventSpool`: a private node
tier), batches are appended to it instead, and the one process of the node that holds the
spool's lock sends them all: one post per interval per node, not per process.

A forked child (a data loader's worker) starts with an empty queue, no thread and a spool
it does not lead: what was queued before the fork is the parent's to send, once.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any

from kcache_client._event_spool import NodeEventSpool
from kcache_client._forked import reset_in_child
from kcache_client._http import Transport
from kcache_client._settings import RetryPolicy
from kcache_client.errors import ClientError, ServerUnavailableError

__all__ = ["MAX_EVENT_COUNT", "EventSink", "tally_key"]

log = logging.getLogger(__name__)

# The most lookups one event may stand for (the server refuses more: its limit too).
MAX_EVENT_COUNT = 1_000_000

# Events go out in the background; a short, bounded retry keeps the thread responsive.
_EVENT_RETRY = RetryPolicy(attempts=3, base_s=0.2, cap_s=2.0, budget_s=5.0, max_retry_after_s=5.0)


def tally_key(recipe_key: object, digest: object, tier: object, outcome: object) -> tuple[Any, ...]:
    """What makes hits identical: events with the same key are tallied into one."""
    return (recipe_key, digest, tier, outcome)


def _tally_key(event: dict[str, Any]) -> tuple[Any, ...]:
    return tally_key(
        event.get("recipe_key"), event.get("digest"), event.get("tier"), event.get("outcome")
    )


class EventSink:
    """A background batcher of audit events for one server."""

    def __init__(
        self,
        transport: Transport,
        *,
        batch_size: int = 256,
        interval_s: float = 2.0,
        max_pending: int = 100_000,
        spool: NodeEventSpool | None = None,
    ) -> None:
        self._transport = transport
        self._spool = spool
        self._batch_size = batch_size
        self._interval_s = interval_s
        self._pending: collections.deque[dict[str, Any]] = collections.deque(maxlen=max_pending)
        # Queued events that later identical ones are tallied into, until they are taken.
        self._open: dict[tuple[Any, ...], dict[str, Any]] = {}
        self._cond = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        self.sent = 0
        self.dropped = 0
        self.failures = 0
        reset_in_child(self)

    def _after_fork_in_child(self) -> None:
        """This sink in a forked child: no thread (threads do not survive a fork), a lock
        of its own, and none of the parent's queue (the parent sends that)."""
        self._cond = threading.Condition()
        self._thread = None
        self._pending.clear()
        self._open.clear()

    def record(self, event: dict[str, Any]) -> None:
        """Queue one event; never blocks on I/O."""
        tally = _tally_key(event)
        with self._cond:
            if self._closed:
                return
            if event.get("recipe_key") and self._tally_locked(
                tally, event.get("latency_ms", 0.0), event.get("time")
            ):
                return
            if len(self._pending) == self._pending.maxlen:
                self.dropped += self._pending[0].get("count", 1)
                self._open.pop(_tally_key(self._pending[0]), None)
            event.setdefault("count", 1)
            self._pending.append(event)
            if event.get("recipe_key"):
                self._open[tally] = event
            if self._thread is None:
                # Started lazily: a process that never hits the tiers never gets a thread.
                self._thread = threading.Thread(target=self._run, name="kcache-events", daemon=True)
                self._thread.start()
            if len(self._pending) >= self._batch_size:
                self._cond.notify()

    def tally(self, tally: tuple[Any, ...], latency_ms: float, when: float) -> bool:
        """Count one more hit into the queued event of ``tally`` (:func:`tally_key`), if any.

        What :meth:`record` does with an event identical to a queued one, without the
        event: a hit that finds its event queued costs no dict of a dozen fields.
        False when there is none (or the sink is closed): record the whole event then.
        """
        with self._cond:
            return not self._closed and self._tally_locked(tally, latency_ms, when)

    def _tally_locked(self, tally: tuple[Any, ...], latency_ms: float, when: float | None) -> bool:
        """Fold one hit into the open event of ``tally`` (the caller holds the lock); False if none."""
        open_event = self._open.get(tally)
        if open_event is None or open_event.get("count", 1) >= MAX_EVENT_COUNT:
            return False
        count = open_event.get("count", 1)
        latency = open_event.get("latency_ms", 0.0) * count + latency_ms
        open_event["count"] = count + 1
        open_event["latency_ms"] = latency / (count + 1)
        open_event["time"] = when if when is not None else open_event.get("time")
        return True

    def pending(self) -> int:
        """Lookups not yet delivered (a tallied event counts for each lookup it stands for)."""
        with self._cond:
            return sum(e.get("count", 1) for e in self._pending)

    def flush(self, timeout: float = 10.0) -> bool:
        """Send everything queued now, from the calling thread; True if the queue emptied.

        With a spool: everything queued is spooled, and the node's spool is sent if this
        process can be its sender (the lock free, or held here); else its sender sends it.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self._send_one_batch():
                break
        self._drain_spool(deadline)
        return self.pending() == 0

    def close(self, timeout: float = 10.0) -> None:
        """Stop the thread and deliver what is left (bounded by ``timeout``); a node's
        sender lets another process take over."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)
        self.flush(timeout)
        if self._spool is not None:
            self._spool.release()

    # ------------------------------------------------------------------ internals
    def _take(self) -> list[dict[str, Any]]:
        with self._cond:
            batch = [
                self._pending.popleft() for _ in range(min(self._batch_size, len(self._pending)))
            ]
            for event in batch:  # on its way out: later hits start a new event
                if self._open.get(_tally_key(event)) is event:
                    del self._open[_tally_key(event)]
        return batch

    def _send_one_batch(self) -> bool:
        """Send (or spool) one batch; False when there was nothing to send or the server
        refused it."""
        batch = self._take()
        if not batch:
            return False
        if self._spool is not None and self._spool.append(batch):
            return True
        delivered = self._post(batch)
        if delivered is None:
            with self._cond:  # keep them, in order, for the next attempt
                self._pending.extendleft(reversed(batch))
            return False
        return delivered

    def _post(self, batch: list[dict[str, Any]]) -> bool | None:
        """``POST /v1/events`` of ``batch``: True when delivered, False when the server refused
        it (dropped and counted), None when the server could not be reached."""
        try:
            self._transport.request(
                "POST", "/v1/events", json={"events": batch}, ok=(200, 202), retry=_EVENT_RETRY
            )
        except ServerUnavailableError:
            self.failures += 1
            return None
        except ClientError as exc:
            # The server refused the batch itself (auth, validation): resending cannot help.
            # A token without the report scope (a read-only one) lands here every time.
            if not self.failures:
                log.warning("audit events refused by the server, dropped: %s", exc)
            self.failures += 1
            self.dropped += sum(e.get("count", 1) for e in batch)
            return False
        self.sent += sum(e.get("count", 1) for e in batch)
        return True

    def _drain_spool(self, deadline: float) -> None:
        """Send the node's spool if this process is (or can now be) its sender; then, if
        lines arrived meanwhile and nobody else took over, again (until ``deadline``)."""
        spool = self._spool
        if spool is None:
            return
        while time.monotonic() < deadline and spool.lead():
            spool.drain(self._post_spooled, self._batch_size)
            if not self._closed:
                return  # a live sender keeps the lock, and sends again in an interval
            # Ending: let go first, then look: a process that spooled after the drain and
            # found the lock taken is not stranded (it is taken again here, or by it).
            spool.release()
            if not spool.holds_lines():
                return

    def _post_spooled(self, batch: list[dict[str, Any]]) -> bool:
        """Post a batch taken from the node's spool: False when the server could not be
        reached (the spool keeps it), True when it was delivered or refused for good."""
        return self._post(batch) is not None

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._closed and len(self._pending) < self._batch_size:
                    self._cond.wait(self._interval_s)
                if self._closed:
                    return  # close() flushes from its own thread
            while self._send_one_batch():
                if self.pending() < self._batch_size:
                    break
            self._drain_spool(time.monotonic() + self._interval_s)
