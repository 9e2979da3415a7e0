"""One member's session over a job's key-value store: its call count, its run, and the join.

:class:`~kcache_client._collective.StoreCollective` keys every call
``kcache/collective/<ranks>/<run>/<n>/``. What a member keeps between its calls over one
store and one set of ranks is a :class:`StoreSession`: the count ``n``, and ``<run>``,
which names the job run (issue 30), so that nothing a previous job or a crashed attempt
left in a long-lived store can decide a call of this one. The run is torchrun's
``TORCHELASTIC_RUN_ID`` when it is set (every rank of the run has it); else a nonce the
group's first member draws at its first call, which the others learn through a *join*:
each writes a token of its own under ``join/hello/<m>`` and waits for the first member to
answer ``join/welcome/<m>`` with that token and the nonce. Only an answer to a token it
drew itself is trusted, so a stale nonce or welcome is never taken; the first member
answers while it waits in its calls (:meth:`StoreSession.poll`), until every member has
acknowledged.

A member whose join nobody answers in time (the first member is absent, or late) raises
the error of the first member's absence, and leaves it under ``join/verdict`` with its
hello marked as gone, so that a first member arriving later raises it too, once it has
waited its own timeout for those members to come back (a previous job's marks are
replaced by the members of this one). A member arriving after everyone else gave up on it
takes the verdict of the call that names it, as in any other call, when every other
member's hello acknowledges that run. (Left open: with two members, a member that waited
its whole timeout for an absent first member may take a previous job's verdict naming it;
the warmup fails either way.) The join's keys are deleted after the first call that
succeeds (:meth:`StoreSession.join_keys`).
"""

from __future__ import annotations

import hashlib
import itertools
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

__all__ = ["StoreSession"]

#: Longest pause between two looks at the store while waiting: short enough that a
#: verdict is seen promptly, long enough that a thousand waiting ranks stay cheap.
_MAX_POLL_S = 0.2
#: What a member writes after its token in ``join/hello/<m>`` once it gave up waiting.
_GONE = "-"


@dataclass
class _Host:
    """The first member's side of the join: the members that have yet to acknowledge its nonce."""

    pending: set[int]
    answered: dict[int, str] = field(default_factory=dict)


#: Sessions by (store, group, run given, rank). A job that destroys and re-creates its
#: process group in the same processes has a new store, so it starts afresh.
_sessions: dict[tuple[int, str, str | None, int], StoreSession] = {}
_sessions_lock = threading.Lock()


