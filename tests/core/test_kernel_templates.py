"""A kernel template compiled without a name expression is an error naming the fix.

NVRTC instantiates ``template <...> __global__`` kernels only for name expressions
(or explicit instantiations); without either it "succeeds" with an output holding no
kernel at all. Real NVRTC compiles, in this process and through the fresh-process path.
"""

from __future__ import annotations

import pytest

from kcache.errors import RecipeError
from kcache.include_sets import IncludeSets
from kcache.nvrtc import compile_recipe
from kcache.recipe import Recipe
from kcache.toolchain import Toolchain

TEMPLATE = "template <typename T, int K>\n__global__ void scale(T* x) { x[threadIdx.x] *= K; }\n"


def _compile(toolchain: Toolchain, **fields: object) -> bytes:
    fields.setdefault("target", "sm_90")
    recipe = Recipe(**fields).with_defaults(toolchain=toolchain.id)  # type: ignore[arg-type]
    return compile_recipe(recipe, toolchain, IncludeSets()).data


@pytest.mark.parametrize("output", [{"target": "sm_90"}, {"target": "compute_90", "output": "ptx"}])
def test_a_template_kernel_without_a_name_expression_is_refused(
    toolchain: Toolchain, output: dict[str, str]
) -> None:
    with pytest.raises(RecipeError) as refused:
        _compile(toolchain, source=TEMPLATE, **output)
    assert refused.value.field == "name_expressions"
    assert "no kernel" in refused.value.detail and "scale<float>" in refused.value.detail


@pytest.mark.parametrize(
    "fields",
    [
        {"name_expressions": ["scale<float, 2>"]},
        {"source": TEMPLATE + "template __global__ void scale<float, 2>(float*);\n"},
        {"flags": ["-rdc=true"]},  # relocatable code may rightly hold no kernel (a later link)
        {"output": "ltoir"},
        {
            "source": '__device__ int helper(int a) { return a + 1; }\nextern "C" __global__ void k() {}\n'
        },
    ],
)
def test_outputs_that_hold_a_kernel_or_may_rightly_hold_none_pass(
    toolchain: Toolchain, fields: dict[str, object]
) -> None:
    fields = {"source": TEMPLATE, **fields}
    assert _compile(toolchain, **fields)


def test_a_source_of_device_functions_only_is_not_a_template_mistake(toolchain: Toolchain) -> None:
    """No kernel template in the source: nothing to name, so no error (a helper-only program)."""
    assert (
        _compile(toolchain, source="__device__ int helper(int a) { return a + 1; }\n") is not None
    )
