"""The collective operations a warmup needs, and how they run under ``torch.distributed``.

A warmup needs only two collectives: an all-gather (every rank's concrete recipes)
and a broadcast from the leader (the outcomes; it doubles as the barrier). Any
object with those two methods, a ``rank`` and a ``world_size`` will do, so jobs
on MPI or a custom launcher can plug in their own.

Under ``torch.distributed`` both run over the job's key-value store (the TCPStore
that ``init_process_group`` rendezvoused through), never over a process group:

* No group is created. ``new_group`` is collective over the whole job unless
  ``use_local_synchronization`` is set, and torch names such a local group after its
  ranks and the number of groups the process holds at that moment: a side group made
  again after the previous one was destroyed gets the same name, and its rendezvous
  reads the dead group's peer addresses from the store (issue 18: "Connection
  refused", or a hang); members holding different numbers of groups never meet at
  all. Without groups there is nothing to create at different times on different
  ranks, nothing to tear down, and the main backend (NCCL or gloo) is never touched.
* Every call has keys of its own, ``kcache/collective/<ranks>/<run>/<n>/``: ``n``
  counts the calls this rank has made over that set of ranks, and every member makes
  the same calls in the same order (that is what a collective is), so all agree on
  ``n`` without talking. WORLD and ``None`` are the same set of ranks and share the
  count. ``<run>`` names the job run (issue 30), so that nothing a previous job or a
  crashed attempt left in a long-lived store can decide a call of this one:
  torchrun's ``TORCHELASTIC_RUN_ID`` when it is set, else a nonce the members agree
  on at their first call through a *join* (:mod:`~kcache_client._store_session`, which
  keeps a member's count and run between calls, describes it).
* Every call ends the same way on every member. Its outcome is written once, with
  a compare-and-set on the call's ``verdict`` key: by the last member to arrive (an
  all-gather is complete), by the source (a broadcast's value), or by a member whose
  wait ran out (an error naming the ranks that did not arrive). The first write wins
  and every member, however late, reads that one verdict. A verdict of failure is a
  :class:`~kcache_client.errors.WarmupTimeoutError` raised identically everywhere;
  one that no kcache client wrote (garbage in the store) is reported as a malformed
  verdict, with its key, on every member that reads it.
* Every wait is bounded by the timeout, counted from this member's own arrival. If
  the store itself stops answering (its host died: rank 0 under a ``tcp://`` or
  ``env://`` rendezvous), no verdict can be shared; each member then raises the same
  error naming the store, made from the call alone so it reads alike on every rank.
  A member whose join nobody answers in time raises the error of the first member's
  absence, and leaves it for a first member arriving later to raise too
  (:mod:`~kcache_client._store_session`). Join keys are deleted after the first call
  that succeeds, call keys by the last member to leave each call.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

from kcache_client._store_session import StoreSession
from kcache_client.errors import WarmupError, WarmupTimeoutError

__all__ = ["Collective", "StoreCollective", "TorchCollective", "as_collective"]

_T = TypeVar("_T")

#: The verdict of a complete all-gather (the values are in the members' own keys).
_COMPLETE = '{"ok":null}'
#: Members named in full in an error message; more are summarised.
_NAMED_RANKS = 16
#: The launcher's name for the job run: every rank of a torchrun job has the same one.
RUN_ID_VARIABLE = "TORCHELASTIC_RUN_ID"


@runtime_checkable
class Collective(Protocol):
    """Object collectives over a group of processes. Every call is made by every member.

    Implementations bound their waits: a member that never arrives makes the others
    raise instead of hanging, and every member of a call should see the same end of
    it (all return, or all raise the same error).
    """

    @property
    def rank(self) -> int:
        """This process's rank in the group (0-based)."""
        ...

    @property
    def world_size(self) -> int:
        """How many processes the group has."""
        ...

    def all_gather(self, obj: Any) -> list[Any]:
        """Every member's ``obj`` (JSON-able data), indexed by rank."""
        ...

    def broadcast(self, obj: Any, src: int) -> Any:
        """Rank ``src``'s ``obj``; the others pass anything (ignored)."""
        ...


