"""The CuPy, cuda.core and PyTorch adapters on the CPU: option translation, refusals, keys, real NVRTC.

Every NVRTC option CuPy passes and every ``ProgramOptions`` field cuda.core has either
becomes a recipe field with the same meaning or is refused naming it. Recipes made
from the three spellings of one compile share a key, and compile with the real NVRTC
(local compiles into a temporary node tier). Launches are checked on the GPU by
``tests/gpu/adapters_check.py``.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kcache_client import KernelCache

from kcache import Recipe
from kcache.errors import RecipeError
from kcache.options import (
    CUPY_IMPLICIT_FLAGS,
    INCLUDE_DIR_MAX_FILES,
    translate_nvrtc_options,
)

CUPY_FLAGS = ("-ftz=true", "-default-device")  # CUPY_IMPLICIT_FLAGS, canonical
SCALE = """
template <typename T, int K>
__global__ void scale(T* x, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] = x[i] * K;
}
"""
PLAIN = 'extern "C" __global__ void inc(float* x) { x[threadIdx.x] += 1.0f; }\n'


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KernelCache]:
    """A client with no server: every miss compiles here with the real NVRTC."""
    with pytest.MonkeyPatch.context() as env:
        env.delenv("KCACHE_URL", raising=False)  # no server: local compiles are on
        env.delenv("KCACHE_LOCAL_COMPILE", raising=False)
        kc = KernelCache(cache_dir=tmp_path_factory.mktemp("tier"))
        yield kc
        kc.close()


# ----------------------------------------------------------------------------- translation
# (every spelling of an option) -> the canonical recipe flag
SPELLINGS: list[tuple[list[tuple[str, ...]], str]] = [
    ([("-std=c++17",), ("--std=c++17",)], "-std=c++17"),
    ([("-std=c++03",), ("--std=c++03",)], "-std=c++03"),
    ([("-DN=4",), ("-D", "N=4"), ("--define-macro=N=4",), ("--define-macro", "N=4")], "-DN=4"),
    ([("-DFLAG",), ("-D", "FLAG"), ("--define-macro=FLAG",)], "-DFLAG"),
    ([("-DF(x)=x*2",), ("-D", "F(x)=x*2")], "-DF(x)=x*2"),
    ([("-UX",), ("-U", "X"), ("--undefine-macro=X",), ("--undefine-macro", "X")], "-UX"),
    ([("-rdc=true",), ("--relocatable-device-code=true",), ("-dc",), ("--device-c",)], "-rdc=true"),
    (
        [("-rdc=false",), ("--relocatable-device-code=false",), ("-dw",), ("--device-w",)],
        "-rdc=false",
    ),
    ([("-ewp",), ("--extensible-whole-program",)], "-ewp"),
    ([("-G",), ("--device-debug",)], "-G"),
    ([("-lineinfo",), ("--generate-line-info",)], "-lineinfo"),
    ([("-dopt=on",), ("--dopt=on",)], "-dopt=on"),
    ([("-maxrregcount=32",), ("--maxrregcount=32",), ("-maxrregcount", "32")], "-maxrregcount=32"),
    ([("-ftz=true",), ("--ftz=true",)], "-ftz=true"),
    ([("-prec-sqrt=false",), ("--prec-sqrt=false",)], "-prec-sqrt=false"),
    ([("-prec-div=false",), ("--prec-div=false",)], "-prec-div=false"),
    ([("-fmad=false",), ("--fmad=false",)], "-fmad=false"),
    ([("-use_fast_math",), ("--use_fast_math",)], "--use_fast_math"),
    (
        [("-extra-device-vectorization",), ("--extra-device-vectorization",)],
        "-extra-device-vectorization",
    ),
    ([("-default-device",), ("--device-as-default-execution-space",)], "-default-device"),
    ([("-restrict",), ("--restrict",)], "-restrict"),
    ([("-device-int128",), ("--device-int128",)], "-device-int128"),
    (
        [("-builtin-move-forward=false",), ("--builtin-move-forward=false",)],
        "-builtin-move-forward=false",
    ),
    (
        [("-builtin-initializer-list=false",), ("--builtin-initializer-list=false",)],
        "-builtin-initializer-list=false",
    ),
    ([("-w",), ("--disable-warnings",)], "-w"),
    ([("-Werror=all-warnings",)], "-Werror=all-warnings"),
    ([("-err-no",), ("--display-error-number",)], "--display-error-number"),
    ([("-no-err-no",), ("--no-display-error-number",)], "--no-display-error-number"),
    ([("-diag-error=20",), ("--diag-error=20",)], "-diag-error=20"),
    ([("-diag-suppress=177",), ("--diag-suppress=177",)], "-diag-suppress=177"),
    ([("-diag-warn=550",), ("--diag-warn=550",)], "-diag-warn=550"),
    ([("-split-compile=4",), ("--split-compile=4",)], "-split-compile=4"),
    ([("-fdevice-syntax-only",), ("--fdevice-syntax-only",)], "-fdevice-syntax-only"),
    ([("-minimal",), ("--minimal",)], "-minimal"),
    ([("-Ofast-compile=min",), ("--Ofast-compile=min",)], "--Ofast-compile=min"),
    (
        [("-modify-stack-limit=false",), ("--modify-stack-limit=false",)],
        "-modify-stack-limit=false",
    ),
]


@pytest.mark.parametrize(("spellings", "canonical"), SPELLINGS, ids=[c for _, c in SPELLINGS])
def test_every_spelling_of_an_option_becomes_one_canonical_flag(
    spellings: list[tuple[str, ...]], canonical: str
) -> None:
    for spelling in spellings:
        translated = translate_nvrtc_options(spelling)
        assert translated.flags == (canonical,), spelling
        assert translated.target is None and not translated.include_dirs


def test_every_canonical_flag_is_one_a_recipe_accepts() -> None:
    flags = [canonical for _, canonical in SPELLINGS]
    recipe = Recipe(source=PLAIN, target="sm_90", flags=flags)  # the allow-list refuses others
    assert list(recipe.flags) == flags


@pytest.mark.parametrize(
    "spelling",
    [
        ("-arch=sm_80",),
        ("-arch", "sm_80"),
        ("--gpu-architecture=sm_80",),
        ("--gpu-architecture", "sm_80"),
    ],
)
def test_arch_in_every_spelling_is_the_target(spelling: tuple[str, ...]) -> None:
    assert translate_nvrtc_options(spelling).target == "sm_80"
    recipe = Recipe.from_cupy(PLAIN, spelling)
    assert (recipe.target, recipe.output) == ("sm_80", "cubin")


def test_a_virtual_arch_compiles_to_ptx_for_cupy_and_is_refused_for_a_cuda_core_cubin() -> None:
    recipe = Recipe.from_cupy(PLAIN, ("-arch=compute_90",))
    assert (recipe.target, recipe.output) == ("compute_90", "ptx")
    with pytest.raises(RecipeError, match="compute_90 is virtual"):
        Recipe.from_cuda_core(PLAIN, ["-arch=compute_90"], "cubin")
    assert Recipe.from_cuda_core(PLAIN, ["-arch=compute_90"], "ptx").output == "ptx"


def test_options_kcache_always_uses_are_dropped() -> None:
    assert translate_nvrtc_options(("--use-bundled-headers=/x",)).flags == ()
    for spelling in [("-no-source-include",), ("--no-source-include",)]:  # the caller's choice
        assert translate_nvrtc_options(spelling).flags == ("-no-source-include",), spelling


def test_the_last_setting_wins_and_macros_keep_their_order() -> None:
    translated = translate_nvrtc_options(
        [
            *("-DA=1", "-ftz=false", "--use_fast_math", "-UA", "-std=c++14", "-ftz=true", "-DA=2"),
            *("--std=c++17", "-diag-suppress=2,1", "-diag-error=1", "-dc", "-rdc=false"),
        ]
    )
    assert translated.flags == (
        "-std=c++17",
        "-DA=1",
        "-UA",
        "-DA=2",
        "-rdc=false",
        "-ftz=true",
        "--use_fast_math",
        "-diag-error=1",
        "-diag-suppress=2",
    )


def test_cupy_adds_its_own_options_after_the_users() -> None:
    assert tuple(CUPY_IMPLICIT_FLAGS) == ("-ftz=true", "--device-as-default-execution-space")
    assert Recipe.from_cupy(PLAIN).flags == CUPY_FLAGS
    # CuPy's -ftz=true comes last, so a user's -ftz=false loses (NVRTC: the last one wins).
    assert Recipe.from_cupy(PLAIN, ("-ftz=false", "-std=c++17")).flags == (
        "-std=c++17",
        *CUPY_FLAGS,
    )


# ----------------------------------------------------------------------------- refusals
REFUSED: list[tuple[tuple[str, ...], str]] = [
    (("-time=t.csv",), "writes a file"),
    (("--time=t.csv",), "writes a file"),
    (("-fdevice-time-trace=t",), "writes a file"),
    (("--fdevice-time-trace=t",), "writes a file"),
    (("-pch",), "precompiled headers"),
    (("--pch",), "precompiled headers"),
    (("--create-pch=a.pch",), "precompiled headers"),
    (("--use-pch=a.pch",), "precompiled headers"),
    (("--pch-dir=/tmp",), "precompiled headers"),
    (("--pch-verbose=true",), "precompiled headers"),
    (("--pch-messages=true",), "precompiled headers"),
    (("--instantiate-templates-in-pch=true",), "precompiled headers"),
    (("-include", "a.h"), "pre-includes"),
    (("--pre-include=a.h",), "pre-includes"),
    (("-Xptxas", "-v"), "ptxas options"),
    (("--ptxas-options=-v",), "ptxas options"),
    (("--gen-opt-lto",), "nvJitLink"),
    (("-gen-opt-lto",), "nvJitLink"),
    (("-opt-info=inline",), "allow-list"),
    (("--optimization-info=inline",), "allow-list"),
    (("--brief-diagnostics=true",), "allow-list"),
    (("-brief-diag=true",), "allow-list"),
    (("--device-float128",), "allow-list"),
    (("--frandom-seed=3",), "allow-list"),
    (("--numba-debug",), "allow-list"),
    (("--jump-table-density=50",), "allow-list"),
    (("--device-stack-protector=true",), "allow-list"),
    (("-O3",), "no NVRTC option"),
    (("--no-such-option",), "not an NVRTC option kcache knows"),
    (("-ftz=maybe",), "one of true, false"),
    (("-std=c++23",), "c++03, c++11, c++14, c++17 or c++20"),
    (("-maxrregcount=many",), "a number"),
    (("-diag-suppress=1,x",), "numbers separated by commas"),
    (("-dopt=maybe",), "one of on, off"),
    (("-G=1",), "takes no value"),
    (("-ftz",), "needs a value"),
    (("-D",), "needs a value after it"),
    (("-D", "1X"), "not a macro definition"),
    (("-U", "X=1"), "does not name a macro"),
    (("-arch=sm_9x",), "is not a target"),
]


@pytest.mark.parametrize(("options", "why"), REFUSED, ids=[" ".join(o) for o, _ in REFUSED])
def test_refused_options_are_named_with_the_reason(options: tuple[str, ...], why: str) -> None:
    with pytest.raises(RecipeError) as caught:
        Recipe.from_cupy(PLAIN, ("-std=c++17", *options))
    message = str(caught.value)
    assert message.startswith("options[1]") and why in message
    assert options[0] in message  # the option as written


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"backend": "nvcc"}, "backend"),
        ({"jitify": True}, "jitify"),
        ({"translate_cucomplex": True}, "translate_cucomplex"),
        ({"enable_cooperative_groups": True}, "enable_cooperative_groups"),
        ({"options": "-std=c++17"}, "options"),
        ({"options": ("-dlto",)}, "options"),
        ({"options": ("-DCUPY_USE_JITIFY",)}, "options"),
        ({"options": ("-arch=sm_80",), "target": "sm_90"}, "target"),
        ({"options": (17,)}, "options[0]"),
        ({"name_expressions": "scale<float, 3>"}, "name_expressions"),
    ],
)
def test_cupy_arguments_kcache_cannot_honour_are_refused(
    kwargs: dict[str, Any], field: str
) -> None:
    with pytest.raises(RecipeError) as caught:
        Recipe.from_cupy(SCALE, **kwargs)
    assert caught.value.field == field


def test_lto_is_an_output_for_cuda_core_and_refused_for_another_target_type() -> None:
    assert Recipe.from_cuda_core(SCALE, ["-arch=sm_90", "-dlto"], "ltoir").output == "ltoir"
    with pytest.raises(RecipeError, match="target_type is 'cubin'"):
        Recipe.from_cuda_core(SCALE, ["-arch=sm_90", "-dlto"], "cubin")
    with pytest.raises(RecipeError, match="'elf' is not one of"):
        Recipe.from_cuda_core(SCALE, None, "elf")


# ----------------------------------------------------------------------------- cuda.core fields
def _program_options() -> Any:
    core = pytest.importorskip("cuda.core")
    options = getattr(core, "ProgramOptions", None)
    if options is None:
        options = pytest.importorskip("cuda.core.experimental").ProgramOptions
    return options


# Each ProgramOptions field with a value, and what it becomes: a flag (str), a recipe
# attribute (tuple), or a refusal naming it (Exception).
FIELDS: dict[str, tuple[Any, Any]] = {
    "name": ("scale.cu", ("name", "scale.cu")),
    "arch": ("sm_80", ("target", "sm_80")),
    "relocatable_device_code": (True, "-rdc=true"),
    "extensible_whole_program": (True, "-ewp"),
    "debug": (True, "-G"),
    "lineinfo": (True, "-lineinfo"),
    "device_code_optimize": (True, "-dopt=on"),
    "ptxas_options": (["-v"], RecipeError),
    "max_register_count": (32, "-maxrregcount=32"),
    "ftz": (True, "-ftz=true"),
    "prec_sqrt": (False, "-prec-sqrt=false"),
    "prec_div": (False, "-prec-div=false"),
    "fma": (False, "-fmad=false"),
    "use_fast_math": (True, "--use_fast_math"),
    "extra_device_vectorization": (True, "-extra-device-vectorization"),
    "link_time_optimization": (True, ("output", "ltoir")),
    "gen_opt_lto": (True, RecipeError),
    "define_macro": ([("N", "4"), "FLAG"], "-DN=4"),
    "undefine_macro": ("X", "-UX"),
    "include_path": ("<dir>", ("headers", "tile.h")),
    "use_bundled_headers": (True, ("flags", ())),
    "pre_include": ("a.h", RecipeError),
    "no_source_include": (True, "-no-source-include"),
    "std": ("c++17", "-std=c++17"),
    "builtin_move_forward": (False, "-builtin-move-forward=false"),
    "builtin_initializer_list": (False, "-builtin-initializer-list=false"),
    "disable_warnings": (True, "-w"),
    "restrict": (True, "-restrict"),
    "device_as_default_execution_space": (True, "-default-device"),
    "device_int128": (True, "-device-int128"),
    "optimization_info": ("inline", RecipeError),
    "no_display_error_number": (True, "--no-display-error-number"),
    "diag_error": (20, "-diag-error=20"),
    "diag_suppress": ([177, 550], "-diag-suppress=550"),
    "diag_warn": (177, "-diag-warn=177"),
    "brief_diagnostics": (True, RecipeError),
    "time": ("t.csv", RecipeError),
    "split_compile": (4, "-split-compile=4"),
    "fdevice_syntax_only": (True, "-fdevice-syntax-only"),
    "minimal": (True, "-minimal"),
    "no_cache": (True, ("flags", ())),
    "fdevice_time_trace": ("t", RecipeError),
    "device_float128": (True, RecipeError),
    "frandom_seed": ("3", RecipeError),
    "ofast_compile": ("min", "--Ofast-compile=min"),
    "pch": (True, RecipeError),
    "create_pch": ("a.pch", RecipeError),
    "use_pch": ("a.pch", RecipeError),
    "pch_dir": ("/tmp", RecipeError),
    "pch_verbose": (True, RecipeError),
    "pch_messages": (True, RecipeError),
    "instantiate_templates_in_pch": (True, RecipeError),
    "extra_sources": ([("a", "b")], RecipeError),
    "use_libdevice": (True, RecipeError),
    "numba_debug": (True, RecipeError),
}


def test_every_program_options_field_maps_to_a_recipe_field_or_is_refused_by_name(
    tmp_path: Path,
) -> None:
    options_type = _program_options()
    (tmp_path / "tile.h").write_text("#pragma once\n")
    fields = [f.name for f in dataclasses.fields(options_type)]
    missing = sorted(set(fields) - set(FIELDS))
    assert not missing, f"ProgramOptions fields kcache.options does not know yet: {missing}"
    for field in fields:
        value, expected = FIELDS[field]
        value = str(tmp_path) if value == "<dir>" else value
        kwargs = {"arch": "sm_90", field: value}  # arch None asks the device (no GPU here)
        target_type = "ltoir" if field == "link_time_optimization" else "cubin"
        if expected is RecipeError:
            with pytest.raises(RecipeError) as caught:
                Recipe.from_cuda_core(SCALE, options_type(**kwargs), target_type)
            assert field in str(caught.value), (field, str(caught.value))
            continue
        recipe = Recipe.from_cuda_core(SCALE, options_type(**kwargs), target_type)
        if isinstance(expected, str):
            assert expected in recipe.flags, (field, recipe.flags)
        else:
            attribute, want = expected
            got = getattr(recipe, attribute)
            assert (want in got) if attribute == "headers" else got == want, (field, got)


# ----------------------------------------------------------------------------- one key
def test_equivalent_cupy_cuda_core_and_recipe_spellings_share_a_key(cache: KernelCache) -> None:
    cupy_options = ("--std=c++17", "-D", "N=4", "-DFLAG", "--use_fast_math", "-arch", "sm_90")
    nvrtc_list = ["-arch=sm_90", "-default-device", "-DN=4", "-std=c++17", "-ftz=true"]
    nvrtc_list += ["--define-macro=FLAG", "-use_fast_math"]
    flags = ["-std=c++17", "-DN=4", "-DFLAG", "-ftz=true", "--use_fast_math", "-default-device"]
    by_hand = Recipe(
        source=SCALE, target="sm_90", flags=flags, name_expressions=["scale<float, 3>"]
    )
    spellings = [
        Recipe.from_cupy(SCALE, cupy_options, ["scale<float, 3>"]),
        Recipe.from_cuda_core(SCALE, nvrtc_list, "cubin", ["scale<float, 3>"]),
    ]
    try:
        options_type = _program_options()
    except pytest.skip.Exception:
        options_type = None
    if options_type is not None:
        program_options = options_type(
            arch="sm_90",
            std="c++17",
            define_macro=[("N", "4"), "FLAG"],
            use_fast_math=True,
            ftz=True,
            device_as_default_execution_space=True,
        )
        spellings.append(
            Recipe.from_cuda_core(SCALE, program_options, "cubin", ["scale<float, 3>"])
        )
    keys = {cache.key(recipe) for recipe in [by_hand, *spellings]}
    assert len(keys) == 1
    # ... and a real difference still makes another key.
    assert (
        cache.key(Recipe.from_cupy(SCALE, (*cupy_options, "-DM=1"), ["scale<float, 3>"]))
        not in keys
    )


# ----------------------------------------------------------------------------- -I directories
def test_an_include_dir_that_is_a_registered_set_becomes_that_set(tmp_path: Path) -> None:
    root = tmp_path / "cutlass" / "include"
    root.mkdir(parents=True)
    (root / "big.h").write_text("#pragma once\n")
    link = tmp_path / "via-link"
    link.symlink_to(root)
    recipe = Recipe.from_cupy(
        PLAIN, ("-I", str(link)), registered_include_sets={"cutlass": root}, include_sets=["cccl"]
    )
    assert list(recipe.include_sets) == ["cccl", "cutlass"] and dict(recipe.headers) == {}


def test_a_small_include_dir_becomes_in_memory_headers(tmp_path: Path) -> None:
    first, second = tmp_path / "a", tmp_path / "b"
    (first / "sub").mkdir(parents=True)
    (second / ".git").mkdir(parents=True)
    (first / "tile.h").write_text("// first\n")
    (first / "sub" / "deep.cuh").write_text("// deep\n")
    (first / "notes.txt").write_text("not a header\n")
    (first / "blob.h").write_bytes(b"\xff\xfe binary")
    (second / "tile.h").write_text("// second\n")
    (second / "only.hpp").write_text("// only\n")
    (second / ".git" / "config.h").write_text("// hidden\n")
    recipe = Recipe.from_cupy(
        PLAIN, (f"-I{first}", "--include-path", str(second)), headers={"only.hpp": "// given\n"}
    )
    # The first -I directory wins, as in NVRTC's search; headers given by name win over both.
    assert dict(recipe.headers) == {
        "tile.h": "// first\n",
        "sub/deep.cuh": "// deep\n",
        "only.hpp": "// given\n",
    }


def test_a_large_include_dir_asks_for_an_include_set(tmp_path: Path) -> None:
    for i in range(INCLUDE_DIR_MAX_FILES + 1):
        (tmp_path / f"h{i}.h").write_text("//\n")
    with pytest.raises(RecipeError) as caught:
        Recipe.from_cupy(PLAIN, ("-std=c++17", "-I", str(tmp_path)))
    assert caught.value.field == "options[1]" and "register the directory as an include set" in str(
        caught.value
    )
    with pytest.raises(RecipeError, match="not a directory"):
        Recipe.from_cupy(PLAIN, ("-I", str(tmp_path / "absent")))


# ----------------------------------------------------------------------------- real NVRTC
def test_translated_recipes_compile_with_nvrtc_and_keep_lowered_names(
    cache: KernelCache, tmp_path: Path
) -> None:
    from kcache_client.cuda_core import Program
    from kcache_client.cupy import RawKernel, RawModule

    (tmp_path / "twice.cuh").write_text(
        "template <typename T> __device__ T twice(T v) { return v + v; }\n"
    )
    headered = '#include "twice.cuh"\nextern "C" __global__ void dbl(int* x) { x[threadIdx.x] = twice(x[threadIdx.x]); }\n'
    module = RawModule(
        code=SCALE,
        options=("-std=c++17",),
        name_expressions=("scale<float, 3>", "scale<double, 2>"),
        cache=cache,
        target="sm_90",
    )
    assert module.recipe == Recipe.from_cupy(
        SCALE, ("-std=c++17",), ("scale<float, 3>", "scale<double, 2>"), target="sm_90"
    )
    artifact = cache.get(module.recipe)
    assert artifact.kind == "cubin" and artifact.metadata.target == "sm_90"
    assert artifact.lowered_names == {
        "scale<float, 3>": "_Z5scaleIfLi3EEvPT_i",
        "scale<double, 2>": "_Z5scaleIdLi2EEvPT_i",
    }
    headers = cache.get(Recipe.from_cupy(headered, ("-I", str(tmp_path)), target="sm_90"))
    assert [d.name for d in headers.metadata.dependencies] == ["twice.cuh"]
    kernel = RawKernel(
        SCALE, "scale<int, 5>", cache=cache, target="sm_90"
    )  # beyond CuPy: an expression
    assert kernel.recipe is not None and kernel.bypass is None
    assert cache.get(kernel.recipe).lowered_names == {"scale<int, 5>": "_Z5scaleIiLi5EEvPT_i"}
    ptx = cache.get(
        Program(SCALE, "c++", ["-arch=sm_90"], cache=cache).recipe("ptx", ["scale<float, 3>"])
    )
    assert ptx.kind == "ptx" and b".entry _Z5scaleIfLi3EEvPT_i" in ptx.data


@pytest.mark.slow
def test_cccl_with_cxx17_compiles_through_the_cupy_spelling(cache: KernelCache) -> None:
    source = """
