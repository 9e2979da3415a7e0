"""The compile worker process: limits itself, loads the toolchain, then compiles on request.

Messages on the pipe (pickled tuples):
  parent -> child  ("compile", recipe_dict, [link input bytes])  |  ("stop",)
  child -> parent  ("ready", toolchain_id) | ("start_failed", text)
                   ("ok", CompileOutput) | ("compile_error", log) | ("recipe_error", field, detail)
                   ("toolchain_error", text) | ("invalid_artifact", text) | ("failed", type name, text)
Errors travel as tuples because exceptions with extra constructor arguments
(RecipeError(field, detail)) do not survive pickling.
"""

from __future__ import annotations

import os
import resource
import tempfile
from multiprocessing.connection import Connection
from pathlib import Path


def main(
    conn: Connection,
    toolchain_dir: str | None,
    include_sets: dict[str, str],
    memory_mb: int,
    tmp_dir: str,
) -> None:
    """Run in a spawned process until told to stop or the pipe closes."""
    limit = memory_mb << 20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    # NVRTC's trace files and any scratch stay inside the data directory.
    os.environ["TMPDIR"] = tmp_dir
    tempfile.tempdir = tmp_dir
    try:
        from kcache.compiler import compile_recipe
        from kcache.errors import CompileError, InvalidArtifactError, RecipeError, ToolchainError
        from kcache.include_sets import IncludeSets
        from kcache.recipe import Recipe
        from kcache.toolchain import load_toolchain

        toolchain = load_toolchain(Path(toolchain_dir) if toolchain_dir else None)
        sets = IncludeSets(include_sets)
    except BaseException as exc:  # report anything, even MemoryError, instead of dying silently
        conn.send(("start_failed", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", toolchain.id))
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message[0] != "compile":
            return
        _, recipe_dict, link_inputs = message
        try:
            output = compile_recipe(Recipe.from_dict(recipe_dict), toolchain, sets, link_inputs)
            reply: tuple[object, ...] = ("ok", output)
        except RecipeError as exc:
            reply = ("recipe_error", exc.field, exc.detail)
        except CompileError as exc:
            reply = ("compile_error", exc.log)
        except ToolchainError as exc:
            reply = ("toolchain_error", str(exc))
        except InvalidArtifactError as exc:
            reply = ("invalid_artifact", str(exc))
        except MemoryError:
            reply = ("compile_error", f"the compile ran out of memory (limit {memory_mb} MiB)")
        except Exception as exc:
            reply = ("failed", type(exc).__name__, str(exc))
        conn.send(reply)
