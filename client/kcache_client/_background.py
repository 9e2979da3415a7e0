"""Work a caller need not wait for, done by one thread of the process, in order.

The node tier hands it what no reader of an entry waits for once the entry's alias is
written: the artifact record, the manifest entry, the size accounting (which may
evict). A rank fetching kernels one after another then goes on to its next kernel
while its last one's bookkeeping is written beside it (on the benchmark machine's
ext4 each file it creates costs 0.1-0.4 ms of CPU).

:meth:`BackgroundWork.flush` waits until everything handed over so far is done: what
reads the bookkeeping in this process (listing or evicting the tier) flushes first,
and so does closing a cache. Work left when a process ends without closing is lost,
as it would be in a crash; the tier is built for that (its module docstring). A job
that fails is logged and dropped: bookkeeping is never worth failing a fetch for.
A forked child starts with nothing pending (and a fresh lock: the parent's thread
may have held it) and starts its own thread.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections import deque
from collections.abc import Callable

__all__ = ["BackgroundWork"]

_log = logging.getLogger("kcache_client")


class BackgroundWork:
    """A queue of jobs and the daemon thread that runs them, started on the first job."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._reset()
        _ALL.add(self)

    def _reset(self) -> None:
        self._ready = threading.Condition()
        self._jobs: deque[Callable[[], object]] = deque()
        self._pending = 0  # handed over and not finished (queued, or running)
        self._started = False

    def submit(self, job: Callable[[], object]) -> None:
        """Run ``job`` soon, after every job handed over before it."""
        with self._ready:
            if not self._started:
                self._started = True
                threading.Thread(target=self._run, name=self._name, daemon=True).start()
            self._jobs.append(job)
            self._pending += 1
            self._ready.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every job handed over so far is done; False if ``timeout`` passed first."""
        with self._ready:
            return self._ready.wait_for(lambda: self._pending == 0, timeout)

    def _run(self) -> None:
        while True:
            with self._ready:
                self._ready.wait_for(lambda: bool(self._jobs))
                job = self._jobs.popleft()
            try:
                job()
            except Exception:  # bookkeeping: logged, never a failed fetch
                _log.warning(
                    "kcache: %s failed; the tier may miss a record", self._name, exc_info=True
                )
            finally:
                with self._ready:
                    self._pending -= 1
                    self._ready.notify_all()


_ALL: weakref.WeakSet[BackgroundWork] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for work in list(_ALL):
        work._reset()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
