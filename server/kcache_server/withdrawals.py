"""Withdrawals: bindings that stopped holding, read by every process that keeps bindings.

A binding (recipe key -> digest) holds while verification has not found it wrong. When
it does, :meth:`SqlIndex.withdraw_binding <kcache_server.index.SqlIndex.withdraw_binding>`
removes it from the index and writes a row of the ``withdrawals`` table in the same
transaction (docs/design.md, "What a binding rests on"); so does an admin's removal of a
foreign binding (:meth:`ForeignStore.delete <kcache_server.foreign.ForeignStore.delete>`,
naming its group's content digest). Both write the row with
:func:`kcache_server.index.record_withdrawal`. This module is the reading side:

- :class:`WithdrawalLog` reads the rows after a given id, in id order (withdrawals commit
  one at a time, so ids commit in order), for the route ``GET /v1/withdrawals`` and for
- :class:`WithdrawalFollower`, one thread per server process (every replica and every
  worker process of ``kcache serve --workers N``, whether or not the store has a cap),
  which reads the rows after the last it saw every ``poll_s`` (twice a second) and drops
  each withdrawn key from the resolver's memory, which both fast paths answer from. So no
  process answers a withdrawn binding from memory for more than about ``poll_s`` plus a
  query after it was withdrawn; the index no longer has it. The last id it acted on is
  the resolver's ``withdrawn_through``, which a fetch by key answers with
  (``X-KCache-Withdrawals-Through``): a client whose node knows the feed that far needs no
  read of it (kcache_client._withdrawals).

A thread of its own rather than a step of the evictor's loop: the evictor is about the
store's size, and a withdrawal must reach memory even while an eviction pass runs.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

import sqlalchemy as sa
from sqlalchemy.exc import DBAPIError

from kcache_server.models import withdrawals_table as _withdrawals
from kcache_server.state import ServerState

__all__ = [
    "MAX_READ",
    "WithdrawalFollower",
    "WithdrawalLog",
    "WithdrawnBinding",
    "install_withdrawals",
]

log = logging.getLogger(__name__)

#: Rows one read returns at most (a route's ``limit`` is capped at it too).
MAX_READ = 10_000
# Seconds between two log lines about a failing read (a database outage repeats).
_COMPLAINT_EVERY_S = 60.0


@dataclass(frozen=True)
class WithdrawnBinding:
    """One row of the ``withdrawals`` table."""

    id: int
    at: datetime
    recipe_key: str
    digest: str
    reason: str


class WithdrawalLog:
    """Reading the ``withdrawals`` table of one database (rows are written by the index)."""

    def __init__(self, db: sa.Engine) -> None:
        self.db = db

    def last_id(self) -> int:
        """The newest row's id (0 when there is none)."""
        with self.db.connect() as conn:
            return int(conn.execute(sa.select(sa.func.max(_withdrawals.c.id))).scalar() or 0)

    def after(self, last_id: int, limit: int = MAX_READ) -> list[WithdrawnBinding]:
        """The rows after id ``last_id``, oldest first, at most ``limit`` (capped at :data:`MAX_READ`)."""
        with self.db.connect() as conn:
            rows = conn.execute(
                sa.select(_withdrawals)
                .where(_withdrawals.c.id > last_id)
                .order_by(_withdrawals.c.id)
                .limit(max(1, min(limit, MAX_READ)))
            ).all()
        return [WithdrawnBinding(int(r.id), r.at, r.recipe_key, r.digest, r.reason) for r in rows]


class Forgetting(Protocol):
    """What a follower acts on (a :class:`~kcache_server.resolving.Resolver`)."""

    withdrawn_through: int | None

    def withdraw(self, recipe_key: str, digest: str) -> None: ...


class WithdrawalFollower:
    """Reads new withdrawals every ``poll_s`` and hands each to ``memory.withdraw``.

    ``memory`` is the process's resolver; its ``withdrawn_through`` is set to the last id
    acted on after each read. The first read starts after the newest row at :meth:`start`
    (memory is empty then); a process that could not read it then starts from the first
    row (each is cheap to forget), and claims no id until that read is done. A failed
    read is retried at the next poll, from the same id.
    """

    def __init__(
        self,
        withdrawals: WithdrawalLog,
        memory: Forgetting,
        *,
        poll_s: float = 0.5,
    ) -> None:
        self.withdrawals = withdrawals
        self.memory = memory
        self.poll_s = poll_s
        #: The id of the newest withdrawal this process has acted on.
        self.last_id = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._complained_at = -_COMPLAINT_EVERY_S

    def start(self) -> None:
        """Follow in a background thread until :meth:`close`."""
        try:
            self.last_id = self.withdrawals.last_id()
            self.memory.withdrawn_through = self.last_id
        except DBAPIError:
            self.last_id = 0
        self._thread = threading.Thread(target=self._loop, name="kcache-withdrawals", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def poll(self) -> int:
        """Act on the withdrawals after the last one seen; how many there were."""
        rows = self.withdrawals.after(self.last_id)
        for row in rows:
            self.memory.withdraw(row.recipe_key, row.digest)
            self.last_id = row.id
        self.memory.withdrawn_through = self.last_id
        if rows:
            log.info("forgot %d withdrawn binding(s), up to withdrawal %d", len(rows), self.last_id)
        return len(rows)

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.poll()
            except Exception as exc:  # never take the server down; say so once a minute
                now = time.monotonic()
                if now - self._complained_at >= _COMPLAINT_EVERY_S:
                    self._complained_at = now
                    if isinstance(exc, DBAPIError):
                        log.warning("reading withdrawals failed (%s); retrying", exc.orig or exc)
                    else:
                        log.exception("reading withdrawals failed; retrying")


def install_withdrawals(state: ServerState) -> WithdrawalFollower:
    """The process's follower of the withdrawals, forgetting in ``state``'s resolver; start it in the lifespan."""
    return WithdrawalFollower(WithdrawalLog(state.backends.db), state.resolver)