class StoreSession:
    """One member's standing in one group over one store: its call count and its run.

    ``run`` is the call keys' run part once known, ``host`` the joins the first member
    still answers, ``tidy`` whether the join's keys may still be in the store.
    """

    def __init__(self, store: Any, group: str, rank: int, world_size: int) -> None:
        self.store = store  # held, so that its id is never reused for a new store while this lives
        self.calls: Iterator[int] = itertools.count()
        self.run: str | None = None
        self.host: _Host | None = None
        self.tidy = False
        self._group = group
        self._join = f"{group}join/"
        self._rank = rank
        self._world_size = world_size

    @classmethod
    def of(
        cls, store: Any, group: str, run: str | None, rank: int, world_size: int
    ) -> StoreSession:
        """Member ``rank``'s session in ``group`` (the keys' prefix) over ``store``, made at
        its first call; ``run`` names the job run (None: the members join at their first call)."""
        with _sessions_lock:
            session = _sessions.setdefault(
                (id(store), group, run, rank), cls(store, group, rank, world_size)
            )
        if run is not None and session.run is None:
            session.run = "run-" + hashlib.sha256(run.encode()).hexdigest()[:20]
        return session

    def call_prefix(self, number: int) -> str | None:
        """The store keys of this member's call ``number`` (0-based), once its run is known."""
        return None if self.run is None else f"{self._group}{self.run}/{number}/"

    def poll(self, ready: Callable[[], bool], deadline: float) -> bool:
        """Whether ``ready()`` became true before ``deadline``, looking with growing pauses.

        The first member answers the joins still pending each time it looks.
        """
        pause = 0.002
        while True:
            self._answer_joins()
            if ready():
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            # Short sleeps rather than store.wait(): a Python sleep lets Ctrl-C through,
            # and the store's own timed wait logs a warning every time it runs out.
            time.sleep(min(pause, left))
            pause = min(pause * 2, _MAX_POLL_S)

    def read(self, key: str) -> str | None:
        """A key's text, or None when it is absent (``get`` would wait for it)."""
        if not self.store.check([key]):
            return None
        return bytes(self.store.get(key)).decode("utf-8", "replace")

    def join_keys(self) -> list[str]:
        """The join's keys in the store (the last member to leave a call deletes them)."""
        members = range(1, self._world_size)
        return [
            f"{self._join}run",
            f"{self._join}verdict",
            *(f"{self._join}hello/{m}" for m in members),
            *(f"{self._join}welcome/{m}" for m in members),
        ]

    # ------------------------------------------------------------------ the first member
    def host_join(self, deadline: float) -> str | None:
        """The first member draws the run's nonce and starts answering the others' joins;
        the verdict members left when they gave up on it, if it still stands at ``deadline``
        (the caller raises it, and writes it as the call's).

        If members gave up on it already (a ``join/verdict``, their hellos marked as
        gone), it waits, answering, for them to come back: marks a previous job left are
        replaced by this job's members as they arrive. Marks still there at its deadline
        are this job's.
        """
        run = "nonce-" + secrets.token_hex(10)
        self.store.set(f"{self._join}run", run)
        self.run = run
        self.tidy = True
        self.host = _Host(pending=set(range(1, self._world_size)))
        given_up = self.read(f"{self._join}verdict")
        if given_up is None:
            return None
        back = self.poll(lambda: not self._gone(), deadline)
        # A previous job's (stale), or taken: a later give-up writes afresh.
        self.store.delete_key(f"{self._join}verdict")
        return None if back else given_up

    def _gone(self) -> list[int]:
        """The members whose hello says they gave up on the join (as last looked)."""
        host = self.host
        if host is None:
            return []
        return [m for m, hello in host.answered.items() if hello.endswith(f" {_GONE}")]

    def _answer_joins(self) -> None:
        """The first member answers every pending hello with the run's nonce (each once)."""
        host = self.host
        run = self.run
        if host is None or run is None:
            return
        for member in sorted(host.pending):
            hello = self.read(f"{self._join}hello/{member}")
            if hello is None or host.answered.get(member) == hello:
                continue
            host.answered[member] = hello
            token, _, said = hello.partition(" ")
            if said == run:  # acknowledged: this member is in
                host.pending.discard(member)
            elif said == "" and token:
                self.store.set(f"{self._join}welcome/{member}", f"{token} {run}")
        if not host.pending:
            self.host = None

    # ------------------------------------------------------------------ the other members
    def member_join(
        self,
        number: int,
        deadline: float,
        names_me: Callable[[str], bool],
        give_up: Callable[[], str],
    ) -> str | None:
        """A member learns the run's nonce from the first member's answer to a token of its
        own: None once it has; else the verdict ``give_up()`` makes, left under
        ``join/verdict`` (the caller raises it).

        ``names_me(key)``: whether the verdict at ``key`` is a failure naming this member
        as missing (one that arrived after the others gave up on it).
        """
        token = secrets.token_hex(10)
        hello = f"{self._join}hello/{self._rank}"
        self.store.set(hello, token)
        answer: list[str] = []

        def welcomed() -> bool:
            said = self.read(f"{self._join}welcome/{self._rank}")
            if said is None:
                return False
            got, _, run = said.partition(" ")
            if got != token or not run:
                return False  # a stale answer, to a token this member never drew
            answer.append(run)
            return True

        if self.poll(welcomed, deadline):
            self._joined(answer[-1], hello, token)
            return None
        # Nobody answered in time. A member this late may be the one a verdict names: it
        # takes that verdict when the run is this job's, as far as the store can tell
        # (every other member's current hello acknowledges it: a previous job's are
        # overwritten by this job's members as they arrive).
        run = self.read(f"{self._join}run")
        if (
            run is not None
            and self._acknowledged_by_the_others(run)
            and names_me(f"{self._group}{run}/{number}/verdict")
        ):
            self._joined(run, hello, token)
            return None
        self.store.set(hello, f"{token} {_GONE}")
        given_up = give_up()
        self.store.set(f"{self._join}verdict", given_up)
        return given_up

    def _joined(self, run: str, hello: str, token: str) -> None:
        self.run = run
        self.tidy = True
        self.store.set(hello, f"{token} {run}")  # the acknowledgement: no more answers needed

    def _acknowledged_by_the_others(self, run: str) -> bool:
        """Whether every member but the first and this one says, in its hello, it joined ``run``."""
        for member in range(1, self._world_size):
            if member == self._rank:
                continue
            said = (self.read(f"{self._join}hello/{member}") or "").partition(" ")[2]
            if said != run:
                return False
        return True
