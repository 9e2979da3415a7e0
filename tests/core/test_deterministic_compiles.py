"""Every compile is seeded (``-frandom-seed``, :func:`kcache.nvrtc.compile_seed`), so two
compiles of one recipe are the same bytes in any two processes.

NVRTC tags internal-linkage names with a random number and the compiling process's id
unless it is given a seed, so the programs here (a template kernel, an anonymous
namespace, an anonymous-namespace kernel) differ in bytes between processes when
unseeded. One other process, in another working directory (LTO-IR and line information
record it unless kcache compiles in a removed one: :func:`kcache.nvrtc.reads_working_directory`),
compiles every recipe and writes its outputs; this process compiles them too (through
:func:`kcache.nvrtc.compile_recipe`, as everything does).
No compile here fails: a failing compile would spoil this process's NVRTC trace.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kcache.include_sets import IncludeSets
from kcache.nvrtc import compile_recipe, compile_seed
from kcache.recipe import LinkInput, Recipe
from kcache.toolchain import Toolchain

ROOT = Path(__file__).resolve().parents[2]

#: A template kernel (no external non-template definition names the module, so every
#: internal name gets the random tag), an anonymous-namespace variable and kernel.
ANON = """
namespace {
__device__ int calls;
__global__ void hidden(float* x) { x[0] += 1.0f; atomicAdd(&calls, 1); }
}
template <int N>
__global__ void scale(float* x) {
  x[threadIdx.x] *= N;
  atomicAdd(&calls, 1);
}
"""
EXPRESSIONS = ("scale<2>", "hidden")
#: A linked helper whose only external definition is a template instantiation, so its
#: internal names are tagged too; the main program calls it.
HELPER = """
namespace {
__device__ int factor = 3;
}
template <int N>
__device__ int times(int x) { return x * N * factor; }
template __device__ int times<2>(int);
"""
MAIN = """
template <int N> __device__ int times(int x);
extern "C" __global__ void use(int* x) { x[threadIdx.x] = times<2>(x[threadIdx.x]); }
"""


def _recipes(toolchain_id: str) -> dict[str, Recipe]:
    """The recipes both processes compile (the other process builds them with this function)."""

    def recipe(**fields: object) -> Recipe:
        return Recipe(target="sm_90", toolchain=toolchain_id, **fields)  # type: ignore[arg-type]

    helper = recipe(source=HELPER, output="ltoir", flags=("-rdc=true",))
    return {
        "cubin": recipe(source=ANON, name_expressions=EXPRESSIONS),
        "cubin_G": recipe(source=ANON, name_expressions=EXPRESSIONS, flags=("-G",)),
        "cubin_lineinfo": recipe(source=ANON, name_expressions=EXPRESSIONS, flags=("-lineinfo",)),
        "ltoir": recipe(source=ANON, name_expressions=EXPRESSIONS, output="ltoir"),
        "helper_ltoir": helper,
        "linked": recipe(
            source=MAIN, flags=("-rdc=true",), lto=True, link=(LinkInput(recipe=helper),)
        ),
    }


def _compile_all(toolchain: Toolchain) -> dict[str, tuple[bytes, dict[str, str]]]:
    """Every recipe's bytes and lowered names, compiled in this process."""
    recipes = _recipes(toolchain.id)
    done: dict[str, tuple[bytes, dict[str, str]]] = {}
    for name, recipe in recipes.items():
        link_inputs = [done["helper_ltoir"][0]] if recipe.lto else []
        output = compile_recipe(recipe, toolchain, IncludeSets(), link_inputs)
        done[name] = (output.data, dict(output.lowered_names))
    return done


# The same, in another process: writes each output to argv[1]/<name> and the lowered
# names and the process id as JSON on stdout.
_ELSEWHERE = """
import json, os, sys
from pathlib import Path
from kcache.toolchain import load_toolchain
from tests.core.test_deterministic_compiles import _compile_all

done = _compile_all(load_toolchain())
for name, (data, _) in done.items():
    (Path(sys.argv[1]) / name).write_bytes(data)
print(json.dumps({"pid": os.getpid(), "lowered": {n: low for n, (_, low) in done.items()}}))
"""


