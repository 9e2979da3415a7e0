"""``POST /v1/resolve`` and ``POST /v1/resolve/batch``.

The body is parsed, validated and keyed by :func:`~kcache_server.routes._deps.read_body`
(on a worker thread when it is large), so a huge recipe never holds the event loop.
What happens next is :class:`~kcache_server.resolving.Resolver`'s. A resolve the fast
path (:mod:`~kcache_server.serving.resolve_fastpath`) read, parsed and validated but did
not answer (a miss, a hit not in memory) is not parsed again: the fast path leaves its
parse on the request's scope (:data:`PARSED_BODY`), and the route takes it for the same bytes.
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from kcache.errors import KCacheError
from kcache.recipe import Recipe
from kcache_server.asgi_types import Scope
from kcache_server.errors import InvalidRequestError
from kcache_server.recipe_checks import RecipeChecks
from kcache_server.routes._deps import ERRORS, Reader, State, body_doc, read_body
from kcache_server.schemas import (
    BatchRequest,
    BatchResponse,
    ErrorBody,
    ResolveRequest,
    ResolveResponse,
    load_model,
    parse_json,
)

#: The errors of a resolve, and 501 ``cannot_compile``: a miss (or a recipe without a
#: toolchain) on a server that cannot compile (kcache_server.compiler_presence).
RESOLVE_ERRORS = {**ERRORS, 501: {"model": ErrorBody}}

router = APIRouter(prefix="/v1/resolve", tags=["resolve"])

#: The scope key under which the resolve fast path leaves ``(raw body, parsed body, recipe)``
#: of a body it parsed and did not answer, for the route to take instead of parsing it again.
PARSED_BODY = "kcache.resolve_parsed"


def _parse_once(scope: Scope, checks: RecipeChecks, raw: bytes) -> tuple[ResolveRequest, Recipe]:
    """``raw`` as the fast path parsed it, when it parsed these very bytes; else parsed here."""
    parsed: tuple[bytes, ResolveRequest, Recipe] | None = scope.pop(PARSED_BODY, None)
    if parsed is None or parsed[0] != raw:
        return checks.parse_resolve(raw)
    body, recipe = parsed[1], parsed[2]
    recipe.base_key()  # what parse_resolve computes up front, and the fast path leaves to later
    return body, recipe


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
    "",
    response_model=ResolveResponse,
    responses=RESOLVE_ERRORS,
    openapi_extra=body_doc(ResolveRequest),
)
async def resolve(request: Request, principal: Reader, state: State) -> ResolveResponse:
    """Find the recipe's artifact, compiling it once (across replicas) on a miss if ``compile``."""
    body, recipe = await read_body(
        request, state, lambda raw: _parse_once(request.scope, state.recipes, raw)
    )
    if body.compile:
        principal.require("compile", "a resolve with compile true")
    return await state.resolver.resolve(recipe, compile=body.compile, context=body.context)


@router.post(
    "/batch",
    response_model=BatchResponse,
    # An error result carries only the fields its error has, as every error body does.
    response_model_exclude_unset=True,
    responses=RESOLVE_ERRORS,
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
