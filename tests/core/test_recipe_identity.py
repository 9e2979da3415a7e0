"""Recipes are values: equal and hashed by their canonical form, built without private flags."""

from __future__ import annotations

import inspect
import pickle

import pytest

from kcache import Recipe
from kcache.errors import RecipeError, UnresolvedRecipeError
from kcache.recipe import LinkInput

SOURCE = 'extern "C" __global__ void k(float* x) { x[0] = 1.0f; }\n'


def _recipe(**kw: object) -> Recipe:
    fields: dict[str, object] = {"source": SOURCE, "target": "sm_80", "toolchain": "tc-1"}
    fields.update(kw)
    return Recipe(**fields)  # type: ignore[arg-type]


def test_equal_recipes_hash_alike_and_work_as_keys() -> None:
    a = _recipe(headers={"b.h": "2", "a.h": "1"}, specialization={"block": 256})
    b = _recipe(headers={"a.h": "1", "b.h": "2"}, specialization={"block": 256})
    assert a is not b and a == b and hash(a) == hash(b)
    assert {a: "x"}[b] == "x" and len({a, b}) == 1
    assert pickle.loads(pickle.dumps(a)) == a


@pytest.mark.parametrize(
    "change",
    [
        {"source": SOURCE + "\n"},
        {"target": "sm_90"},
        {"toolchain": "tc-2"},
        {"flags": ["-dopt=on", "-lineinfo"]},
        {"headers": {"a.h": "1 "}},
        {"specialization": {"block": 128}},
        {"name": "other.cu"},
        {"name_expressions": ["k"]},
        {"output": "ptx", "target": "compute_80"},
        {"include_sets": ["lib"]},
    ],
)
def test_any_change_of_a_field_is_another_recipe(change: dict[str, object]) -> None:
    base = _recipe(flags=["-lineinfo", "-dopt=on"], headers={"a.h": "1"})
    other = _recipe(**{"flags": ["-lineinfo", "-dopt=on"], "headers": {"a.h": "1"}, **change})
    assert base != other and hash(base) != hash(other)


def test_equality_follows_the_canonical_form_not_python_equality() -> None:
    # 1 == 1.0 == True in Python, yet they render as different macros and keys.
    as_int = _recipe(specialization={"v": 1})
    as_float = _recipe(specialization={"v": 1.0})
    as_bool = _recipe(specialization={"v": True})
    assert as_int.key() != as_float.key()
    assert as_int != as_float and as_int != as_bool and as_float != as_bool
    assert len({as_int, as_float, as_bool}) == 3


def test_identity_is_the_key_once_resolved_and_unresolved_recipes_still_hash() -> None:
    auto = Recipe(source=SOURCE)  # target "auto", no toolchain: hashable, but has no key
    assert auto == Recipe(source=SOURCE) and hash(auto) == hash(Recipe(source=SOURCE))
    with pytest.raises(UnresolvedRecipeError):
        auto.key()
    resolved = auto.with_defaults(target="sm_80", toolchain="tc-1")
    assert resolved == _recipe() and resolved != auto
    assert resolved.key() == _recipe().key()


def test_a_link_to_an_unresolved_recipe_has_no_key() -> None:
    inner = Recipe(source=SOURCE, output="ltoir")  # auto target inside
    outer = _recipe(lto=True, link=[LinkInput(recipe=inner)])
    assert hash(outer) == hash(_recipe(lto=True, link=[LinkInput(recipe=inner)]))
    with pytest.raises(UnresolvedRecipeError, match="target"):
        outer.key()
    filled = outer.with_defaults(target="sm_90")  # an explicit outer target is kept ...
    inner_filled = filled.link[0].recipe
    assert inner_filled is not None and inner_filled.target == "sm_80"  # ... and given to links
    other = Recipe(source=SOURCE, output="ltoir", target="sm_90", toolchain="tc-1")
    assert filled.key() != _recipe(lto=True, link=[LinkInput(recipe=other)]).key()


def test_the_constructor_has_no_private_parameters_and_always_validates() -> None:
    params = inspect.signature(Recipe).parameters
    assert not [name for name in params if name.startswith("_")], list(params)
    with pytest.raises(RecipeError, match="flags"):
        _recipe(flags=["-I/etc"])


def test_with_defaults_checks_what_it_fills_in() -> None:
    bare = Recipe(source=SOURCE)
    with pytest.raises(RecipeError, match="target"):
        bare.with_defaults(target="sm_banana", toolchain="tc-1")
    with pytest.raises(RecipeError, match="toolchain"):
        bare.with_defaults(target="sm_80", toolchain="bad id!")
    filled = bare.with_defaults(target="sm_80", toolchain="tc-1")
    assert filled.headers == bare.headers and filled.key() == _recipe().key()
