"""Recipes kept by content (kcache_server.prepared_recipes): exact keys, only successes kept, bounded."""

from __future__ import annotations

from typing import Any

import pytest
from kcache_server.prepared_recipes import PreparedRecipes, content_key

from kcache.errors import RecipeError
from kcache.recipe import Recipe
from tests.support import VECTOR_ADD


def _counting(calls: list[Any]) -> Any:
    def prepare(data: Any) -> Recipe:
        calls.append(data)
        return Recipe.from_dict(data)

    return prepare


def test_an_equal_object_gets_the_recipe_made_for_the_first() -> None:
    kept, calls = PreparedRecipes(), list[Any]()
    first = kept.get_or_prepare({"source": VECTOR_ADD, "target": "sm_90"}, _counting(calls))
    # A new object with the same content (as every rank's request parses to).
    again = kept.get_or_prepare({"source": VECTOR_ADD[:], "target": "sm_90"}, _counting(calls))
    assert again is first and len(calls) == 1


@pytest.mark.parametrize(
    ("one", "other"),
    [
        ({"x": 1}, {"x": 1.0}),  # equal in Python, different JSON
        ({"x": 1}, {"x": True}),
        ({"x": 0}, {"x": False}),
        ({"x": None}, {"x": "None"}),
        ({"x": [1, 2]}, {"x": {"1": 2}}),
        ({"x": ["a"]}, {"x": "a"}),
        (
            {"a": 1, "b": 2},
            {"b": 2, "a": 1},
        ),  # member order is part of the key (a miss, never wrong)
        ({"x": {"h.cuh": "a"}}, {"x": {"h.cuh": "b"}}),
        ({"x": [[1]]}, {"x": [1]}),
    ],
)
def test_different_json_never_shares_a_key(one: dict[str, Any], other: dict[str, Any]) -> None:
    keyed_one, keyed_other = content_key(one), content_key(other)
    assert keyed_one is not None and keyed_other is not None
    assert keyed_one[0] != keyed_other[0]


def test_a_changed_header_is_prepared_again_and_keyed_differently() -> None:
    kept, calls = PreparedRecipes(), list[Any]()
    source = '#include "h.cuh"\n' + VECTOR_ADD
    first, second = (
        kept.get_or_prepare(
            {"source": source, "target": "sm_90", "toolchain": "t1", "headers": {"h.cuh": text}},
            _counting(calls),
        )
        for text in ("#define A 1\n", "#define A 2\n")
    )
    assert len(calls) == 2 and first.key() != second.key()


def test_a_refused_recipe_is_checked_every_time() -> None:
    kept, calls = PreparedRecipes(), list[Any]()
    bad = {"source": VECTOR_ADD, "target": "sm_nope"}
    for _ in range(2):
        with pytest.raises(RecipeError):
            kept.get_or_prepare(bad, _counting(calls))
    assert len(calls) == 2 and len(kept) == 0


def test_deep_or_foreign_values_are_prepared_but_not_kept() -> None:
    deep: Any = "leaf"
    for _ in range(50):
        deep = [deep]
    assert content_key({"x": deep}) is None
    assert content_key({"x": object()}) is None
    assert content_key({1: "x"}) is None  # not a JSON object
    kept, calls = PreparedRecipes(), list[Any]()
    with pytest.raises(RecipeError):
        kept.get_or_prepare({"source": VECTOR_ADD, "target": "sm_90", "x": deep}, _counting(calls))
    assert len(calls) == 1 and len(kept) == 0


def test_what_is_kept_stays_within_its_bytes() -> None:
    kept = PreparedRecipes(max_bytes=3 * len(VECTOR_ADD))
    for i in range(10):
        kept.get_or_prepare(
            {"source": VECTOR_ADD + f"// {i}\n", "target": "sm_90"}, Recipe.from_dict
        )
    assert 1 <= len(kept) <= 2
