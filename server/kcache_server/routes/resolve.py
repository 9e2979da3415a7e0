"""``POST /v1/resolve`` and ``POST /v1/resolve/batch``.

The body is parsed, validated and keyed by :func:`~kcache_server.routes._deps.read_body`
(on a worker thread when it is large), so a huge recipe never holds the event loop.
What happens next is :class:`~kcache_server.resolving.Resolver`'s.
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from kcache.errors import KCacheError
from kcache.recipe import Recipe
from kcache_server.errors import InvalidRequestError
from kcache_server.recipe_checks import RecipeChecks
from kcache_server.routes._deps import ERRORS, Reader, State, body_doc, read_body
from kcache_server.schemas import (
    BatchRequest,
    BatchResponse,
    ResolveRequest,
    ResolveResponse,
    load_model,
    parse_json,
)

router = APIRouter(prefix="/v1/resolve", tags=["resolve"])


def _parse_batch(
    raw: bytes, checks: RecipeChecks, limit: int
) -> tuple[BatchRequest, list[Recipe | KCacheError]]:
    """The batch and, per item, its prepared recipe or the error that refused it."""
    data = parse_json(raw)
    recipes = data.get("recipes") if isinstance(data, dict) else None
    if isinstance(recipes, list) and len(recipes) > limit:  # before validating any of them
        raise InvalidRequestError(
            "recipes", f"at most {limit} recipes per batch, got {len(recipes)}"
        )
    body = load_model(BatchRequest, data)
    prepared: list[Recipe | KCacheError] = []
    for item in body.recipes:
        try:
            prepared.append(checks.prepare(item))
        except KCacheError as exc:
            prepared.append(exc)
    return body, prepared


@router.post(
    "", response_model=ResolveResponse, responses=ERRORS, openapi_extra=body_doc(ResolveRequest)
)
async def resolve(request: Request, principal: Reader, state: State) -> ResolveResponse:
    """Find the recipe's artifact, compiling it once (across replicas) on a miss if ``compile``."""
    body, recipe = await read_body(request, state, state.recipes.parse_resolve)
    if body.compile:
        principal.require("compile", "a resolve with compile true")
    return await state.resolver.resolve(recipe, compile=body.compile, context=body.context)


@router.post(
    "/batch",
    response_model=BatchResponse,
    # An error result carries only the fields its error has, as every error body does.
    response_model_exclude_unset=True,
    responses=ERRORS,
    openapi_extra=body_doc(BatchRequest),
)
async def resolve_batch(request: Request, principal: Reader, state: State) -> BatchResponse:
    """Resolve many recipes; misses compile in parallel; one result per recipe, in order."""
    limit = state.settings.max_batch
    body, prepared = await read_body(
        request, state, lambda raw: _parse_batch(raw, state.recipes, limit)
    )
    if body.compile:
        principal.require("compile", "a batch with compile true")
    results = await state.resolver.resolve_batch(
        prepared, compile=body.compile, context=body.context
    )
    return BatchResponse(results=results)
