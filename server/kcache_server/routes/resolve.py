"""``POST /v1/resolve`` and ``POST /v1/resolve/batch``."""

from __future__ import annotations

from typing import Any

import anyio
from fastapi import APIRouter
from fastapi.responses import JSONResponse

from kcache.errors import KCacheError
from kcache.recipe import Recipe
from kcache_server.errors import InvalidRequestError, error_body
from kcache_server.routes._deps import ERRORS, Reader, State
from kcache_server.schemas import BatchRequest, BatchResponse, ResolveRequest, ResolveResponse
from kcache_server.service import prepare_recipe

router = APIRouter(prefix="/v1/resolve", tags=["resolve"])


@router.post("", response_model=ResolveResponse, responses=ERRORS)
async def resolve(
    body: ResolveRequest,
    principal: Reader,
    state: State,
) -> JSONResponse:
    """Find the recipe's artifact, compiling it once (across replicas) on a miss if ``compile``."""
    if body.compile:
        principal.require("compile", "a resolve with compile true")
    recipe = prepare_recipe(body.recipe, state.backends)
    result = state.resolve_warm(recipe, body.context, "resolve") or await state.run(
        state.resolve, recipe, body.compile, body.context, "resolve"
    )
    return JSONResponse(result)


@router.post("/batch", response_model=BatchResponse, responses=ERRORS)
async def resolve_batch(
    body: BatchRequest,
    principal: Reader,
    state: State,
) -> JSONResponse:
    """Resolve many recipes; misses compile in parallel; one result per recipe, in order."""
    if body.compile:
        principal.require("compile", "a batch with compile true")
    limit = state.settings.max_batch
    if len(body.recipes) > limit:
        raise InvalidRequestError("recipes", f"at most {limit} recipes per batch, got {len(body.recipes)}")
    results: list[dict[str, Any] | None] = [None] * len(body.recipes)
    prepared: list[tuple[int, Recipe]] = []
    for i, data in enumerate(body.recipes):
        try:
            prepared.append((i, prepare_recipe(data, state.backends)))
        except KCacheError as exc:
            results[i] = {"status": "error", **error_body(exc)}

    async def one(i: int, recipe: Recipe) -> None:
        results[i] = state.resolve_warm(recipe, body.context, "batch") or await state.run(
            state.resolve_or_error, recipe, body.compile, body.context, "batch"
        )

    async with anyio.create_task_group() as group:
        for i, recipe in prepared:
            group.start_soon(one, i, recipe)
    return JSONResponse({"results": results})