#include <cub/block/block_reduce.cuh>
#include <cuda/std/type_traits>
template <int BLOCK>
__global__ void block_sum(const int* x, int* out) {
  using Reduce = cub::BlockReduce<int, BLOCK>;
  __shared__ typename Reduce::TempStorage storage;
  int v = x[blockIdx.x * BLOCK + threadIdx.x];
  if constexpr (cuda::std::is_same_v<int, int>) { v = Reduce(storage).Sum(v); }
  if (threadIdx.x == 0) out[blockIdx.x] = v;
}
"""
    artifact = cache.get(
        Recipe.from_cupy(source, ("-std=c++17",), ["block_sum<128>"], target="sm_90")
    )
    assert artifact.lowered_names == {"block_sum<128>": "_Z9block_sumILi128EEvPKiPi"}
    assert artifact.kind == "cubin" and "-std=c++17" in artifact.recipe.flags


# ----------------------------------------------------------------------------- wrappers
def test_cuda_core_program_refuses_what_it_cannot_serve(cache: KernelCache) -> None:
    from kcache_client.cuda_core import Program

    program = Program(SCALE, "c++", ["-arch=sm_90"], cache=cache)
    program.close()
    with pytest.raises(RuntimeError, match="closed"):
        program.compile("cubin")


def test_cuda_core_program_answers_as_cuda_core_does(cache: KernelCache) -> None:
    """What cuda.core's own tests/test_program.py asks of a Program, through kcache."""
    options_type = _program_options()
    from kcache_client.cuda_core import Program

    program = Program(PLAIN, "c++", options=options_type(name="42", arch="sm_90"), cache=cache)
    ptx = program.compile("ptx")
    assert program.last_bypass is None  # compiled by kcache, not handed to cuda.core
    assert type(ptx).__name__ == "ObjectCode" and ptx.name == "42"  # ProgramOptions.name
    assert b".version" in bytes(ptx.code)
    assert program.backend == "NVRTC"
    typing = pytest.importorskip("cuda.core.typing")
    assert isinstance(program.backend, typing.CompilerBackendType)
    program.close()
    with pytest.raises(RuntimeError, match=r"^Program has been closed$"):
        program.compile("ptx")