@pytest.fixture(scope="module")
def both(
    toolchain: Toolchain, tmp_path_factory: pytest.TempPathFactory
) -> tuple[dict[str, tuple[bytes, dict[str, str]]], dict[str, tuple[bytes, dict[str, str]]]]:
    """(this process's outputs, the other process's), the other started first: both run at once."""
    out = tmp_path_factory.mktemp("elsewhere")
    elsewhere = subprocess.Popen(
        [sys.executable, "-c", _ELSEWHERE, str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=out,  # not this process's working directory
        # KCACHE_TOOLCHAIN_DIR: the headers this session extracted
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        here = _compile_all(toolchain)
        stdout, stderr = elsewhere.communicate(timeout=300)
    finally:
        if elsewhere.poll() is None:
            elsewhere.kill()
            elsewhere.wait()
    assert elsewhere.returncode == 0, stderr
    answer = json.loads(stdout.strip().splitlines()[-1])
    assert answer["pid"] != os.getpid()
    there = {name: ((out / name).read_bytes(), answer["lowered"][name]) for name in here}
    return here, there


@pytest.mark.parametrize(
    "name", ["cubin", "cubin_G", "cubin_lineinfo", "ltoir", "helper_ltoir", "linked"]
)
def test_two_processes_compile_a_recipe_to_the_same_bytes(
    both: tuple[dict[str, tuple[bytes, dict[str, str]]], dict[str, tuple[bytes, dict[str, str]]]],
    name: str,
) -> None:
    here, there = both
    assert here[name][0] == there[name][0]
    assert here[name][1] == there[name][1]


def test_internal_names_carry_the_seed_of_the_recipes_base_key(
    toolchain: Toolchain,
    both: tuple[dict[str, tuple[bytes, dict[str, str]]], dict[str, tuple[bytes, dict[str, str]]]],
) -> None:
    """The programs have seed-dependent names (so the test above tests something), and the
    tag in them is the recipe's seed: in the outputs, and in the lowered name
    ``nvrtcGetLoweredName`` reported for the anonymous-namespace kernel, which is the
    name in the cubin. A template kernel's lowered name does not depend on the seed."""
    here, _ = both
    recipes = _recipes(toolchain.id)
    for name in (
        "cubin",
        "cubin_G",
        "cubin_lineinfo",
        "ltoir",
    ):  # LTO-IR's payload is scrambled: names only
        tag = f"_{compile_seed(recipes[name]):08x}"
        data, lowered = here[name]
        assert lowered["scale<2>"] == "_Z5scaleILi2EEvPf", name
        assert tag in lowered["hidden"], name
        if name != "ltoir":
            assert tag.encode() in data, name
            assert lowered["hidden"].encode() in data, name
            assert lowered["scale<2>"].encode() in data, name
    helper_tag = f"_{compile_seed(recipes['helper_ltoir']):08x}".encode()
    assert helper_tag in here["linked"][0]  # the linked helper's internal names: its own seed


def test_the_seed_is_the_base_keys_so_a_manifest_match_compiles_alike(toolchain: Toolchain) -> None:
    """Two recipes that differ in a header's contents alone share the base key, and so the
    seed; a different program gets another."""
    one = Recipe(
        source='#include "w.h"\n' + ANON,
        target="sm_90",
        toolchain=toolchain.id,
        headers={"w.h": "#define W 1\n"},
    )
    two = Recipe(
        source='#include "w.h"\n' + ANON,
        target="sm_90",
        toolchain=toolchain.id,
        headers={"w.h": "#define W 2\n"},
    )
    assert one.key() != two.key() and one.base_key() == two.base_key()
    assert compile_seed(one) == compile_seed(two) == int(one.base_key()[:8], 16)
    other = Recipe(source=ANON, target="sm_90", toolchain=toolchain.id)
    assert compile_seed(other) != compile_seed(one)
    assert 0 <= compile_seed(other) < 2**32
