"""Compiling in a fresh process: for a process whose NVRTC no longer traces reliably.

:func:`kcache.nvrtc.compile_recipe` sends a compile here once a compile of its own
process failed (NVRTC's dependency traces may be short from then on), and for a
compile whose trace failed its checks. The child (:func:`kcache.nvrtc.answer_one_compile`,
so that this module needs nothing of :mod:`kcache.nvrtc`) is a new interpreter in this
process's working directory (``-G`` and ``-lineinfo`` cubins record it, so the bytes
are those this process would have made) and with its environment (a local compile
is the user's own, nothing to scrub). It compiles once with
:func:`kcache.nvrtc.compile_in_this_process` and leaves its answer, a
:mod:`kcache.compile_replies` tuple, in a file of a private temporary directory.

It costs a process start (about 0.3 s: the interpreter, NVRTC's libraries, the
toolchain) per compile, paid only by processes that saw a failed compile.
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from kcache.artifact import CompileOutput
from kcache.compile_replies import result_of
from kcache.errors import ToolchainError
from kcache.include_sets import IncludeSets
from kcache.recipe import Recipe
from kcache.toolchain import Toolchain

__all__ = ["REPLY_FIELD", "compile_in_fresh_process"]

_REPLY = "reply.pickle"
#: Where in the request the child is told to leave its reply.
REPLY_FIELD = "reply"
_BOOTSTRAP = (
    "import sys, json; sys.path[:] = json.loads(sys.argv[1]); "
    "from kcache.nvrtc import answer_one_compile; answer_one_compile()"
)


def compile_in_fresh_process(
    recipe: Recipe,
    toolchain: Toolchain,
    include_sets: IncludeSets,
    link_inputs: Sequence[bytes] = (),
) -> CompileOutput:
    """Compile ``recipe`` in a new process; raises as :func:`kcache.nvrtc.compile_recipe` does."""
    request = {
        "recipe": recipe.to_dict(),
        # Where this process prepared its toolchain, as the server tells its workers.
        "toolchain_dir": str(toolchain.include_dir.parent.parent),
        "toolchain_id": toolchain.id,
        "include_sets": include_sets.as_mapping(),
        "link_inputs": [bytes(item) for item in link_inputs],
    }
    with tempfile.TemporaryDirectory(prefix="kcache-compile-") as workdir:
        request[REPLY_FIELD] = str(Path(workdir) / _REPLY)
        done = subprocess.run(
            [sys.executable, "-c", _BOOTSTRAP, json.dumps(sys.path)],
            input=pickle.dumps(request),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            check=False,
        )
        answer = Path(workdir) / _REPLY
        if done.returncode != 0 or not answer.is_file():
            tail = done.stderr.decode("utf-8", "replace").strip().splitlines()[-3:]
            raise ToolchainError(
                f"a fresh compile process failed (exit code {done.returncode})"
                + (f": {' | '.join(tail)}" if tail else "")
            )
        reply = pickle.loads(answer.read_bytes())  # written by our own child, just now
    return result_of(reply)
