"""Per-caller storage quotas: a cap on the bytes of stored artifacts each token caused to be compiled.

:class:`QuotaCompiler` wraps the engine's compiler. Every compile is charged to the
caller it ran for (:data:`~kcache_server.fairness.current_caller`: a token, or a client
address on an open server) in ``compile_charges``; a charge counts while an
artifact row with its digest exists, so eviction (and ``kcache cache rm``) gives the
bytes back.

With ``token_quota_bytes`` set, a compile **reserves before it compiles and settles
after**, in the database, so concurrent compiles (one batch, many requests, several
replicas on one database) cannot take a caller past its quota. The rule:

- **Used** bytes are the caller's charges whose artifact row exists, plus its charges
  younger than ``hold_s`` whose row does not exist yet (a compile is charged just
  before the engine publishes its blob and commits the row; a publish that failed
  stops counting after ``hold_s``). **Reserved** bytes are the caller's unexpired
  reservations. **Room** is the quota minus both.
- **Reserve.** Before compiling, one transaction locks the caller's row of
  ``quota_accounts`` (an upsert: a row lock on PostgreSQL, the write lock on SQLite),
  reads used and reserved, and inserts a reservation of ``min(room, bound)`` bytes,
  where ``bound`` is ``max_artifact_bytes`` (no compile stores more; without a size
  limit, the quota). The lock serializes a caller's reservations across threads,
  processes and replicas, so no two compiles are promised the same bytes.
- **No room.** With room of 0 or less, a caller that has no reservation pending is
  refused before compiling (507 ``quota_exceeded``: nothing runs). One whose other
  compiles hold the rest waits for them to settle (woken at once in this process,
  polling the database every ``poll_s`` for other replicas), at most ``wait_s``,
  then is refused the same way. So close to its quota a caller's compiles run one
  at a time, and far from it (room of ``bound`` or more per compile) all at once.
- **Settle.** After the compile, one transaction under the same lock deletes the
  reservation and charges the output's real size: at once when it fits the
  reservation (it always does when the room was at least ``bound``); else only if
  used + the other reservations + the size still fit the quota, and otherwise the
  compile is refused (507) before anything is stored: the compile's time is lost,
  the quota holds. Bytes that are stored already cost nothing more (charged only if
  no one was and they fit; never refused). A charge is never written past the quota.
- **Release.** A compile that fails (a compile error, a timeout, a crashed worker,
  output over ``max_artifact_bytes``, which the engine then refuses with 422
  ``artifact_too_large`` and which is never charged) deletes its reservation. A
  reservation whose process died expires ``hold_s`` after it was taken (by
  default twice the compile time limit and queue wait together, plus a minute: 15
  minutes with the default settings) and stops counting; expired ones are deleted
  by the caller's next reservation.

So the charged total of a caller never exceeds its quota: no overshoot, with any
concurrency. The outcome of concurrent compiles is one that some one-at-a-time order
would have had. Without a quota, compiles are charged after they finish, with no
reservation. A request without a caller (maintenance) is neither limited nor charged.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from kcache.artifact import CompileOutput
from kcache.compilers import Compiler
from kcache.eviction import format_size
from kcache.include_sets import IncludeSets
from kcache.recipe import Recipe
from kcache.toolchain import Toolchain
from kcache_server.errors import QuotaExceededError
from kcache_server.fairness import current_caller
from kcache_server.models import artifacts_table as _artifacts
from kcache_server.models import compile_charges_table as _charges
from kcache_server.models import quota_accounts_table as _accounts
from kcache_server.models import quota_reservations_table as _reservations
from kcache_server.models import utcnow

__all__ = ["QuotaCompiler", "Reservation", "charged_bytes_of", "stored_bytes_of"]

log = logging.getLogger(__name__)


#: How often a compile waiting for room asks the database again (other replicas settle).
_POLL_S = 0.25


def stored_bytes_of(db: sa.Engine, caller: str) -> int:
    """Bytes of stored artifacts whose compile ``caller`` caused."""
    query = (
        sa.select(sa.func.coalesce(sa.func.sum(_charges.c.size), 0))
        .select_from(_charges.join(_artifacts, _artifacts.c.digest == _charges.c.digest))
        .where(_charges.c.caller == caller)
    )
    with db.connect() as conn:
        return int(conn.execute(query).scalar_one())


def _used_query(caller: str, pending_since: Any) -> sa.Select[Any]:
    """The caller's used bytes: charges of stored artifacts, and young ones about to be stored."""
    return (
        sa.select(sa.func.coalesce(sa.func.sum(_charges.c.size), 0))
        .select_from(_charges.outerjoin(_artifacts, _artifacts.c.digest == _charges.c.digest))
        .where(
            _charges.c.caller == caller,
            sa.or_(_artifacts.c.digest.is_not(None), _charges.c.created_at > pending_since),
        )
    )


def charged_bytes_of(db: sa.Engine, caller: str, hold_s: float) -> int:
    """What counts against ``caller``'s quota now: stored charges, and pending ones younger than ``hold_s``."""
    with db.connect() as conn:
        return int(
            conn.execute(_used_query(caller, utcnow() - timedelta(seconds=hold_s))).scalar_one()
        )


