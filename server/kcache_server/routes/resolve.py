"""``POST /v1/resolve`` and ``POST /v1/resolve/batch``.

The body is parsed, validated and keyed by :func:`~kcache_server.routes._deps.read_body`
(on a worker thread when it is large), so a huge recipe never holds the event loop.
"""

from __future__ import annotations

from typing import Any

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from kcache.errors import KCacheError
from kcache.recipe import Recipe
from kcache_server.backends import Backends
from kcache_server.errors import InvalidRequestError, error_body
from kcache_server.routes._deps import ERRORS, Reader, State, body_doc, read_body
from kcache_server.schemas import (
    BatchRequest,
    BatchResponse,
    ResolveRequest,
    ResolveResponse,
    load_model,
    parse_json,
)
from kcache_server.service import prepare_recipe

router = APIRouter(prefix="/v1/resolve", tags=["resolve"])


def _prepared(data: Any, backends: Backends) -> Recipe:
    """A validated recipe with the server's defaults, keyed (the keys are memoised on it)."""
    recipe = prepare_recipe(data, backends)
    recipe.key()
    recipe.base_key()
    return recipe


def _parse_resolve(raw: bytes, backends: Backends) -> tuple[ResolveRequest, Recipe]:
    body = load_model(ResolveRequest, parse_json(raw))
    return body, _prepared(body.recipe, backends)


def _parse_batch(
    raw: bytes, backends: Backends, limit: int
) -> tuple[BatchRequest, list[dict[str, Any] | None], list[tuple[int, Recipe]]]:
    data = parse_json(raw)
    recipes = data.get("recipes") if isinstance(data, dict) else None
    if isinstance(recipes, list) and len(recipes) > limit:  # before validating any of them
        raise InvalidRequestError(
            "recipes", f"at most {limit} recipes per batch, got {len(recipes)}"
        )
    body = load_model(BatchRequest, data)
    results: list[dict[str, Any] | None] = [None] * len(body.recipes)
    prepared: list[tuple[int, Recipe]] = []
    for i, item in enumerate(body.recipes):
        try:
            prepared.append((i, _prepared(item, backends)))
        except KCacheError as exc:
            results[i] = {"status": "error", **error_body(exc)}
    return body, results, prepared


@router.post(
    "", response_model=ResolveResponse, responses=ERRORS, openapi_extra=body_doc(ResolveRequest)
)
async def resolve(request: Request, principal: Reader, state: State) -> JSONResponse:
    """Find the recipe's artifact, compiling it once (across replicas) on a miss if ``compile``."""
    body, recipe = await read_body(request, state, lambda raw: _parse_resolve(raw, state.backends))
    if body.compile:
        principal.require("compile", "a resolve with compile true")
    result = state.resolve_warm(recipe, body.context, "resolve") or await state.run(
        state.resolve, recipe, body.compile, body.context, "resolve"
    )
    return JSONResponse(result)


@router.post(
    "/batch", response_model=BatchResponse, responses=ERRORS, openapi_extra=body_doc(BatchRequest)
)
async def resolve_batch(request: Request, principal: Reader, state: State) -> JSONResponse:
    """Resolve many recipes; misses compile in parallel; one result per recipe, in order."""
    limit = state.settings.max_batch
    body, results, prepared = await read_body(
        request, state, lambda raw: _parse_batch(raw, state.backends, limit)
    )
    if body.compile:
        principal.require("compile", "a batch with compile true")

    async def one(i: int, recipe: Recipe) -> None:
        results[i] = state.resolve_warm(recipe, body.context, "batch") or await state.run(
            state.resolve_or_error, recipe, body.compile, body.context, "batch"
        )

    async with anyio.create_task_group() as group:
        for i, recipe in prepared:
            group.start_soon(one, i, recipe)
    return JSONResponse({"results": results})
