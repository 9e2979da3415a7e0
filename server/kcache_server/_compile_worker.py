"""The compile worker process: started scrubbed, limits and confines itself, then compiles on request.

Start-up (:func:`spawn`, in the server): the worker is a fresh interpreter started
with :func:`kcache.sandbox.scrubbed_environment` (no ``KCACHE_*``, no database URL,
no tokens: ``os.environ`` and ``/proc/self/environ`` of the worker never held them),
not a ``multiprocessing`` child, which inherits the server's environment and cannot
be given another. One end of a socket pair is its only link to the server.

Then, in the worker (:func:`main`): address-space limit, ``chdir`` into an empty
directory made in its own scratch directory (which is also ``TMPDIR``: NVRTC's trace
files live there) and removed at once, so that no output of NVRTC records the
directory (:func:`kcache.nvrtc.reads_working_directory`: LTO-IR and line information
would, and then differ between workers), load
the toolchain, compile and link one tiny program so that every library NVRTC and
nvJitLink load lazily is mapped, and only then Landlock
(:func:`kcache.sandbox.confine`): reads limited to the toolchain, the include-set
roots and the interpreter, writes to the scratch directory. The worker reports
whether confinement is in force in its ``ready`` message; the pool decides whether
an unconfined worker may serve (``compile_sandbox``).

Messages on the pipe (pickled tuples):
  parent -> child  WorkerConfig (first) | ("compile", recipe_dict, [link input bytes]) | ("stop",)
  child -> parent  ("ready", toolchain_id, sandbox status dict) | ("start_failed", text)
                   ("reply", reply, retiring) for each compile: ``reply`` as
                   :mod:`kcache.compile_replies` has it, ``retiring`` None or why the worker
                   exits after this reply

A worker compiles until its first failed compile (or a dependency trace that fails its
checks): from then on NVRTC's traces in that process may be short (:mod:`kcache.nvrtc`),
so it answers that compile, says it is retiring, and exits; the pool starts another.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import weakref
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, Pipe
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the worker imports kcache only once its limits are set
    from kcache.artifact import CompileOutput
    from kcache.include_sets import IncludeSets
    from kcache.toolchain import Toolchain

__all__ = ["WorkerConfig", "WorkerProcess", "main", "spawn"]

# Run by the fresh interpreter: the server's import path, then the worker.
_BOOTSTRAP = (
    "import sys, json; sys.path[:] = json.loads(sys.argv[1]); "
    "from kcache_server._compile_worker import _child; _child(int(sys.argv[2]))"
)


@dataclass(frozen=True)
class WorkerConfig:
    """What a worker needs to start, sent as its first message."""

    toolchain_dir: str  # the root the server's toolchain was prepared under
    include_sets: dict[str, str] = field(default_factory=dict)
    memory_mb: int = 8192
    scratch: str = ""  # absolute; the worker's working directory and TMPDIR
    confine: bool = True  # False: compile_sandbox=off, run unconfined on purpose
    nice: int = 0  # added to the worker's niceness: verification workers yield the CPU


class WorkerProcess:
    """A started worker: the parts of ``multiprocessing.Process`` the pool uses."""

    def __init__(self, popen: subprocess.Popen[bytes], sentinel: int) -> None:
        self._popen = popen
        #: Becomes readable when the worker exits (it holds the pipe's write end).
        self.sentinel = sentinel
        weakref.finalize(self, os.close, sentinel)

    @property
    def pid(self) -> int:
        """The worker's process id."""
        return self._popen.pid

    @property
    def exitcode(self) -> int | None:
        """None while running, else the exit status (``-N`` when killed by signal N)."""
        return self._popen.poll()

    def is_alive(self) -> bool:
        """True while the process runs."""
        return self._popen.poll() is None

    def kill(self) -> None:
        """SIGKILL (nothing happens when it has already exited)."""
        self._popen.kill()

    def join(self, timeout: float | None = None) -> None:
        """Wait for the process to exit, at most ``timeout`` seconds."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._popen.wait(timeout)


def spawn(config: WorkerConfig) -> tuple[WorkerProcess, Connection]:
    """Start a worker with a scrubbed environment; returns it and the server's end of its pipe."""
    from kcache.sandbox import scrubbed_environment

    parent, child = Pipe(duplex=True)
    sentinel_read, sentinel_write = os.pipe()
    try:
        popen = subprocess.Popen(
            [sys.executable, "-c", _BOOTSTRAP, json.dumps(sys.path), str(child.fileno())],
            pass_fds=(child.fileno(), sentinel_write),
            env=scrubbed_environment(Path(config.scratch)),
            cwd=config.scratch,
            stdin=subprocess.DEVNULL,
        )
    except BaseException:
        parent.close()
        os.close(sentinel_read)
        raise
    finally:
        child.close()
        os.close(sentinel_write)
    parent.send(config)
    return WorkerProcess(popen, sentinel_read), parent