class StoreCollective:
    """A :class:`Collective` over a c10d key-value store (``TCPStore``, ``FileStore``, ...).

    ``rank`` and ``world_size`` are this member's place in the group; ``job_ranks``
    names the members in messages (torch's global ranks; default ``0..world_size-1``)
    and, with the member's rank, keys the call count, so every distinct set of ranks
    has calls of its own (per store). ``timeout`` bounds each wait, in seconds.
    ``run`` names the job run (every member must be given the same; torchrun's run
    id): None has the members agree on a nonce at their first call (a join). The
    module docstring describes the protocol.
    """

    def __init__(
        self,
        store: Any,
        *,
        rank: int,
        world_size: int,
        timeout: float,
        job_ranks: Sequence[int] | None = None,
        run: str | None = None,
    ) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a group of {world_size}")
        if timeout <= 0:
            raise ValueError(f"the timeout must be positive, not {timeout}")
        names = list(job_ranks) if job_ranks is not None else list(range(world_size))
        if len(names) != world_size:
            raise ValueError(f"job_ranks names {len(names)} members, the group has {world_size}")
        self._store = store
        self._rank = rank
        self._world_size = world_size
        self._timeout = float(timeout)
        self._names = names
        digest = hashlib.sha256(",".join(map(str, names)).encode()).hexdigest()[:20]
        group = f"kcache/collective/{digest}/"
        self._session = StoreSession.of(store, group, run, rank, world_size)

    @property
    def rank(self) -> int:
        """This process's rank within the group."""
        return self._rank

    @property
    def world_size(self) -> int:
        """The group's size."""
        return self._world_size

    @property
    def store(self) -> Any:
        """The key-value store the calls run over (a fan-out meets its side group there)."""
        return self._store

    @property
    def job_ranks(self) -> list[int]:
        """The members as the job numbers them (torch's global ranks), by group rank."""
        return list(self._names)

    def call_prefix(self, number: int) -> str | None:
        """The store keys of this member's call ``number`` (0-based), once its run is known."""
        return self._session.call_prefix(number)

    # ------------------------------------------------------------------ collectives
    def all_gather(self, obj: Any) -> list[Any]:
        """Every member's JSON-able ``obj``, indexed by group rank."""
        data = _encode(obj)  # outside the guard: data that is not JSON is the caller's error
        number, what = self._begin("all-gather")
        deadline = time.monotonic() + self._timeout

        def run() -> list[Any]:
            prefix = self._enter(number, what, deadline, source=None)
            parts = [f"{prefix}part/{m}" for m in range(self._world_size)]
            self._store.set(parts[self._rank], data)
            if int(self._store.add(f"{prefix}arrived", 1)) == self._world_size:
                # The last to arrive declares the gather complete, unless a member
                # whose wait ran out has already declared it failed.
                verdict = self._decide(prefix, _COMPLETE, what)
            else:
                verdict = self._await_verdict(
                    prefix, deadline, what, lambda: self._gather_failed(parts, what)
                )
            try:
                values = (
                    []
                    if "error" in verdict
                    else [self._part(k, m, what) for m, k in enumerate(parts)]
                )
            finally:
                self._finish(prefix, parts, verdict)
            self._raise_if_failed(verdict)
            return values

        return self._guard(run, what)

    def broadcast(self, obj: Any, src: int) -> Any:
        """Group rank ``src``'s JSON-able ``obj``; the others' ``obj`` is ignored."""
        if not 0 <= src < self._world_size:
            raise ValueError(f"broadcast source {src} is not in a group of {self._world_size}")
        value = _encode({"ok": obj}).decode() if self._rank == src else ""
        number, what = self._begin("broadcast")
        deadline = time.monotonic() + self._timeout

        def run() -> Any:
            prefix = self._enter(number, what, deadline, source=src)
            if self._rank == src:
                verdict = self._decide(prefix, value, what)
            else:
                verdict = self._await_verdict(
                    prefix, deadline, what, lambda: self._source_failed(src, what)
                )
            self._finish(prefix, [], verdict)
            self._raise_if_failed(verdict)
            return verdict["ok"]

        return self._guard(run, what)

    # ------------------------------------------------------------------ protocol
    def _begin(self, op: str) -> tuple[int, str]:
        """This call's number and a description of it that reads alike on every member."""
        number = next(self._session.calls)
        return number, f"{op} #{number + 1} over ranks {_describe(self._names)}"

    def _enter(self, number: int, what: str, deadline: float, source: int | None) -> str:
        """This call's key prefix, after the join when this member has no run yet."""
        session = self._session
        if session.run is None and self._rank == 0:
            given_up = session.host_join(deadline)
            if given_up is not None:  # members gave up on this one: their verdict is the call's
                prefix = session.call_prefix(number)
                assert prefix is not None, "the run was just drawn"
                verdict = self._decide(prefix, given_up, what)
                self._finish(prefix, [], verdict)
                self._raise_if_failed(verdict)
        elif session.run is None:
            given_up = session.member_join(
                number,
                deadline,
                self._names_me,
                lambda: self._source_failed(0, what) if source == 0 else self._absent([0], what),
            )
            if given_up is not None:
                self._raise_if_failed(json.loads(given_up))
        prefix = self.call_prefix(number)
        assert prefix is not None, "a run after the join"
        return prefix

    def _decide(self, prefix: str, proposal: str, what: str) -> dict[str, Any]:
        """Propose a verdict (JSON text); the first proposal made for this call wins and is returned."""
        key = f"{prefix}verdict"
        return self._verdict(bytes(self._store.compare_set(key, "", proposal)), key, what)

    def _await_verdict(
        self, prefix: str, deadline: float, what: str, failure: Callable[[], str]
    ) -> dict[str, Any]:
        """The call's verdict once someone writes it; at the deadline, ``failure()`` is proposed."""
        key = f"{prefix}verdict"
        if not self._session.poll(lambda: bool(self._store.check([key])), deadline):
            return self._decide(prefix, failure(), what)
        return self._verdict(bytes(self._store.get(key)), key, what)

    def _gather_failed(self, parts: list[str], what: str) -> str:
        """The verdict of a member whose all-gather wait ran out."""
        missing = [m for m, key in enumerate(parts) if not self._store.check([key])]
        if not missing:  # everyone arrived just now: the gather is complete after all
            return _COMPLETE
        return self._absent(missing, what)

    def _absent(self, missing: list[int], what: str) -> str:
        names = [self._names[m] for m in missing]
        error = WarmupTimeoutError(
            f"warmup: {_ranks_phrase(names)} did not reach the {what} within "
            f"{self._timeout:g}s of the others: "
            f"{'it' if len(names) == 1 else 'they'} died, hung, or arrived too late",
            kind="CollectiveTimeout",
            leader=missing[0],
            missing_ranks=names,
        )
        return _encode({"error": error.to_dict()}).decode()

    def _source_failed(self, src: int, what: str) -> str:
        """The verdict of a member whose wait for a broadcast's source ran out."""
        error = WarmupTimeoutError(
            f"warmup: rank {self._names[src]} sent nothing in the {what} within "
            f"{self._timeout:g}s: it died, hung, or took longer than the timeout",
            kind="CollectiveTimeout",
            leader=src,
            missing_ranks=[self._names[src]],
        )
        return _encode({"error": error.to_dict()}).decode()

    def _verdict(self, raw: bytes, key: str, what: str) -> dict[str, Any]:
        """A verdict read from the store, checked: malformed ones raise the same error everywhere."""
        try:
            value = json.loads(raw)
        except ValueError:
            value = None
        if isinstance(value, dict) and ("ok" in value or _error_of(value) is not None):
            return value
        raise WarmupError(
            f"warmup: malformed verdict {_preview(raw)} for the {what} in the store "
            f"(key {key!r}): no kcache client wrote it",
            kind="MalformedVerdict",
        )

    def _part(self, key: str, member: int, what: str) -> Any:
        raw = bytes(self._store.get(key))
        try:
            return _decode(raw)
        except ValueError:
            raise WarmupError(
                f"warmup: malformed part of rank {self._names[member]} {_preview(raw)} for the "
                f"{what} in the store (key {key!r})",
                kind="MalformedVerdict",
                leader=member,
            ) from None

    @staticmethod
    def _raise_if_failed(verdict: dict[str, Any]) -> None:
        error = _error_of(verdict)
        if error is not None:
            raise error

    def _finish(self, prefix: str, keys: list[str], verdict: dict[str, Any]) -> None:
        """Leave a call: after a success, once every member has its result; then tidy up.

        Waiting for the others (bounded) keeps this process, which may host the store,
        from ending the job while a member has yet to read the verdict: a warmup-only
        job whose rank 0 returned first would otherwise strand the rest. After a
        failure nobody waits, since a member may be dead. The last member to leave
        deletes the call's keys, so a long job's store stays small, and after the
        first call that succeeded, the join's.
        """
        succeeded = "error" not in verdict
        tidy = succeeded and self._session.tidy
        try:
            if succeeded:
                self._store.add(f"{prefix}done", 1)
                self._session.poll(
                    lambda: int(self._store.add(f"{prefix}done", 0)) >= self._world_size,
                    time.monotonic() + self._timeout,
                )
                # Every member is done, so every member joined: nobody is left to answer.
                self._session.host = None
                self._session.tidy = False
            if int(self._store.add(f"{prefix}left", 1)) != self._world_size:
                return
            own = [f"{prefix}{name}" for name in ("arrived", "verdict", "done", "left")]
            for key in [*keys, *own, *(self._session.join_keys() if tidy else [])]:
                self._store.delete_key(key)
        except Exception:  # the call's outcome is settled; only the courtesy wait or tidying failed
            pass

    def _guard(self, run: Callable[[], _T], what: str) -> _T:
        """Run one call; the store failing under it becomes the same error on every member."""
        try:
            return run()
        except WarmupError:  # the call's verdict (a TimeoutError, so an OSError: caught first)
            raise
        except (RuntimeError, OSError) as exc:  # torch's DistError and DistNetworkError among them
            # Nothing rank-specific in the message (the cause is chained): every member
            # that loses the store in this call raises the same words.
            raise WarmupTimeoutError(
                f"warmup: the job's key-value store stopped answering during the {what}; "
                "the process hosting it (rank 0, or the launcher's agent under torchrun) "
                "has probably died",
                kind=type(exc).__name__,
            ) from exc

    def _names_me(self, key: str) -> bool:
        """Whether the verdict at ``key`` is a failure that names this member as missing."""
        raw = self._session.read(key)
        if raw is None:
            return False
        try:
            error = _error_of(json.loads(raw))
        except ValueError:
            return False
        return error is not None and self._names[self._rank] in error.missing_ranks