def test_a_debug_compile_named_by_cuda_core_s_own_source_file_is_cuda_core_s() -> None:
    options_type = _program_options()
    from kcache_client.cuda_core import debug_source_bypass

    class Materializing:  # cuda.core 1.2's Program writes such a file; older ones do not
        _try_materialize_nvrtc_debug_source = None

    for debug in (dict(debug=True), dict(lineinfo=True), dict(debug=True, name="default_program")):
        bypass = debug_source_bypass(options_type(arch="sm_90", **debug), Materializing)
        assert bypass is not None and bypass.reason == "debug-source-file"
    assert debug_source_bypass(options_type(arch="sm_90", debug=True), object) is None
    assert (
        debug_source_bypass(options_type(arch="sm_90", debug=True, name="k.cu"), Materializing)
        is None
    )
    assert debug_source_bypass(options_type(arch="sm_90"), Materializing) is None
    assert debug_source_bypass(["-G"], Materializing) is None


def test_program_cache_is_a_cuda_core_cache_resource_on_the_node_tier(tmp_path: Path) -> None:
    pytest.importorskip("cuda.core")
    utils = pytest.importorskip("cuda.core.utils")
    if not hasattr(utils, "ProgramCacheResource"):
        pytest.skip("cuda.core before 1.0 has no ProgramCacheResource")
    from kcache_client.cuda_core import program_cache

    kc = KernelCache(cache_dir=tmp_path)
    resource = program_cache(kc)
    assert isinstance(resource, utils.ProgramCacheResource)
    cubin, ptx = b"\x7fELF" + bytes(100), b"//\n.version 8.0\n.target sm_90\n"
    resource[b"key-1"] = cubin
    resource["key-2"] = bytearray(ptx)
    assert resource[b"key-1"] == cubin and resource.get(b"key-2") == ptx  # str and bytes keys agree
    assert resource.get(b"absent") is None and len(resource) == 2
    with pytest.raises(KeyError):
        resource[b"absent"]
    assert {e.kind for e in kc.tier.entries()} == {"cubin", "ptx"}
    # Another process's view of the same tier sees the entries.
    assert program_cache(KernelCache(cache_dir=tmp_path))[b"key-1"] == cubin
    del resource[b"key-1"]
    with pytest.raises(KeyError):
        del resource[b"key-1"]
    resource.clear()
    assert len(resource) == 0 and resource.get("key-2") is None