def _child(fd: int) -> None:
    """Entry point of the fresh interpreter: read the configuration, then run :func:`main`."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server stops its workers itself
    conn = Connection(fd)
    try:
        config = conn.recv()
    except (EOFError, OSError):  # the server went away before the configuration
        return
    try:
        main(conn, config)
    except (BrokenPipeError, ConnectionResetError):
        # The server went away (killed) while this worker started or answered: its
        # "ready" or its reply has nobody to read it. Exit quietly, as on a closed pipe.
        return


def _warm_up(toolchain: object) -> None:
    """Compile to LTO-IR and link once, so NVRTC's and nvJitLink's lazy loads happen before Landlock."""
    from kcache.include_sets import IncludeSets
    from kcache.nvrtc import compile_in_this_process
    from kcache.recipe import LinkInput, Recipe
    from kcache.toolchain import Toolchain

    assert isinstance(toolchain, Toolchain)
    target = f"sm_{toolchain.supported_sms[-1]}"
    helper = Recipe(
        source="__device__ float kc_warm(float x) { return 2.0f * x; }",
        target=target,
        output="ltoir",
        toolchain=toolchain.id,
    )
    ltoir = compile_in_this_process(helper, toolchain, IncludeSets())
    if not toolchain.links_lto:
        return  # an nvJitLink older than NVRTC: LTO recipes are refused, so none is linked here
    main_recipe = Recipe(
        source='extern __device__ float kc_warm(float); extern "C" __global__ void k(float* o) '
        "{ o[0] = kc_warm(o[0]); }",
        target=target,
        flags=("-rdc=true",),
        lto=True,
        link=(LinkInput(recipe=helper),),
        toolchain=toolchain.id,
    )
    compile_in_this_process(main_recipe, toolchain, IncludeSets(), [ltoir.data])


def _compile(
    recipe_dict: dict[str, object],
    toolchain: Toolchain,
    sets: IncludeSets,
    link_inputs: list[bytes],
) -> CompileOutput:
    """One compile in this process, the recipe read from its message (its errors reported too)."""
    from kcache.nvrtc import compile_in_this_process
    from kcache.recipe import Recipe

    return compile_in_this_process(Recipe.from_dict(recipe_dict), toolchain, sets, link_inputs)


def main(conn: Connection, config: WorkerConfig) -> None:
    """Run in the worker process until told to stop or the pipe closes."""
    limit = config.memory_mb << 20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    if config.nice:
        os.nice(config.nice)
    os.chdir(config.scratch)
    tempfile.tempdir = config.scratch
    try:
        from kcache.nvrtc import enter_removed_directory

        enter_removed_directory()  # one inside the scratch directory: see the docstring
        from kcache.compile_replies import reply_of
        from kcache.include_sets import IncludeSets
        from kcache.nvrtc import nvrtc_untrusted
        from kcache.sandbox import SandboxStatus, compile_policy, confine
        from kcache.toolchain import load_toolchain

        toolchain = load_toolchain(Path(config.toolchain_dir))
        sets = IncludeSets(config.include_sets)
        _warm_up(toolchain)
        if config.confine:
            status = confine(compile_policy(toolchain, sets, Path(config.scratch)))
        else:
            status = SandboxStatus(False, 0, "confinement turned off")
    except BaseException as exc:  # report anything, even MemoryError, instead of dying silently
        conn.send(("start_failed", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", toolchain.id, status.to_dict()))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the server went away (closed or killed): exit quietly
            return
        if message[0] != "compile":
            return
        _, recipe_dict, link_inputs = message
        reply = reply_of(
            functools.partial(_compile, recipe_dict, toolchain, sets, link_inputs),
            config.memory_mb,
        )
        retiring = nvrtc_untrusted()
        try:
            conn.send(("reply", reply, retiring))
        except OSError:  # the server went away while this compiled: exit quietly
            return
        if retiring is not None:
            return
