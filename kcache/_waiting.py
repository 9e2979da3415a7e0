"""A long call of the ``kcache`` command: a status line while it runs, and Ctrl-C at once.

Why a module of its own: NVRTC compiles in one C call, and Python runs a signal
handler only between the main thread's bytecodes. A Ctrl-C during a local compile
therefore waited for the compile to end (forever, for a template that never finishes
instantiating), and a compile of a minute printed nothing meanwhile, so the command
looked hung either way.

:func:`run_long` runs the call on a daemon thread (NVRTC, httpx and the socket reads
release the GIL) while the main thread waits on it in short slices: a Ctrl-C reaches
the main thread at once. The abandoned call cannot be stopped from Python, so the
process ends there, with ``os._exit``: the kernel lets go of every file lock it held;
a blob it was writing stays a staging file that ``kcache gc`` removes, and a compile's
trace directory in the temporary directory is left behind. While it waits, a status
line on stderr says what it is waiting for and for how long, first after
``KCACHE_PROGRESS_S`` seconds (default 5; ``0`` for never), then every three times
that, as the retry lines of a command whose server does not answer do.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import NoReturn, TypeVar

from kcache.errors import KCacheError

__all__ = ["PROGRESS_ENV", "STATUS_PREFIX", "progress_after_s", "run_long"]

T = TypeVar("T")

#: The environment variable that sets when the first status line comes (seconds; 0: never).
PROGRESS_ENV = "KCACHE_PROGRESS_S"
#: Every status line starts so (tests and scripts tell them from an error's lines).
STATUS_PREFIX = "kcache: still "
_DEFAULT_AFTER_S = 5.0
# How often the main thread looks up from waiting: the longest a Ctrl-C waits.
_SLICE_S = 0.1


def progress_after_s() -> float:
    """Seconds before the first status line (``$KCACHE_PROGRESS_S``, default 5); inf for never."""
    raw = os.environ.get(PROGRESS_ENV, "").strip()
    if not raw:
        return _DEFAULT_AFTER_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (value >= 0 and math.isfinite(value)):
        raise KCacheError(
            f"{PROGRESS_ENV}={raw!r}: give the seconds before the first status line (0: none)"
        )
    return math.inf if value == 0 else value


def run_long(call: Callable[[], T], what: str, *, status: bool = True) -> T:
    """``call()``'s result (or its exception), with status lines on stderr and a prompt Ctrl-C.

    ``what`` says what is being waited for ("compiling add.cu for sm_90"). ``status``
    False keeps only the prompt Ctrl-C (a command with a progress bar of its own).
    Off the main thread (a library calling a command) ``call`` simply runs.
    """
    if threading.current_thread() is not threading.main_thread():
        return call()
    outcome: list[T] = []
    failure: list[BaseException] = []

    def work() -> None:
        try:
            outcome.append(call())
        except BaseException as exc:  # handed to the main thread, raised there
            failure.append(exc)

    after = progress_after_s() if status else math.inf
    started = time.monotonic()
    next_line = started + after
    worker = threading.Thread(target=work, name="kcache-long-call", daemon=True)
    try:
        worker.start()
        while worker.is_alive():
            worker.join(_SLICE_S)
            now = time.monotonic()
            if worker.is_alive() and now >= next_line:
                print(
                    f"{STATUS_PREFIX}{what}: {now - started:.0f} s so far (Ctrl-C stops it)",
                    file=sys.stderr,
                    flush=True,
                )
                next_line = now + 3 * after
    except KeyboardInterrupt:
        _abandon(what)
    if failure:
        raise failure[0]
    return outcome[0]


def _abandon(what: str) -> NoReturn:
    """End the process now: the call on the other thread cannot be stopped from Python."""
    with contextlib.suppress(OSError, ValueError):  # a closed or broken stdout
        sys.stdout.flush()
    print(f"\nkcache: interrupted; stopped {what}", file=sys.stderr, flush=True)
    os._exit(130)
