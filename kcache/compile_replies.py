"""A compile's outcome as a plain tuple, for the pipe of a process that compiled it.

Server workers and fresh compile processes answer with these; exceptions with extra
constructor arguments (``RecipeError(field, detail)``) do not survive pickling, and
a child must never make its parent unpickle an arbitrary exception.

    ("ok", CompileOutput) | ("compile_error", log) | ("recipe_error", field, detail)
    ("unlisted_include", include, field) | ("dependency_trace", text)
    ("toolchain_error", text) | ("invalid_artifact", text) | ("failed", type name, text)
"""

from __future__ import annotations

from collections.abc import Callable

from kcache.artifact import CompileOutput
from kcache.errors import (
    CompileError,
    DependencyTraceError,
    InvalidArtifactError,
    RecipeError,
    ToolchainError,
    UnlistedIncludeError,
)

__all__ = ["Reply", "reply_of", "result_of"]

Reply = tuple[object, ...]


def reply_of(compile: Callable[[], CompileOutput], memory_mb: int | None = None) -> Reply:
    """Run ``compile`` and say how it ended (never raises for a compile's own failure)."""
    try:
        return ("ok", compile())
    except UnlistedIncludeError as exc:
        return ("unlisted_include", exc.include, exc.field)
    except RecipeError as exc:
        return ("recipe_error", exc.field, exc.detail)
    except CompileError as exc:
        return ("compile_error", exc.log)
    except DependencyTraceError as exc:
        return ("dependency_trace", str(exc))
    except ToolchainError as exc:
        return ("toolchain_error", str(exc))
    except InvalidArtifactError as exc:
        return ("invalid_artifact", str(exc))
    except MemoryError:
        limit = f" (limit {memory_mb} MiB)" if memory_mb else ""
        return ("compile_error", f"the compile ran out of memory{limit}")
    except Exception as exc:
        return ("failed", type(exc).__name__, str(exc))


def result_of(reply: Reply) -> CompileOutput:
    """The output a reply carries, or the error it stands for, raised."""
    kind = reply[0]
    if kind == "ok":
        output = reply[1]
        if not isinstance(output, CompileOutput):
            raise ToolchainError(f"a compile process answered {type(output).__name__}")
        return output
    if kind == "compile_error":
        raise CompileError(None, str(reply[1]))
    if kind == "unlisted_include":
        raise UnlistedIncludeError(str(reply[1]), str(reply[2]))
    if kind == "recipe_error":
        raise RecipeError(str(reply[1]), str(reply[2]))
    if kind == "invalid_artifact":
        raise InvalidArtifactError(str(reply[1]))
    if kind == "dependency_trace":
        raise DependencyTraceError(str(reply[1]))
    if kind == "toolchain_error":
        raise ToolchainError(str(reply[1]))
    raise ToolchainError(f"the compile process failed: {reply[1]}: {reply[2]}")
