"""Fairness between callers: who is calling, a round-robin hand-out of compile workers, thread shares.

A caller is a token (by name) or, on an open server, a client address. One caller
flooding the server with compiles must not starve another, so:

- :data:`current_caller` carries the caller's identity from the request's
  authentication down to the compile pool (a context variable: the engine between
  them knows nothing about HTTP; threads started by anyio copy the context);
- :class:`FairQueue` hands idle workers to waiting callers in turn, lets one caller
  hold at most ``per_caller`` workers at once and queue at most
  ``per_caller_queue`` more, and bounds every wait;
- :class:`CallerSlots` caps the request threads one caller occupies at once, so
  requests parked on a lock (identical compiles waiting for the first) cannot take
  every thread.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Generic, TypeVar

import anyio

from kcache_server.errors import CompilerUnavailableError, OverloadedError

__all__ = ["CallerSlots", "FairQueue", "caller_identity", "current_caller"]

T = TypeVar("T")

#: The caller the current request works for ("" outside a request: maintenance, tests).
current_caller: ContextVar[str] = ContextVar("kcache_caller", default="")


def caller_identity(token_name: str | None, client_host: str | None) -> str:
    """``token:<name>``, or ``client:<address>`` on an open server (no tokens)."""
    if token_name is not None:
        return f"token:{token_name}"
    return f"client:{client_host or 'unknown'}"


@dataclass(eq=False)
class _Ticket(Generic[T]):
    caller: str
    item: T | None = None


class FairQueue(Generic[T]):
    """Idle items (compile workers) handed to waiting callers round-robin, with per-caller caps.

    ``per_caller``: items one caller may hold at once; ``per_caller_queue``: how many
    more it may have waiting; ``total``: the most requests held or waiting overall
    (``total_setting`` names the settings behind it, for the refusal's message).
    Past a cap a request is refused at once with :class:`OverloadedError` (503).
    """

    def __init__(
        self,
        *,
        per_caller: int,
        per_caller_queue: int,
        total: int,
        total_setting: str = "",
        retry_after_s: int = 5,
    ) -> None:
        self.per_caller = max(1, per_caller)
        self.per_caller_queue = max(0, per_caller_queue)
        self.total = total
        self.total_setting = total_setting  # names the settings behind ``total``, for messages
        self.retry_after_s = retry_after_s
        self._cond = threading.Condition()
        self._idle: deque[T] = deque()
        self._waiting: dict[str, deque[_Ticket[T]]] = {}  # callers in the order they began waiting
        self._held: Counter[str] = Counter()
        # When each active caller (holding or waiting) was last handed an item: the one
        # served longest ago (or never) goes next, so turns alternate between callers.
        self._served: dict[str, int] = {}
        self._clock = 0

    # ------------------------------------------------------------------ items
    def put(self, item: T) -> None:
        """An item is free (a started worker, or one back from a compile)."""
        with self._cond:
            self._idle.append(item)
            self._dispatch()

    def take_idle(self, item: T) -> bool:
        """Remove ``item`` from the idle items (it died); False if it was not idle."""
        with self._cond:
            try:
                self._idle.remove(item)
            except ValueError:
                return False
            return True

    def wake(self) -> None:
        """Let waiters look at the world again (a worker failed to start, the pool closed)."""
        with self._cond:
            self._cond.notify_all()

    @property
    def idle(self) -> int:
        """Items free to be handed out."""
        with self._cond:
            return len(self._idle)

    @property
    def pending(self) -> int:
        """Requests holding or waiting for an item."""
        with self._cond:
            return self._pending()

    # ------------------------------------------------------------------ callers
    def get(self, caller: str, timeout: float, unavailable: Callable[[], str | None]) -> T:
        """Wait for an item for ``caller``, in turn with other callers.

        ``unavailable()`` is asked while waiting (under this queue's lock, so it must
        be quick and take no other lock that is held while calling this queue): a
        reason means no item can come (every worker is dead and none is starting),
        and the wait ends with :class:`CompilerUnavailableError`. A wait past
        ``timeout`` ends with :class:`OverloadedError`. Both are 503 with Retry-After.
        """
        with self._cond:
            if self._pending() >= self.total:
                raise OverloadedError(
                    f"{self._pending()} compiles are running or queued ({self.total_setting}); retry later",
                    self.retry_after_s,
                )
            mine = self._held[caller] + len(self._waiting.get(caller, ()))
            if mine >= self.per_caller + self.per_caller_queue:
                raise OverloadedError(
                    f"this caller already has {mine} compiles running or queued (compile_caller_limit="
                    f"{self.per_caller} running plus compile_caller_queue_limit={self.per_caller_queue} "
                    "waiting); retry when some have finished",
                    self.retry_after_s,
                )
            ticket: _Ticket[T] = _Ticket(caller)
            self._waiting.setdefault(caller, deque()).append(ticket)
            self._dispatch()
            deadline = time.monotonic() + timeout
            try:
                while ticket.item is None:
                    reason = unavailable()
                    if reason is not None:
                        raise CompilerUnavailableError(reason, self.retry_after_s)
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise OverloadedError(
                            f"waited {timeout:g}s for a compile worker (compile_queue_timeout_s); "
                            "the server is busy, retry later",
                            self.retry_after_s,
                        )
                    self._cond.wait(remaining)
            except BaseException:
                if ticket.item is not None:  # handed over while failing: give it back
                    self._idle.appendleft(ticket.item)
                    self._release(caller)
                else:
                    self._forget(ticket)
                self._dispatch()
                raise
            return ticket.item

    def give_back(self, caller: str, item: T | None) -> None:
        """``caller`` is done with its item; ``item`` is free again (None: it died, not returned)."""
        with self._cond:
            if item is not None:
                self._idle.append(item)
            self._release(caller)
            self._dispatch()

    # ------------------------------------------------------------------ internals (lock held)
    def _pending(self) -> int:
        return sum(self._held.values()) + sum(len(q) for q in self._waiting.values())

    def _release(self, caller: str) -> None:
        self._held[caller] -= 1
        if self._held[caller] <= 0:
            del self._held[caller]
        self._retire(caller)

    def _forget(self, ticket: _Ticket[T]) -> None:
        queue = self._waiting.get(ticket.caller)
        if queue is None:
            return
        with contextlib.suppress(ValueError):
            queue.remove(ticket)
        if not queue:
            del self._waiting[ticket.caller]
        self._retire(ticket.caller)

    def _retire(self, caller: str) -> None:
        """Forget a caller with nothing held or waiting (callers come and go; keep no state)."""
        if caller not in self._waiting and self._held[caller] <= 0:
            self._held.pop(caller, None)
            self._served.pop(caller, None)

    def _dispatch(self) -> None:
        handed = False
        while self._idle and self._waiting:
            eligible = [c for c in self._waiting if self._held[c] < self.per_caller]
            if not eligible:
                break  # every waiter is at its cap; the free items wait for someone else
            caller = min(eligible, key=lambda c: self._served.get(c, -1))  # ties: who waited first
            queue = self._waiting[caller]
            ticket = queue.popleft()
            if not queue:
                del self._waiting[caller]
            ticket.item = self._idle.popleft()
            self._held[caller] += 1
            self._clock += 1
            self._served[caller] = self._clock
            handed = True
        if handed:
            self._cond.notify_all()


class CallerSlots:
    """At most ``per_caller`` request threads per caller at once; the rest wait on the event loop.

    Waiting here costs a coroutine, not a thread, so one caller's parked requests
    (many identical compiles queued behind the first) leave threads for everyone else.
    """

    def __init__(self, per_caller: int) -> None:
        self.per_caller = max(1, per_caller)
        self._slots: dict[str, tuple[anyio.Semaphore, int]] = {}

    @contextlib.asynccontextmanager
    async def hold(self, caller: str) -> AsyncIterator[None]:
        """Hold one of ``caller``'s slots (event-loop only: no lock needed)."""
        semaphore, users = self._slots.get(caller, (None, 0))
        if semaphore is None:
            semaphore = anyio.Semaphore(self.per_caller)
        self._slots[caller] = (semaphore, users + 1)
        try:
            async with semaphore:
                yield
        finally:
            semaphore, users = self._slots[caller]
            if users <= 1:
                del self._slots[caller]  # callers come and go; keep no entry for the idle ones
            else:
                self._slots[caller] = (semaphore, users - 1)