def test_adapters_import_without_their_libraries_and_name_the_package_when_used(
    tmp_path: Path,
) -> None:
    script = f"""
import sys
for blocked in ("cupy", "cuda.core", "cuda.core.experimental", "cuda.core.utils"):
    sys.modules[blocked] = None  # an import of it raises ImportError, as when not installed
import kcache_client
assert not any(m in sys.modules for m in ("kcache_client.cupy", "kcache_client.cuda_core", "kcache_client.torch"))
from kcache_client import KernelCache
from kcache_client.cupy import RawModule
from kcache_client.cuda_core import Program, program_cache
cache = KernelCache(cache_dir={str(tmp_path)!r})
module = RawModule(code={PLAIN!r}, cache=cache)   # the options are translated without CuPy
for use in (lambda: module.get_function("inc"), lambda: program_cache(cache),
            lambda: Program({PLAIN!r}, options=None, cache=cache).compile("cubin")):
    try:
        use()
    except ImportError as exc:
        print(exc)
"""
    env = {k: v for k, v in os.environ.items() if k not in ("KCACHE_URL", "KCACHE_LOCAL_COMPILE")}
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True
    ).stdout.splitlines()
    assert len(out) == 3, out
    assert "pip install cupy-cuda13x" in out[0]
    assert "pip install 'cuda-core>=1.0'" in out[1]
    assert "pip install 'kcache-client[cuda-core]'" in out[2]