class TorchCollective(StoreCollective):
    """A :class:`Collective` for a ``torch.distributed`` process group (None: the default one).

    It runs over the job's default store (see the module docstring), so it works
    under any main backend, creates no process group, and costs nothing to make: a
    warmup builds one per call. Members are named by their global ranks; the run is
    torchrun's ``TORCHELASTIC_RUN_ID`` when set, else agreed at the first call.
    """

    def __init__(self, group: Any = None, *, timeout: float = 1800.0) -> None:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised: call init_process_group first"
            )
        parent = group if group is not None else dist.group.WORLD
        ranks = [int(r) for r in dist.get_process_group_ranks(parent)]
        me = int(dist.get_rank())
        if me not in ranks:
            raise ValueError(
                f"rank {me} is not a member of the warmup's group (ranks {_describe(ranks)}); "
                "only the group's members call warmup with it"
            )
        super().__init__(
            distributed_c10d._get_default_store(),
            rank=ranks.index(me),
            world_size=len(ranks),
            timeout=timeout,
            job_ranks=ranks,
            run=os.environ.get(RUN_ID_VARIABLE) or None,
        )


def _error_of(verdict: Any) -> WarmupError | None:
    """The error a verdict (or a verdict-like dict) carries, or None if it carries none or a malformed one."""
    if not isinstance(verdict, dict):
        return None
    data = verdict.get("error")
    if not isinstance(data, dict) or not isinstance(data.get("message"), str):
        return None
    try:
        return WarmupError.from_dict(data)
    except (KeyError, TypeError, ValueError):
        return None


