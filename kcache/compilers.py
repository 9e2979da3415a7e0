"""The ``Compiler`` seam: who runs NVRTC for the engine (in this process, or in workers)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from kcache.artifact import CompileOutput
from kcache.include_sets import IncludeSets
from kcache.nvrtc import compile_recipe
from kcache.recipe import Recipe
from kcache.toolchain import Toolchain

__all__ = ["Compiler", "InProcessCompiler"]


@runtime_checkable
class Compiler(Protocol):
    """Turns a resolved recipe into compiler output, or raises CompileError."""

    toolchain: Toolchain
    include_sets: IncludeSets

    def compile(self, recipe: Recipe, link_inputs: Sequence[bytes] = ()) -> CompileOutput:
        """Compile (and link) ``recipe``; ``link_inputs`` are its link entries' bytes."""
        ...


class InProcessCompiler:
    """Calls NVRTC in the calling thread: for the CLI and local compiles on a worker node."""

    def __init__(self, toolchain: Toolchain, include_sets: IncludeSets | None = None) -> None:
        self.toolchain = toolchain
        self.include_sets = include_sets or IncludeSets()

    def compile(self, recipe: Recipe, link_inputs: Sequence[bytes] = ()) -> CompileOutput:
        """Compile in this process."""
        return compile_recipe(recipe, self.toolchain, self.include_sets, link_inputs)
