"""``ProcessPoolCompiler``: the core ``Compiler`` seam over pre-started worker processes.

NVRTC runs in spawned processes with an address-space limit, so a runaway template
or a crashing compile costs one request, never the server: a compile past its
timeout has its worker killed (``CompileTimeoutError``), a worker that dies fails
its one request (``CompileWorkerCrashedError``), and either way a fresh worker
takes its place. So does a worker after its first failed compile: NVRTC's dependency
traces in that process may be short from then on (:mod:`kcache.nvrtc`), so the worker
answers and retires. A compile whose trace failed its checks is run once more, on
another worker. A worker that dies while idle (the OOM killer) is noticed by a
watcher thread, and again before it is handed out, and replaced; it never gets a
compile. Every death and replacement is logged.

Workers are handed to callers through a :class:`~kcache_server.fairness.FairQueue`:
in turn across callers (tokens), at most ``caller_limit`` at once per caller, with
per-caller and total queue caps (503 with Retry-After past them). Every wait for a
worker is bounded: by ``queue_timeout_s``, and at once when no worker is running or
starting (restarts keep being retried in the background, with backoff).

A compile needs scratch space: with less than ``min_free_bytes`` free there it is
refused with ``StoreFullError`` (507), and a worker that dies on a full disk (NVRTC
aborts when it cannot write its trace) is reported as that too, not as a crash.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import multiprocessing
import multiprocessing.connection
import shutil
import signal
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

from kcache.artifact import CompileOutput
from kcache.compile_replies import Reply, result_of
from kcache.errors import (
    CompileTimeoutError,
    DependencyTraceError,
    StoreFullError,
    ToolchainError,
)
from kcache.fsutil import check_free_space, free_bytes
from kcache.include_sets import IncludeSets
from kcache.recipe import Recipe
from kcache.sandbox import SandboxStatus
from kcache.toolchain import Toolchain
from kcache_server import _compile_worker
from kcache_server.errors import CannotCompileError, CompileWorkerCrashedError
from kcache_server.fairness import FairQueue, current_caller

__all__ = ["ProcessPoolCompiler"]

log = logging.getLogger(__name__)

#: How a worker's start failure reads when its address-space limit was the cause.
_MEMORY_FAILURES = (
    "MemoryError",
    "out of memory",
    "failed to map segment",
    "Cannot allocate memory",
)
_START_TIMEOUT_S = 180.0
#: Waits between attempts to start a replacement worker that failed to start.
_RESTART_BACKOFF_S = (1.0, 2.0, 5.0, 10.0, 30.0)
#: How long a worker that died of SIGTERM or SIGINT waits for the pool to close before it is
#: replaced: a stop sent to the server's process group reaches the workers first.
_GROUP_STOP_WAIT_S = 5.0
#: A worker that dies with less free scratch space than this is taken to have hit a full disk.
_FULL_DISK_MARGIN = 1 << 20


@dataclass(eq=False)  # identity hashing: workers live in a set
class _Worker:
    process: _compile_worker.WorkerProcess
    conn: Connection
    scratch: Path


class ProcessPoolCompiler:
    """A :class:`~kcache.compilers.Compiler` that compiles in a pool of worker processes."""

    def __init__(
        self,
        toolchain: Toolchain,
        include_sets: IncludeSets,
        *,
        workers: int,
        timeout_s: float,
        memory_mb: int,
        queue_limit: int,
        tmp_dir: Path,
        toolchain_dir: Path | None = None,
        retry_after_s: int = 5,
        caller_limit: int = 0,
        caller_queue_limit: int = 16,
        queue_timeout_s: float = 300.0,
        min_free_bytes: int = 0,
        compile_sandbox: str = "best-effort",
        nice: int = 0,
    ) -> None:
        self.toolchain = toolchain
        self.include_sets = include_sets
        self.workers = workers
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb
        self.queue_limit = queue_limit
        self.tmp_dir = tmp_dir
        self.toolchain_dir = toolchain_dir
        self.retry_after_s = retry_after_s
        self.queue_timeout_s = queue_timeout_s
        self.min_free_bytes = min_free_bytes
        self.nice = nice  # added to each worker's niceness
        #: "required": an unconfined worker is refused; "best-effort": it serves, loudly;
        #: "off": workers are not even asked to confine themselves.
        self.sandbox_mode = compile_sandbox
        self.sandbox: SandboxStatus | None = None  # what the last worker to start reported
        self._ctx = multiprocessing.get_context("spawn")
        self._queue: FairQueue[_Worker] = FairQueue(
            per_caller=caller_limit or (workers - 1 if workers >= 3 else workers),
            per_caller_queue=caller_queue_limit,
            total=workers + queue_limit,
            total_setting=f"compile_workers={workers}, compile_queue_limit={queue_limit}",
            retry_after_s=retry_after_s,
        )
        self._all: set[_Worker] = set()  # started and not known dead (starting ones included)
        self._guard = threading.Lock()
        self._starting = 0  # replacements being started right now
        self._last_start_failure: str | None = None
        self._closed = False
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self.restarts = 0  # workers replaced after a timeout, a crash or a death while idle

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start every worker (in parallel), wait until each has loaded the toolchain, watch them.

        A toolchain that compiles nothing (a fetch-only server, :mod:`kcache_server.compiler_presence`)
        starts no worker: :meth:`compile` refuses instead.
        """
        if not self.toolchain.compiles:
            return
        self.tmp_dir.mkdir(parents=True, exist_ok=True)
        started = [self._launch() for _ in range(self.workers)]
        for worker in started:
            self._await_ready(worker)
            self._queue.put(worker)
        self._watcher = threading.Thread(
            target=self._watch, name="kcache-worker-watch", daemon=True
        )
        self._watcher.start()

    def close(self) -> None:
        """Stop every worker."""
        with self._guard:
            self._closed = True
            workers = list(self._all)
        self._stop.set()
        self._queue.wake()
        for worker in workers:
            with contextlib.suppress(OSError, ValueError):
                worker.conn.send(("stop",))
        for worker in workers:
            worker.process.join(timeout=5)
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join(timeout=5)
            worker.conn.close()
            shutil.rmtree(worker.scratch, ignore_errors=True)
        if self._watcher is not None:
            self._watcher.join(timeout=5)

    @property
    def alive(self) -> int:
        """Workers whose process is running."""
        with self._guard:
            return sum(1 for w in self._all if w.process.is_alive())

    @property
    def pids(self) -> list[int]:
        """Process ids of the workers believed alive (starting ones included)."""
        with self._guard:
            return [w.process.pid for w in self._all]

    @property
    def pending(self) -> int:
        """Compiles running or waiting for a worker."""
        return self._queue.pending

    @property
    def idle(self) -> int:
        """Workers started and waiting for a compile."""
        return self._queue.idle

    def _launch(self) -> _Worker:
        # Each worker gets its own scratch directory, so a killed worker's leftovers
        # (NVRTC trace files it had no chance to delete) can be removed with it. It is
        # the worker's working directory and the only place it may write.
        scratch = Path(tempfile.mkdtemp(prefix="worker-", dir=self.tmp_dir)).resolve()
        config = _compile_worker.WorkerConfig(
            # Where this server prepared its toolchain, not a default the scrubbed
            # worker environment would compute differently.
            toolchain_dir=str(self.toolchain.include_dir.parent.parent),
            include_sets=self.include_sets.as_mapping(),
            memory_mb=self.memory_mb,
            scratch=str(scratch),
            confine=self.sandbox_mode != "off",
            nice=self.nice,
        )
        try:
            process, conn = _compile_worker.spawn(config)
        except BaseException:
            shutil.rmtree(scratch, ignore_errors=True)
            raise
        worker = _Worker(process, conn, scratch)
        with self._guard:
            self._all.add(worker)
        return worker

    def _await_ready(self, worker: _Worker) -> None:
        try:
            if not worker.conn.poll(_START_TIMEOUT_S):
                raise ToolchainError(
                    f"a compile worker did not start within {_START_TIMEOUT_S:.0f}s"
                )
            message = worker.conn.recv()
        except (EOFError, OSError) as exc:
            full = self._disk_full()  # before its scratch is removed
            self._discard(worker)
            died = f"a compile worker died while starting (exit code {worker.process.exitcode})"
            if full is not None:
                raise ToolchainError(f"{died}: {self._full_disk_cause(full)}") from exc
            raise ToolchainError(
                f"{died}; is compile_memory_mb={self.memory_mb} too small for NVRTC?"
            ) from exc
        except ToolchainError:
            self._discard(worker)
            raise
        if message[0] != "ready" or message[1] != self.toolchain.id:
            self._discard(worker)
            if message[0] != "start_failed":
                raise ToolchainError(
                    f"a compile worker loaded toolchain {message[1]}, not {self.toolchain.id}"
                )
            detail = str(message[1])
            # Only a memory failure is about the limit (under RLIMIT_AS a library that does
            # not fit fails to dlopen with "failed to map segment"); anything else (a
            # mismatched nvJitLink, a missing library) must not send the operator after memory.
            # On a full disk LLVM says "out of memory" too: the disk is named then.
            hint = ""
            if any(sign in detail for sign in _MEMORY_FAILURES):
                full = self._disk_full()
                hint = (
                    f": {self._full_disk_cause(full)}"
                    if full is not None
                    else f"; compile_memory_mb={self.memory_mb} may be too small"
                )
            raise ToolchainError(f"a compile worker could not start ({detail}){hint}")
        status = SandboxStatus.from_dict(message[2])
        first = self.sandbox is None or self.sandbox.active != status.active
        self.sandbox = status
        if status.active:
            return
        if self.sandbox_mode == "required":
            self._discard(worker)
            raise ToolchainError(
                f"refusing to compile: the compile worker could not be confined ({status.detail}). "
                "Run on Linux >= 5.13 with Landlock enabled (lsm=...,landlock), or accept unconfined "
                "compiles with compile_sandbox=best-effort (KCACHE_COMPILE_SANDBOX)"
            )
        if first:
            log.warning(
                "COMPILE WORKERS ARE NOT CONFINED (%s; compile_sandbox=%s): a recipe's includes are "
                "checked after the compile, but NVRTC itself can open any file this server can read",
                status.detail,
                self.sandbox_mode,
            )

    def _discard(self, worker: _Worker) -> None:
        with self._guard:
            self._all.discard(worker)
        if worker.process.is_alive():
            worker.process.kill()
        worker.process.join(timeout=5)
        worker.conn.close()
        shutil.rmtree(worker.scratch, ignore_errors=True)

    def _replace(self, worker: _Worker, why: str, level: int = logging.WARNING) -> None:
        """Kill ``worker`` and start another in the background (whoever held it has been answered)."""
        with self._guard:
            # Counted before the dead one leaves the pool, so a waiter never sees neither.
            replacing = not self._closed
            if replacing:
                self._starting += 1
        pid = worker.process.pid
        self._discard(worker)
        self.restarts += 1
        log.log(
            level,
            "compile worker pid %s %s (exit code %s); %s",
            pid,
            why,
            worker.process.exitcode,
            "starting a replacement" if replacing else "the pool is closing",
        )
        if replacing:
            threading.Thread(
                target=self._start_replacement,
                args=(level,),
                name="kcache-worker-restart",
                daemon=True,
            ).start()

    def _start_replacement(self, level: int = logging.WARNING) -> None:
        """Start one worker (``_starting`` already counts it), retrying with backoff until it runs.

        Its start is logged at the level of why it was needed: a worker retiring after a
        failed user compile (INFO) is routine, one that died or ran past its time is not.
        """
        attempt = 0
        while True:
            try:
                fresh = self._launch()
                self._await_ready(fresh)
            except Exception as exc:  # any failure to start: the pool is short of a worker
                delay = _RESTART_BACKOFF_S[min(attempt, len(_RESTART_BACKOFF_S) - 1)]
                attempt += 1
                with self._guard:
                    self._starting -= 1
                    self._last_start_failure = str(exc)
                self._queue.wake()  # waiters may now have nothing left to wait for
                log.error(
                    "a replacement compile worker could not start (%s); trying again in %gs",
                    exc,
                    delay,
                )
                if self._stop.wait(delay):
                    return
                with self._guard:
                    if self._closed:
                        return
                    self._starting += 1
                continue
            with self._guard:
                self._starting -= 1
                self._last_start_failure = None
                closed = self._closed
            if closed:
                self._discard(fresh)
                return
            log.log(level, "compile worker pid %s started as a replacement", fresh.process.pid)
            self._queue.put(fresh)
            return

    def _watch(self) -> None:
        """Replace workers that die while idle, as soon as they die (not when a compile finds them)."""
        while not self._stop.is_set():
            with self._guard:
                by_sentinel = {w.process.sentinel: w for w in self._all}
            if not by_sentinel:
                self._stop.wait(1.0)
                continue
            ready = multiprocessing.connection.wait(list(by_sentinel), timeout=1.0)
            if self._stop.is_set():
                return  # closing: these are workers told to stop
            busy = False
            for sentinel in ready:
                worker = by_sentinel[sentinel]  # type: ignore[index]
                if self._stopped_with_the_server(worker):
                    return
                if self._queue.take_idle(worker):
                    self._replace(worker, "died while idle")
                else:
                    busy = True  # starting or compiling: that thread sees the death and replaces it
            if busy:
                self._stop.wait(0.1)  # its sentinel stays ready until then; do not spin on it

    def _stopped_with_the_server(self, worker: _Worker) -> bool:
        """Whether ``worker`` died of a stop signal sent to the server's whole process group
        (systemd's stop, ``timeout``, a terminal's Ctrl-C), as the pool began closing too.

        Such a death comes before the server's own shutdown closes the pool: it waits a
        moment for that, rather than log a worker dead and start a replacement on every
        stop. A worker stopped alone (a signal to its pid) is replaced after the wait.
        """
        worker.process.join(timeout=1.0)  # its exit code is set once it has been reaped
        if worker.process.exitcode not in (-signal.SIGTERM, -signal.SIGINT):
            return False
        return self._stop.wait(_GROUP_STOP_WAIT_S)

    def _unavailable(self) -> str | None:
        """Why no worker can come to a waiting compile, or None (asked under the queue's lock)."""
        if self._closed:
            return "the compile pool is shut down"
        if self._all or self._starting:
            return None
        failure = self._last_start_failure
        return (
            "no compile worker is running and none is starting"
            + (f" (the last start failed: {failure})" if failure else "")
            + "; restarts are retried in the background, retry later"
        )

    @staticmethod
    def _usable(worker: _Worker) -> bool:
        """True for a live worker with nothing unread on its pipe (an idle one never writes)."""
        try:
            return worker.process.is_alive() and not worker.conn.poll(0)
        except (OSError, EOFError, ValueError):
            return False

    def _disk_full(self) -> int | None:
        """Free scratch bytes when they are too few for a compile (a death there is a full disk)."""
        try:
            free = free_bytes(self.tmp_dir)
        except OSError:
            return None
        return free if free < max(self.min_free_bytes, _FULL_DISK_MARGIN) else None

    def _full_disk_cause(self, free: int) -> str:
        """Why a worker died on a full disk, and the fix (NVRTC's own words say 'out of memory')."""
        return (
            f"the disk is full ({free} bytes free for compile scratch in {self.tmp_dir}; NVRTC "
            "reports a write it cannot make as 'LLVM ERROR: out of memory'): free some space "
            "(kcache db gc removes unreferenced blobs); compile_memory_mb is not the cause"
        )

    def _full_disk_error(self, free: int) -> StoreFullError:
        log.error(
            "a compile failed for want of disk space: %d bytes free for compile scratch in %s",
            free,
            self.tmp_dir,
        )
        return StoreFullError(
            errno.ENOSPC,
            f"the compile ran out of disk space (the compile scratch directory has {free} bytes free); "
            "free some space (kcache db gc removes unreferenced blobs) and retry",
        )

    # ------------------------------------------------------------------ compiling
    def compile(self, recipe: Recipe, link_inputs: Sequence[bytes] = ()) -> CompileOutput:
        """Compile ``recipe`` in a worker, in turn with other callers; raises like the in-process compiler.

        The caller is :data:`~kcache_server.fairness.current_caller` of this context.
        """
        if not self.toolchain.compiles:
            raise CannotCompileError(self.toolchain.cannot_compile)
        if self._closed:
            raise ToolchainError("the compile pool is shut down")
        try:
            check_free_space(
                self.tmp_dir,
                self.min_free_bytes,
                "the compile scratch directory (min_free_bytes, KCACHE_MIN_FREE_BYTES)",
            )
        except StoreFullError as exc:
            log.warning("compile refused: %s", exc)
            raise
        caller = current_caller.get()
        try:
            return result_of(self._compile_once(caller, recipe, link_inputs))
        except DependencyTraceError as exc:
            # That worker's NVRTC was spoiled (it retired); another decides.
            log.warning("recipe %s: %s; compiling it again on another worker", recipe.key(), exc)
        return result_of(self._compile_once(caller, recipe, link_inputs))

    def _compile_once(self, caller: str, recipe: Recipe, link_inputs: Sequence[bytes]) -> Reply:
        while True:
            worker = self._queue.get(caller, self.queue_timeout_s, self._unavailable)
            if self._usable(worker):
                break
            self._queue.give_back(caller, None)  # never hand a dead worker a compile
            self._replace(worker, "died while idle")
        return self._run(caller, worker, recipe, link_inputs)

    def _run(
        self, caller: str, worker: _Worker, recipe: Recipe, link_inputs: Sequence[bytes]
    ) -> Reply:
        back: _Worker | None = None  # the worker goes back to the queue only after a clean reply
        try:
            try:
                worker.conn.send(("compile", recipe.to_dict(), [bytes(b) for b in link_inputs]))
                finished = worker.conn.poll(self.timeout_s)
                reply = worker.conn.recv() if finished else None
            except (EOFError, OSError) as exc:
                full = self._disk_full()  # before the dead worker's scratch is removed
                why = f"died while compiling recipe {recipe.key()}"
                if full is not None:
                    why += (
                        f" with {full} bytes free for compile scratch: the disk is full (an "
                        "'out of memory' NVRTC printed is that, not compile_memory_mb)"
                    )
                self._replace(worker, why)
                if full is not None:
                    raise self._full_disk_error(full) from exc
                raise CompileWorkerCrashedError(
                    f"the compile worker died while compiling (exit code {worker.process.exitcode}); it was "
                    f"replaced. The compile may need more than compile_memory_mb={self.memory_mb} MiB"
                ) from exc
            if reply is None:
                self._replace(
                    worker,
                    f"ran past compile_timeout_s={self.timeout_s:g} on recipe {recipe.key()}",
                )
                raise CompileTimeoutError(
                    None,
                    f"the compile ran past the server's limit of {self.timeout_s:g}s and was stopped "
                    "(KCACHE_COMPILE_TIMEOUT_S where the server runs); a very large source, or a "
                    "template that never finishes instantiating, does this",
                )
            answer: Reply = reply[1]
            retiring: str | None = reply[2]
            if retiring is None:
                back = worker
            else:
                self._replace(worker, f"retires: {retiring}", logging.INFO)
        finally:
            self._queue.give_back(caller, back)
        # A compile's "out of memory" on a (nearly) full disk is the disk, and is not kept
        # as the recipe's own compile error.
        out_of_memory = answer[0] == "compile_error" and any(
            sign in str(answer[1]) for sign in _MEMORY_FAILURES
        )
        if answer[0] in ("toolchain_error", "failed") or out_of_memory:
            full = self._disk_full()
            if full is not None:
                raise self._full_disk_error(full)
        return answer
