"""A recipe from a request, checked and completed: parsed, given the server's defaults, keyed.

Everything about a recipe that this server (not the recipe itself) decides is
checked here: that its toolchain is the one the server runs and that its target,
and every linked recipe's, is one that toolchain compiles for
(:meth:`kcache.toolchain.Toolchain.check`, the same check a compile makes).
A server that cannot compile (:mod:`kcache_server.compiler_presence`) has no default
toolchain and no targets to check against: a recipe sent to it names its toolchain
(else :class:`~kcache_server.errors.CannotCompileError`) and is keyed as it is, so a
recipe some compiling server stored is found; nothing is compiled here to go wrong.

The result depends on the recipe object alone while the server runs, and every rank
of a job sends the same objects: :class:`RecipeChecks` keeps what it made for an
object (:class:`~kcache_server.prepared_recipes.PreparedRecipes`) and answers an equal
one with it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kcache.errors import RecipeError
from kcache.recipe import Recipe
from kcache_server.backends import Backends
from kcache_server.errors import CannotCompileError
from kcache_server.prepared_recipes import PreparedRecipes
from kcache_server.schemas import ResolveRequest, load_json_model

__all__ = ["RecipeChecks"]


class RecipeChecks:
    """The one reading of a recipe from a request, for the routes and the resolve fast path."""

    def __init__(self, backends: Backends) -> None:
        self.backends = backends
        self._prepared = PreparedRecipes()

    def prepare(self, data: Mapping[str, Any], *, base_key: bool = True) -> Recipe:
        """Validate an untrusted recipe object, fill in the server's defaults, and key it.

        The keys are computed here (and memoised on the recipe) because this runs off
        the event loop for a large body, and hashing the headers is what grows with it.
        ``base_key=False`` leaves the base key to be computed when first asked for: the
        resolve fast path, which only takes small bodies, answers a hit without it.
        """
        # A recipe naming an include set is pinned to the set's contents now, so the
        # recipes kept are kept per state of the sets (edited: prepared again, once).
        sets = self.backends.compiler.include_sets
        state = tuple(sets.digests().items()) if sets.names else ()
        recipe = self._prepared.get_or_prepare(data, self._prepare, state)
        if base_key:
            recipe.base_key()
        return recipe

    def parse_resolve(self, raw: bytes, *, base_key: bool = True) -> tuple[ResolveRequest, Recipe]:
        """The body of ``POST /v1/resolve``, parsed and validated, and its recipe prepared.

        The route and the resolve fast path both call it, so a body the fast path
        answers is one the route would have accepted. ``base_key`` is :meth:`prepare`'s.
        """
        body = load_json_model(ResolveRequest, raw)
        return body, self.prepare(body.recipe, base_key=base_key)

    def _prepare(self, data: Mapping[str, Any]) -> Recipe:
        try:
            recipe = Recipe.from_dict(data)
        except RecipeError:
            raise
        except (
            TypeError,
            ValueError,
        ) as exc:  # a wrong JSON type the field checks did not anticipate
            raise RecipeError("recipe", f"malformed: {exc}") from exc
        toolchain = self.backends.toolchain
        if not toolchain.compiles and recipe.toolchain is None:
            raise CannotCompileError(
                toolchain.cannot_compile,
                "the recipe names no toolchain, and there is no default to key it with:",
            )
        recipe = self.backends.engine.prepare(recipe)
        if toolchain.compiles:
            toolchain.check(recipe, "on this server")
        recipe.key()
        return recipe
