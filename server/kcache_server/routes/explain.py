"""``POST /v1/explain`` and ``GET /v1/recipes/{recipe_key}/explain``: why a recipe misses.

Both name the nearest recipe of the same kernel the server recorded (same program
name and source, or same base key) and what differs from it, one line per difference
(:mod:`kcache.recipe_diff`), or say "never seen". The body form explains any recipe,
one never compiled included (the usual miss); the key form explains a recipe the
server recorded, from its stored fingerprint. Both read the database on a worker
thread, never the event loop.

The nearest recipe may be another team's: a caller below the ``compile`` scope (which
the recorded recipe itself needs, ``GET /v1/recipes/{key}/recipe``) is told which
macros and specialization keys differ, never their values (``flag -DTILE=… added``,
``specialization dtype changed``); a ``compile`` token sees them.
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from kcache.errors import ArtifactNotFoundError
from kcache.recipe import Recipe
from kcache.recipe_diff import Explanation
from kcache_server.auth import Principal
from kcache_server.routes._deps import ERRORS, Reader, State, body_doc, read_body
from kcache_server.schemas import (
    ExplainRequest,
    ExplanationBody,
    RecipeKeyPath,
    check_key,
    load_json_model,
)
from kcache_server.state import ServerState

router = APIRouter(tags=["recipes"])


def _body(explanation: Explanation) -> ExplanationBody:
    return ExplanationBody(
        nearest_key=explanation.nearest_key,
        differences=list(explanation.differences),
        text=explanation.text,
    )


def _values(principal: Principal) -> bool:
    """Whether ``principal`` may see macro and specialization values (the ``compile`` scope)."""
    return principal.allows("compile")


def _explain_recipe(state: ServerState, recipe: Recipe, values: bool) -> ExplanationBody:
    state.audit.flush()  # recipes this process noted lately are recorded first
    return _body(state.recipe_records.nearest(recipe, values=values))


def _explain_key(state: ServerState, recipe_key: str, values: bool) -> ExplanationBody:
    state.audit.flush()
    explanation = state.recipe_records.nearest_to_key(recipe_key, values=values)
    if explanation is None:
        raise ArtifactNotFoundError(
            f"this server never recorded recipe {recipe_key}; explain the recipe itself "
            "(POST /v1/explain, or `kcache explain RECIPE_FILE`)"
        )
    return _body(explanation)


@router.post(
    "/v1/explain",
    response_model=ExplanationBody,
    responses=ERRORS,
    openapi_extra=body_doc(ExplainRequest),
)
async def explain_recipe(request: Request, caller: Reader, state: State) -> ExplanationBody:
    """The nearest recorded recipe of the same kernel and what this recipe differs in (macro and
    specialization values only for a ``compile`` token)."""

    def parse(raw: bytes) -> Recipe:
        return state.recipes.prepare(load_json_model(ExplainRequest, raw).recipe)

    recipe = await read_body(request, state, parse)
    result: ExplanationBody = await state.run(_explain_recipe, state, recipe, _values(caller))
    return result


@router.get("/v1/recipes/{recipe_key}/explain", response_model=ExplanationBody, responses=ERRORS)
async def explain_key(recipe_key: RecipeKeyPath, caller: Reader, state: State) -> ExplanationBody:
    """The same for a recipe this server recorded (compiled or served), by its key; 404 if none."""
    check_key(recipe_key, "recipe_key")
    result: ExplanationBody = await state.run(_explain_key, state, recipe_key, _values(caller))
    return result
