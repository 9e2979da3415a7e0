"""Recipes this server has already checked, completed and keyed, found again by their content.

Every rank of a job resolves the same recipes: the same JSON object arrives from many
processes, differing only in the request's ``context``. Turning that object into a
keyed :class:`~kcache.recipe.Recipe` (every field checked, the server's default
toolchain filled in, canonical JSON written, two sha256 digests) costs several times
what answering a hit does, and its result depends on nothing but the object (and this
server's toolchain and include sets, fixed while it runs).

:class:`PreparedRecipes` keeps those results, bounded in bytes, under an exact
content key (:func:`content_key`): every string, every number *with its type* (JSON
``1``, ``1.0`` and ``true`` are equal in Python and different recipes), every key in its
order. A lookup hashes and compares the object's strings, which is all the work it
adds; a different object is a different key, so nothing can be served for a recipe
that was not itself checked. Only successes are kept: a recipe that fails is checked
(and its error made) again every time.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

from kcache.lru import LruCache
from kcache.recipe import Recipe

__all__ = ["PreparedRecipes", "content_key"]

#: Nesting beyond which an object is not kept (a recipe's own fields nest 3 levels;
#: linked recipes add their own): the checks refuse or accept it, uncached.
_MAX_DEPTH = 12
#: Characters of recipe text kept (sources, headers, names): the recipes kept take
#: about 1.7 times that in memory (their canonical JSON and keys with them).
_MAX_BYTES = 32 << 20
_MAX_ENTRIES = 100_000


def content_key(data: Any, depth: int = 0) -> tuple[Any, int] | None:
    """An exact, hashable key of a parsed JSON value and its size in characters, or None.

    Two values get equal keys only when they are the same JSON: strings equal, numbers
    equal and of the same type, objects with the same members in the same order, arrays
    alike. None for values nested deeper than :data:`_MAX_DEPTH` or holding anything
    a JSON parser does not produce.
    """
    kind = type(data)
    if kind is str:
        return data, len(data)
    if kind is dict:
        if depth >= _MAX_DEPTH:
            return None
        members: list[Any] = [dict]
        size = 0
        for name, value in data.items():
            if type(name) is not str:
                return None
            inner = content_key(value, depth + 1)
            if inner is None:
                return None
            members += (name, inner[0])
            size += len(name) + inner[1]
        return tuple(members), size
    if kind is list:
        if depth >= _MAX_DEPTH:
            return None
        items: list[Any] = [list]
        size = 0
        for value in data:
            inner = content_key(value, depth + 1)
            if inner is None:
                return None
            items.append(inner[0])
            size += inner[1]
        return tuple(items), size
    if kind is int or kind is float or kind is bool or data is None:
        return (kind, data), 8
    return None


class PreparedRecipes:
    """Keyed recipes by the content of the object they were made from; see the module docstring."""

    def __init__(self, max_bytes: int = _MAX_BYTES, max_entries: int = _MAX_ENTRIES) -> None:
        self._recipes: LruCache[Any, tuple[Recipe, int]] = LruCache(
            max_entries=max_entries, max_bytes=max_bytes, size=lambda entry: entry[1]
        )

    def get_or_prepare(
        self, data: Any, prepare: Callable[[Any], Recipe], state: Hashable = ()
    ) -> Recipe:
        """The recipe ``prepare(data)`` made for an equal object before, else ``prepare(data)`` (kept).

        ``prepare`` must be a function of ``data`` and ``state`` alone (``state``: what
        else it reads, such as the include sets' digests it pins recipes to); whatever
        it raises is raised (and nothing is kept).
        """
        keyed = content_key(data)
        if keyed is None:
            return prepare(data)
        key, size = (state, keyed[0]), keyed[1]
        found = self._recipes.get(key)
        if found is not None:
            return found[0]
        recipe = prepare(data)
        self._recipes.put(key, (recipe, size))
        return recipe

    def __len__(self) -> int:
        """How many recipes are kept."""
        return len(self._recipes)