def _preview(raw: bytes) -> str:
    """A short, printable rendering of bytes from the store, for a message."""
    text = repr(raw[:60])
    return text + ("..." if len(raw) > 60 else "")


def _encode(obj: Any) -> bytes:
    # JSON, not pickle: what a warmup exchanges is plain data, and unpickling what
    # another process sent would let any rank run code in every other one.
    return json.dumps(obj, separators=(",", ":")).encode()


def _decode(data: bytes) -> Any:
    return json.loads(data) if data else None


def _describe(ranks: Sequence[int]) -> str:
    """``[0, 1, 2]``, or ``[0, 1, ..., 1023] (1024 ranks)`` for a large group."""
    if len(ranks) <= _NAMED_RANKS:
        return "[" + ", ".join(map(str, ranks)) + "]"
    head = ", ".join(map(str, ranks[: _NAMED_RANKS - 1]))
    return f"[{head}, ..., {ranks[-1]}] ({len(ranks)} ranks)"


def _ranks_phrase(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {_describe(ranks)}"


def as_collective(group: Any, *, timeout: float) -> Collective | None:
    """``group`` as a Collective: as it is, a torch process group, or torch's world; None alone.

    With ``group=None`` the default torch process group is used when one is
    initialised, so ``cache.warmup(recipes)`` in a torchrun job does the right thing.
    """
    if group is not None and isinstance(group, Collective):
        return group
    dist = sys.modules.get("torch.distributed")
    if group is None:
        if dist is None or not dist.is_available() or not dist.is_initialized():
            return None
        if dist.get_world_size() == 1:
            return None
    return TorchCollective(group, timeout=timeout)