@dataclass(frozen=True)
class Reservation:
    """Bytes promised to one compile of ``caller`` (a row of ``quota_reservations``)."""

    id: int
    caller: str
    size: int


@dataclass(frozen=True)
class _Room:
    """A caller's account as one locked transaction read it."""

    used: int
    reserved: int
    pending: int  # unexpired reservations

    def left(self, quota: int) -> int:
        return quota - self.used - self.reserved


class QuotaCompiler:
    """A :class:`~kcache.compilers.Compiler` that charges and limits each caller; see the module docstring.

    ``hold_s`` (how long a reservation, and a charge whose artifact row is not
    written yet, count) and ``wait_s`` (how long a compile waits for room its
    caller's other compiles hold) default from the inner compiler's time limits
    (``timeout_s``, ``queue_timeout_s``) where it has them.
    """

    def __init__(
        self,
        inner: Compiler,
        db: sa.Engine,
        *,
        quota_bytes: int | None,
        max_artifact_bytes: int | None,
        hold_s: float | None = None,
        wait_s: float | None = None,
        poll_s: float = _POLL_S,
    ) -> None:
        self.inner = inner
        self.toolchain: Toolchain = inner.toolchain
        self.include_sets: IncludeSets = inner.include_sets
        self.db = db
        self.quota_bytes = quota_bytes or None
        self.max_artifact_bytes = max_artifact_bytes
        compile_s = float(getattr(inner, "timeout_s", 120.0))
        queue_s = float(getattr(inner, "queue_timeout_s", 300.0))
        # A compile may be tried twice (a spoiled worker), each queued then run.
        self.hold_s = hold_s if hold_s is not None else 2 * (compile_s + queue_s) + 60.0
        self.wait_s = wait_s if wait_s is not None else queue_s
        self.poll_s = poll_s
        self._insert: Any = postgresql.insert if db.dialect.name == "postgresql" else sqlite.insert
        # Bumped whenever this process settles or releases a reservation: its waiters wake.
        self._changed = threading.Condition()
        self._generation = 0

    # ------------------------------------------------------------------ the compiler
    def compile(self, recipe: Recipe, link_inputs: Sequence[bytes] = ()) -> CompileOutput:
        """Reserve room (or refuse), compile, then settle the reservation to the output's size."""
        caller = current_caller.get()
        if not caller:
            return self.inner.compile(recipe, link_inputs)
        if self.quota_bytes is None:
            output = self.inner.compile(recipe, link_inputs)
            if not self._too_large(output):
                self._charge_unlimited(caller, output)
            return output
        reservation = self.reserve(caller)
        try:
            output = self.inner.compile(recipe, link_inputs)
        except BaseException:
            self.release(reservation)
            raise
        if self._too_large(output):
            self.release(reservation)  # the engine refuses it as too large; never stored
            return output
        self.settle(reservation, output.data)
        return output

    def _too_large(self, output: CompileOutput) -> bool:
        return self.max_artifact_bytes is not None and len(output.data) > self.max_artifact_bytes

    def _charge_unlimited(self, caller: str, output: CompileOutput) -> None:
        with self.db.begin() as conn:
            conn.execute(
                self._insert(_charges)
                .values(
                    digest=hashlib.sha256(output.data).hexdigest(),
                    caller=caller,
                    size=len(output.data),
                    created_at=utcnow(),
                )
                .on_conflict_do_nothing(index_elements=["digest"])
            )

    # ------------------------------------------------------------------ reservations
    @property
    def bound(self) -> int:
        """The most one compile reserves: ``max_artifact_bytes``, or the quota without a size limit."""
        quota = self.quota_bytes or 0
        return min(quota, self.max_artifact_bytes) if self.max_artifact_bytes else quota

    def reserve(self, caller: str) -> Reservation:
        """Reserve room for one compile of ``caller``, waiting for its pending ones if need be.

        Raises :class:`QuotaExceededError` when there is no room and none is pending,
        or when pending compiles still hold the rest after ``wait_s``.
        """
        quota = self.quota_bytes or 0
        deadline = time.monotonic() + self.wait_s
        while True:
            generation = self._generation
            reserved, room = self._try_reserve(caller, quota)
            if reserved is not None:
                return reserved
            if room.pending == 0 or room.used >= quota:
                raise QuotaExceededError(self._refusal(caller, room.used, None))
            left = deadline - time.monotonic()
            if left <= 0:
                raise QuotaExceededError(self._refusal(caller, room.used, None, room.reserved))
            with self._changed:
                if self._generation == generation:
                    self._changed.wait(min(self.poll_s, left))

    def _lock(self, conn: sa.Connection, caller: str, now: Any) -> None:
        """Lock ``caller``'s account row until the transaction ends (created on first use).

        The first statement of the transaction and a write: on PostgreSQL it takes the
        row's lock (a second transaction waits for the first to commit, then reads what
        it wrote), on SQLite the database's write lock.
        """
        conn.execute(
            self._insert(_accounts)
            .values(caller=caller, touched_at=now)
            .on_conflict_do_update(index_elements=["caller"], set_={"touched_at": now})
        )

    def _room(
        self, conn: sa.Connection, caller: str, now: Any, *, skip: int | None = None
    ) -> _Room:
        used = int(
            conn.execute(_used_query(caller, now - timedelta(seconds=self.hold_s))).scalar_one()
        )
        live = [_reservations.c.caller == caller, _reservations.c.expires_at > now]
        if skip is not None:
            live.append(_reservations.c.id != skip)
        reserved, pending = conn.execute(
            sa.select(
                sa.func.coalesce(sa.func.sum(_reservations.c.size), 0), sa.func.count()
            ).where(*live)
        ).one()
        return _Room(used, int(reserved), int(pending))

    def _try_reserve(self, caller: str, quota: int) -> tuple[Reservation | None, _Room]:
        with self.db.begin() as conn:
            now = utcnow()
            self._lock(conn, caller, now)
            conn.execute(
                sa.delete(_reservations).where(
                    _reservations.c.caller == caller, _reservations.c.expires_at <= now
                )
            )
            room = self._room(conn, caller, now)
            left = room.left(quota)
            if left <= 0:
                return None, room
            size = min(left, self.bound)
            rid = conn.execute(
                sa.insert(_reservations)
                .values(
                    caller=caller,
                    size=size,
                    created_at=now,
                    expires_at=now + timedelta(seconds=self.hold_s),
                )
                .returning(_reservations.c.id)
            ).scalar_one()
        return Reservation(int(rid), caller, size), room

    def release(self, reservation: Reservation) -> None:
        """Give a reservation back (the compile failed); never raises (it expires anyway)."""
        try:
            with self.db.begin() as conn:
                conn.execute(sa.delete(_reservations).where(_reservations.c.id == reservation.id))
        except Exception:
            log.warning(
                "could not release a quota reservation of %s (%d bytes); it expires in %gs",
                reservation.caller,
                reservation.size,
                self.hold_s,
                exc_info=True,
            )
        self._wake()

    def settle(self, reservation: Reservation, data: bytes) -> None:
        """Turn ``reservation`` into the charge for ``data``, or refuse it (see the module docstring)."""
        caller, size = reservation.caller, len(data)
        digest = hashlib.sha256(data).hexdigest()
        quota = self.quota_bytes or 0
        refused: int | None = None  # the used bytes the refusal names
        try:
            with self.db.begin() as conn:
                now = utcnow()
                self._lock(conn, caller, now)
                held = conn.execute(
                    sa.delete(_reservations)
                    .where(_reservations.c.id == reservation.id)
                    .returning(_reservations.c.size)
                ).scalar_one_or_none()
                stored = self._stored(conn, digest)
                charged_at = conn.execute(
                    sa.select(_charges.c.created_at).where(_charges.c.digest == digest)
                ).scalar_one_or_none()
                if charged_at is not None:
                    if stored or charged_at > now - timedelta(seconds=self.hold_s):
                        return  # someone was charged for these bytes already
                    # A charge whose publish failed long ago: these bytes are this caller's now.
                    conn.execute(sa.delete(_charges).where(_charges.c.digest == digest))
                if held is not None and size <= int(held):
                    fits = True
                else:  # larger than promised (or the promise expired): what is left now?
                    room = self._room(conn, caller, now, skip=reservation.id)
                    fits = room.used + room.reserved + size <= quota
                    if not fits:
                        refused = room.used
                if fits:
                    conn.execute(
                        self._insert(_charges)
                        .values(digest=digest, caller=caller, size=size, created_at=now)
                        .on_conflict_do_nothing(index_elements=["digest"])
                    )
                elif stored:
                    refused = None  # stored already: costs nothing more, not charged
        finally:
            self._wake()
        if refused is not None:
            raise QuotaExceededError(self._refusal(caller, refused, size))

    def _wake(self) -> None:
        with self._changed:
            self._generation += 1
            self._changed.notify_all()

    @staticmethod
    def _stored(conn: sa.Connection, digest: str) -> bool:
        found = conn.execute(
            sa.select(_artifacts.c.digest).where(_artifacts.c.digest == digest)
        ).first()
        return found is not None

    def _refusal(self, caller: str, used: int, size: int | None, pending: int | None = None) -> str:
        quota = format_size(self.quota_bytes or 0)
        who = caller.replace("token:", "token ", 1).replace("client:", "client ", 1)
        if pending is not None:
            what = (
                f"and its compiles in progress hold the other {format_size(pending)} of its quota of "
                f"{quota} (token_quota_bytes); none of them finished within {self.wait_s:g}s, so "
                "nothing was compiled. Retry when they are done"
            )
        elif size is None:
            what = f"at its quota of {quota} (token_quota_bytes), so nothing was compiled"
        else:
            what = (
                f"and this compile's {format_size(size)} would take it past its quota of {quota} "
                "(token_quota_bytes), so nothing was stored"
            )
        return (
            f"{who} has {format_size(used)} of artifacts it caused to be compiled in the store, {what}. "
            "They count until they are evicted or removed (kcache cache rm --server); ask an "
            "operator to raise the quota"
        )
