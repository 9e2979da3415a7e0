"""``GET /v1/recipes/{recipe_key}/recipe``: the whole recipe the server recorded under a key.

What a GPU-less prebuild (``kcache prebuild``) starts from: a job's manifest names its
kernels by recipe key, and the same recipe with another ``target`` (or toolchain) is
compiled from the recipe this route gives back. The server keeps every recipe it
compiled (:mod:`kcache_server.recipe_records`), whole where it compresses small enough.

The body holds another team's source, headers and flags, and its one use is compiling
them again, so the route asks for the ``compile`` scope: a ``read`` token (every rank,
every dashboard) fetches cubins by key but never the code behind them. The recipe is
given back as recorded: its toolchain and target may be ones this server no longer
compiles, so the answer is a plain object, not the server's ``Recipe`` schema (which
names this server's toolchain and targets only). A caller checks that it hashes to the
key it asked for; a recipe is content-addressed, so the server cannot hand back
another one unnoticed.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, Field

from kcache.errors import ArtifactNotFoundError
from kcache.recipe import Recipe
from kcache_server.routes._deps import ERRORS, Compiler, State
from kcache_server.schemas import RecipeKeyPath, check_key
from kcache_server.state import ServerState

__all__ = ["RecordedRecipeBody", "router"]

router = APIRouter(prefix="/v1/recipes", tags=["recipes"])


class RecordedRecipeBody(BaseModel):
    """A recipe the server recorded, by its key."""

    recipe_key: str = Field(description="the key asked for; the recipe hashes to it")
    recipe: dict[str, Any] = Field(
        description="the recipe as it was recorded (source, name, headers, flags, target, "
        "output, name_expressions, specialization, link, lto, toolchain, include_sets): its "
        "toolchain and target may be ones this server no longer compiles"
    )


def _recorded(state: ServerState, recipe_key: str) -> Recipe:
    recipe = state.recipe_records.recipe(recipe_key)
    if recipe is None:  # noted by this process lately, perhaps: recorded with the next audit batch
        state.audit.flush()
        recipe = state.recipe_records.recipe(recipe_key)
    if recipe is None:
        raise ArtifactNotFoundError(
            f"this server holds no recipe recorded under {recipe_key}: it never compiled it "
            "(it was compiled elsewhere, or before this server kept recipes), or it was too "
            "large to keep whole; resolve the recipe itself to compile it here"
        )
    return recipe


@router.get("/{recipe_key}/recipe", response_model=RecordedRecipeBody, responses=ERRORS)
async def recorded_recipe(
    recipe_key: RecipeKeyPath,
    _: Compiler,
    state: State,
) -> RecordedRecipeBody:
    """The whole recipe recorded under ``recipe_key`` (needs the ``compile`` scope); 404 if none."""
    check_key(recipe_key, "recipe_key")
    recipe: Recipe = await state.run(_recorded, state, recipe_key)
    return RecordedRecipeBody(recipe_key=recipe_key, recipe=recipe.to_dict())
