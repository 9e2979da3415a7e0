"""``ProcessPoolCompiler``: the core ``Compiler`` seam over pre-started worker processes.

NVRTC runs in spawned processes with an address-space limit, so a runaway template
or a crashing compile costs one request, never the server: a compile past its
timeout has its worker killed (``CompileTimeoutError``), a worker that dies fails
its one request (``CompileWorkerCrashedError``), and either way a fresh worker
takes its place. Past ``workers + queue_limit`` compiles in flight, new ones are
refused with ``OverloadedError`` (503 with Retry-After).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import queue
import shutil
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

from kcache.artifact import CompileOutput
from kcache.errors import (
    CompileError,
    CompileTimeoutError,
    InvalidArtifactError,
    RecipeError,
    ToolchainError,
    UnlistedIncludeError,
)
from kcache.include_sets import IncludeSets
from kcache.recipe import Recipe
from kcache.sandbox import SandboxStatus
from kcache.toolchain import Toolchain
from kcache_server import _worker
from kcache_server.errors import CompileWorkerCrashedError, OverloadedError

__all__ = ["ProcessPoolCompiler"]

log = logging.getLogger(__name__)

_START_TIMEOUT_S = 180.0


@dataclass(eq=False)  # identity hashing: workers live in a set
class _Worker:
    process: _worker.WorkerProcess
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
        compile_sandbox: str = "best-effort",
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
        #: "required": an unconfined worker is refused; "best-effort": it serves, loudly;
        #: "off": workers are not even asked to confine themselves.
        self.sandbox_mode = compile_sandbox
        self.sandbox: SandboxStatus | None = None  # what the last worker to start reported
        self._ctx = multiprocessing.get_context("spawn")
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._all: set[_Worker] = set()
        self._guard = threading.Lock()
        self._pending = 0
        self._closed = False
        self.restarts = 0  # workers replaced after a timeout or crash

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start every worker (in parallel) and wait until each has loaded the toolchain."""
        self.tmp_dir.mkdir(parents=True, exist_ok=True)
        started = [self._launch() for _ in range(self.workers)]
        for worker in started:
            self._await_ready(worker)
            self._idle.put(worker)

    def close(self) -> None:
        """Stop every worker."""
        with self._guard:
            self._closed = True
            workers = list(self._all)
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

    @property
    def alive(self) -> int:
        """Workers whose process is running."""
        with self._guard:
            return sum(1 for w in self._all if w.process.is_alive())

    def _launch(self) -> _Worker:
        # Each worker gets its own scratch directory, so a killed worker's leftovers
        # (NVRTC trace files it had no chance to delete) can be removed with it. It is
        # the worker's working directory and the only place it may write.
        scratch = Path(tempfile.mkdtemp(prefix="worker-", dir=self.tmp_dir)).resolve()
        config = _worker.WorkerConfig(
            # Where this server prepared its toolchain, not a default the scrubbed
            # worker environment would compute differently.
            toolchain_dir=str(self.toolchain.include_dir.parent.parent),
            include_sets=self.include_sets.as_mapping(),
            memory_mb=self.memory_mb,
            scratch=str(scratch),
            confine=self.sandbox_mode != "off",
        )
        try:
            process, conn = _worker.spawn(config)
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
            self._discard(worker)
            raise ToolchainError(
                f"a compile worker died while starting (exit code {worker.process.exitcode}); "
                f"is compile_memory_mb={self.memory_mb} too small for NVRTC?"
            ) from exc
        except ToolchainError:
            self._discard(worker)
            raise
        if message[0] != "ready" or message[1] != self.toolchain.id:
            self._discard(worker)
            detail = message[1] if message[0] == "start_failed" else f"toolchain {message[1]}"
            raise ToolchainError(
                f"a compile worker could not start ({detail}); compile_memory_mb={self.memory_mb} may be too small"
                if message[0] == "start_failed"
                else f"a compile worker loaded {detail}, not {self.toolchain.id}"
            )
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

    def _replace(self, worker: _Worker) -> None:
        """Kill ``worker`` and start another in the background (the caller's request already failed)."""
        self._discard(worker)
        self.restarts += 1

        def start_one() -> None:
            if self._closed:
                return
            fresh = self._launch()
            try:
                self._await_ready(fresh)
            except ToolchainError:
                return  # the pool shrinks; readyz reports fewer live workers
            self._idle.put(fresh)

        threading.Thread(target=start_one, name="kcache-worker-restart", daemon=True).start()

    # ------------------------------------------------------------------ compiling
    def compile(self, recipe: Recipe, link_inputs: Sequence[bytes] = ()) -> CompileOutput:
        """Compile ``recipe`` in a worker; raises like the in-process compiler would."""
        with self._guard:
            if self._closed:
                raise ToolchainError("the compile pool is shut down")
            if self._pending >= self.workers + self.queue_limit:
                raise OverloadedError(
                    f"{self._pending} compiles are running or queued (compile_workers={self.workers}, "
                    f"compile_queue_limit={self.queue_limit}); retry later",
                    self.retry_after_s,
                )
            self._pending += 1
        try:
            worker = self._idle.get()
            return self._run(worker, recipe, link_inputs)
        finally:
            with self._guard:
                self._pending -= 1

    def _run(self, worker: _Worker, recipe: Recipe, link_inputs: Sequence[bytes]) -> CompileOutput:
        try:
            worker.conn.send(("compile", recipe.to_dict(), [bytes(b) for b in link_inputs]))
            finished = worker.conn.poll(self.timeout_s)
            reply = worker.conn.recv() if finished else None
        except (EOFError, OSError) as exc:
            self._replace(worker)
            raise CompileWorkerCrashedError(
                f"the compile worker died while compiling (exit code {worker.process.exitcode}); it was "
                f"replaced. The compile may need more than compile_memory_mb={self.memory_mb} MiB"
            ) from exc
        if reply is None:
            self._replace(worker)
            raise CompileTimeoutError(
                None,
                f"the compile ran past the limit of {self.timeout_s:g}s (compile_timeout_s) and was "
                "stopped; a template that never finishes instantiating does this",
            )
        self._idle.put(worker)
        kind = reply[0]
        if kind == "ok":
            output: CompileOutput = reply[1]
            return output
        if kind == "compile_error":
            raise CompileError(None, reply[1])
        if kind == "unlisted_include":
            raise UnlistedIncludeError(reply[1], reply[2])
        if kind == "recipe_error":
            raise RecipeError(reply[1], reply[2])
        if kind == "invalid_artifact":
            raise InvalidArtifactError(reply[1])
        if kind == "toolchain_error":
            raise ToolchainError(reply[1])
        raise ToolchainError(f"the compile worker failed: {reply[1]}: {reply[2]}")
