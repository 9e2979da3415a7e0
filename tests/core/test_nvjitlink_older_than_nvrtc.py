"""A toolchain whose nvJitLink is older than its NVRTC (torch's pinned nvJitLink beside NVRTC 13.3+).

nvJitLink cannot link a newer NVRTC's LTO-IR, and nothing else here uses it, so such a
toolchain compiles every recipe but LTO ones (``lto: true``), which it refuses by name
with the pip command that fixes it. This file drives the real NVRTC with the toolchain's
nvJitLink version set older (the real pair, NVRTC 13.5 beside nvJitLink 13.0.88 from
torch 2.11's pin, runs in ``tests/test_packaging.py``, in a venv of its own).
"""

from __future__ import annotations

import dataclasses

import pytest

from kcache.errors import RecipeError
from kcache.include_sets import IncludeSets
from kcache.nvrtc import compile_in_this_process
from kcache.recipe import LinkInput, Recipe
from kcache.toolchain import Toolchain, nvjitlink_install_advice

ADD = 'extern "C" __global__ void add(float* o, const float* a) { o[0] += a[0]; }'


@pytest.fixture
def older_nvjitlink(toolchain: Toolchain) -> Toolchain:
    """The real toolchain, its nvJitLink reported as 13.0 (what torch 2.11 pins)."""
    assert toolchain.links_lto, "the test environment's own pair links LTO-IR"
    return dataclasses.replace(toolchain, nvjitlink_version="13.0")


def _recipe(toolchain: Toolchain, **fields: object) -> Recipe:
    return Recipe(**{"source": ADD, "target": "sm_90", **fields}).with_defaults(  # type: ignore[arg-type]
        toolchain=toolchain.id
    )


def test_plain_recipes_compile_beside_an_older_nvjitlink(older_nvjitlink: Toolchain) -> None:
    assert not older_nvjitlink.links_lto
    for output in ("cubin", "ptx", "ltoir"):  # LTO-IR is NVRTC's alone: nvJitLink never sees it
        out = compile_in_this_process(
            _recipe(older_nvjitlink, output=output), older_nvjitlink, IncludeSets({})
        )
        assert out.kind == output and out.data


def test_lto_recipes_are_refused_by_name_with_the_fix(older_nvjitlink: Toolchain) -> None:
    helper = _recipe(older_nvjitlink, output="ltoir")
    for recipe in (
        _recipe(older_nvjitlink, lto=True),
        _recipe(older_nvjitlink, lto=True, flags=["-rdc=true"], link=[LinkInput(recipe=helper)]),
    ):
        with pytest.raises(RecipeError) as caught:
            compile_in_this_process(recipe, older_nvjitlink, IncludeSets({}))
        assert caught.value.field == "lto"
        text = str(caught.value)
        nvrtc = older_nvjitlink.nvrtc_version
        assert f"nvJitLink 13.0 is older than NVRTC {nvrtc}" in text, text
        assert nvjitlink_install_advice(nvrtc) in text, text
    with pytest.raises(RecipeError, match="not compiled on this server") as caught:
        older_nvjitlink.check(_recipe(older_nvjitlink, lto=True), "on this server")
    assert caught.value.field == "lto"


def test_the_advice_asks_for_nvjitlink_of_nvrtcs_release_within_its_major() -> None:
    assert nvjitlink_install_advice("13.5") == "pip install 'nvidia-nvjitlink>=13.5,<14'"


def test_an_nvjitlink_as_new_as_nvrtc_links(toolchain: Toolchain) -> None:
    same = dataclasses.replace(toolchain, nvjitlink_version=toolchain.nvrtc_version)
    newer = dataclasses.replace(toolchain, nvjitlink_version="99.0")
    assert same.links_lto and newer.links_lto
    same.check(_recipe(same, lto=True))  # no refusal