# ----------------------------------------------------------------------------- torch
def test_torch_arguments_are_checked_against_the_signature_and_packed_by_type() -> None:
    torch = pytest.importorskip("torch")
    np = pytest.importorskip("numpy")
    from kcache_client.torch import pack_arguments, parse_signature

    params = parse_signature(("const float* __restrict__", "float*", "int", "float", "uint32_t"))
    assert [(p.pointer, p.dtype) for p in params] == [
        (True, "float32"),
        (True, "float32"),
        (False, "int32"),
        (False, "float32"),
        (False, "uint32"),
    ]
    x = torch.ones(4)
    with pytest.raises(ValueError, match=r"the tensor is on cpu, the launch runs on cuda:0"):
        pack_arguments([x, x, 1, 1.0, 1], device=0, params=params)
    with pytest.raises(TypeError, match=r"takes torch.float32, the tensor is torch.float64"):
        pack_arguments([x.double(), x, 1, 1.0, 1], device=0, params=params)
    with pytest.raises(ValueError, match="contiguous"):
        pack_arguments([torch.ones(4, 4).t(), x, 1, 1.0, 1], device=0, params=params)
    with pytest.raises(TypeError, match="takes 5 arguments"):
        pack_arguments([x], device=0, params=params)
    scalars = pack_arguments(
        [7, 0.1, 2**32 - 1], device=0, params=parse_signature(["int", "float", "uint32_t"])
    )
    assert [type(v) for v in scalars] == [np.int32, np.float32, np.uint32]
    assert scalars[1] == np.float32(0.1) and int(scalars[2]) == 2**32 - 1
    with pytest.raises(OverflowError, match="does not fit int32"):
        pack_arguments([2**40], device=0, params=parse_signature(["int"]))
    with pytest.raises(TypeError, match="integer parameter"):
        pack_arguments([1.5], device=0, params=parse_signature(["int"]))
    by_size = pack_arguments([3, 2.5, 4, 1.5], device=0, sizes=[4, 4, 8, 8])
    assert [type(v) for v in by_size] == [np.int32, np.float32, np.int64, np.float64]
    with pytest.raises(TypeError, match="no parameter type known"):
        pack_arguments([3], device=0)
    with pytest.raises(ValueError, match="unknown pointee type"):
        parse_signature(["my_struct*"])
