"""Real NVRTC and nvJitLink compiles: outputs, validation, errors, specialization."""

from __future__ import annotations

import pytest

from kcache.elf import cubin_sm, validate_cubin
from kcache.errors import CompileError, InvalidArtifactError, RecipeError
from kcache.include_sets import IncludeSets
from kcache.nvrtc import compile_recipe
from kcache.recipe import LinkInput, Recipe
from kcache.targets import parse_target
from kcache.toolchain import Toolchain
from tests.support import VECTOR_ADD


def _compile(toolchain: Toolchain, link_inputs: list[bytes] | None = None, **fields: object):  # type: ignore[no-untyped-def]
    fields.setdefault("target", "sm_90")
    recipe = Recipe(**fields).with_defaults(toolchain=toolchain.id)  # type: ignore[arg-type]
    return compile_recipe(recipe, toolchain, IncludeSets(), link_inputs or [])


def test_vector_add_compiles_to_a_valid_sm90_cubin(toolchain: Toolchain) -> None:
    out = _compile(toolchain, source=VECTOR_ADD)
    assert out.kind == "cubin"
    assert cubin_sm(out.data) == 90
    validate_cubin(out.data, parse_target("sm_90a"))  # sm_90a shares e_flags with sm_90
    with pytest.raises(InvalidArtifactError, match="sm_90, but the target is sm_80"):
        validate_cubin(out.data, parse_target("sm_80"))


def test_elf_check_rejects_non_cuda_elves(toolchain: Toolchain) -> None:
    out = _compile(toolchain, source=VECTOR_ADD)
    with pytest.raises(InvalidArtifactError, match="not an ELF"):
        validate_cubin(b"// PTX text" + bytes(64), parse_target("sm_90"))
    not_cuda = bytearray(out.data)
    not_cuda[18:20] = (62).to_bytes(2, "little")  # EM_X86_64
    with pytest.raises(InvalidArtifactError, match="e_machine is 62"):
        validate_cubin(bytes(not_cuda), parse_target("sm_90"))


def test_output_is_deterministic(toolchain: Toolchain) -> None:
    assert (
        _compile(toolchain, source=VECTOR_ADD).data == _compile(toolchain, source=VECTOR_ADD).data
    )


def test_program_name_changes_the_bytes_with_line_info(toolchain: Toolchain) -> None:
    plain = _compile(toolchain, source=VECTOR_ADD, flags=["-lineinfo"])
    renamed = _compile(toolchain, source=VECTOR_ADD, flags=["-lineinfo"], name="x.cu")
    assert plain.data != renamed.data


def test_stride_specialization_changes_the_cubin(toolchain: Toolchain) -> None:
    source = """
    extern "C" __global__ void copy(const float* x, float* out, int n) {
      int i = blockIdx.x * blockDim.x + threadIdx.x;
      if (i < n) out[i] = x[i * KC_STRIDE_0];
    }"""
    one = _compile(toolchain, source=source, specialization={"strides": [1]})
    two = _compile(toolchain, source=source, specialization={"strides": [2]})
    assert one.data != two.data


def test_syntax_error_raises_with_the_compiler_message(toolchain: Toolchain) -> None:
    with pytest.raises(CompileError) as info:
        _compile(toolchain, source='extern "C" __global__ void k(float* o) { o[0] = ; }')
    assert "error: expected an expression" in info.value.log
    assert "kernel.cu(1)" in info.value.log


def test_fp16_kernel_compiles_with_bundled_headers(toolchain: Toolchain) -> None:
    source = """
    #include <cuda_fp16.h>
    extern "C" __global__ void scale(__half* x, int n) {
      int i = blockIdx.x * blockDim.x + threadIdx.x;
      if (i < n) x[i] = __hmul(x[i], __float2half(2.0f));
    }"""
    out = _compile(toolchain, source=source)
    assert cubin_sm(out.data) == 90
    assert out.dependencies == ()  # bundled headers belong to the toolchain id


@pytest.mark.slow
def test_cub_kernel_compiles(toolchain: Toolchain) -> None:
    source = """
    #include <cub/block/block_reduce.cuh>
    extern "C" __global__ void block_sum(const float* x, float* out) {
      using Reduce = cub::BlockReduce<float, 128>;
      __shared__ typename Reduce::TempStorage tmp;
      float total = Reduce(tmp).Sum(x[threadIdx.x]);
      if (threadIdx.x == 0) out[blockIdx.x] = total;
    }"""
    out = _compile(toolchain, source=source, flags=["-std=c++17"])
    assert cubin_sm(out.data) == 90


def test_ptx_output_and_lowered_names(toolchain: Toolchain) -> None:
    source = "template <typename T, int N> __global__ void fill(T* o) { o[threadIdx.x] = T(N); }"
    out = _compile(
        toolchain,
        source=source,
        target="compute_90",
        output="ptx",
        name_expressions=["fill<float, 256>"],
    )
    assert out.kind == "ptx"
    assert out.lowered_names == {"fill<float, 256>": "_Z4fillIfLi256EEvPT_"}
    assert b".entry _Z4fillIfLi256EEvPT_" in out.data


def test_ltoir_output_and_lto_link(toolchain: Toolchain) -> None:
    helper = Recipe(
        source="__device__ float triple(float x) { return 3.0f * x; }",
        target="sm_90",
        output="ltoir",
    )
    helper_out = _compile(
        toolchain, **{f: getattr(helper, f) for f in ("source", "target", "output")}
    )
    assert helper_out.kind == "ltoir" and not helper_out.data.startswith(b"\x7fELF")
    main = 'extern __device__ float triple(float); extern "C" __global__ void k(float* o) { o[0] = triple(o[0]); }'
    linked = _compile(
        toolchain,
        [helper_out.data],
        source=main,
        flags=["-rdc=true"],
        lto=True,
        link=[LinkInput(recipe=helper.with_defaults(toolchain=toolchain.id))],
    )
    assert linked.kind == "cubin" and cubin_sm(linked.data) == 90


def test_unsupported_target_is_refused(toolchain: Toolchain) -> None:
    with pytest.raises(RecipeError, match="sm_50 is not supported"):
        _compile(toolchain, source=VECTOR_ADD, target="sm_50")


def test_toolchain_check_refuses_what_it_cannot_compile(toolchain: Toolchain) -> None:
    """One check for a compile and the server: the toolchain id, the target, linked recipes."""
    ok = Recipe(source=VECTOR_ADD, target="sm_90").with_defaults(toolchain=toolchain.id)
    toolchain.check(ok)
    with pytest.raises(RecipeError, match="not available on this server") as caught:
        toolchain.check(
            Recipe(source=VECTOR_ADD, target="sm_90", toolchain="other"), "on this server"
        )
    assert caught.value.field == "toolchain"
    with pytest.raises(RecipeError, match="sm_20 is not supported by NVRTC") as caught:
        _compile(toolchain, source=VECTOR_ADD, target="sm_20")  # a compile makes the same check
    assert caught.value.field == "target"
    linked = Recipe(source=VECTOR_ADD, target="sm_20", output="ltoir", toolchain=toolchain.id)
    outer = Recipe(
        source=VECTOR_ADD,
        target="sm_90",
        lto=True,
        link=[LinkInput(recipe=linked)],
        toolchain=toolchain.id,
    )
    with pytest.raises(RecipeError) as caught:
        toolchain.check(outer)
    assert caught.value.field == "link[0].recipe.target"
