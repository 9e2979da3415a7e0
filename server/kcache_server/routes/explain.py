"""``POST /v1/explain`` and ``GET /v1/recipes/{recipe_key}/explain``: is a recipe held, and if
not, why it misses.

Both say first whether the server holds the recipe now, so that resolving it is a hit,
and how: by its exact key, or through a dependency-aware match (an artifact of the same
base key whose recorded headers and include-set files are the recipe's); else a
failed compile the server remembers, or that it was seen before and its artifact went
away. Asked without writing anything: a manifest match records no alias here.

Then both name the nearest other recipe of the same kernel the server recorded (same
program name and source, or same base key) and what differs from it, one line per
difference (:mod:`kcache.recipe_diff`), or say "never seen"; for a held recipe that is
only what set it apart, never a miss. The body form explains any recipe, one never
compiled included (the usual miss); the key form explains a recipe the server
recorded or holds, by its key or the start of one (what ``kcache cache ls`` and the
dashboard print: 4 to 64 hex digits beginning exactly one key the server knows). Both
read the database on a worker thread, never the event loop.

The nearest recipe may be another team's: a caller below the ``compile`` scope (which
the recorded recipe itself needs, ``GET /v1/recipes/{key}/recipe``) is told which
macros and specialization keys differ, never their values (``flag -DTILE=… added``,
``specialization dtype changed``); a ``compile`` token sees them. What the held part
says (a key, a digest, a failure's kind) carries no value, and never a compile log.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Literal

from fastapi import APIRouter, Request

from kcache.artifact import ArtifactMeta, CompileFailure
from kcache.engine import Via
from kcache.errors import ArtifactNotFoundError, IncludeSetChangedError
from kcache.keys import MIN_KEY_PREFIX, is_hex_key, is_key_prefix
from kcache.recipe import Recipe
from kcache.recipe_diff import Explanation
from kcache_server.auth import Principal
from kcache_server.errors import BadRequestError
from kcache_server.recipe_records import SEEN_BEFORE
from kcache_server.routes._deps import ERRORS, Reader, State, body_doc, read_body
from kcache_server.schemas import (
    ExplainRequest,
    ExplanationBody,
    RecipeKeyPrefixPath,
    load_json_model,
)
from kcache_server.state import ServerState

router = APIRouter(tags=["recipes"])

#: Keys a prefix is shown beginning when it begins several.
_SHOWN = 5
#: What a remembered failure's kind means, in words.
_FAILURES = {
    "error": "its compile failed",
    "timeout": "its compile ran past the server's time limit",
    "too_large": "its output was over the server's size limit",
}

Holding = tuple[ArtifactMeta, Via] | CompileFailure | None


def _values(principal: Principal) -> bool:
    """Whether ``principal`` may see macro and specialization values (the ``compile`` scope)."""
    return principal.allows("compile")


def _failure_text(failure: CompileFailure) -> str:
    said = _FAILURES.get(failure.kind, "its compile failed")
    until = ""
    if failure.expires_at is not None:
        when = datetime.fromtimestamp(failure.expires_at, timezone.utc)
        until = f" until {when.isoformat(timespec='seconds').replace('+00:00', 'Z')}"
    return (
        f"not held: {said} ({failure.kind}), and the server remembers it: a resolve answers that "
        f"error{until} without compiling (resolve it to read the error)"
    )


def _body(
    key: str, holding: Holding, seen_before: bool, explanation: Explanation
) -> ExplanationBody:
    held: Literal["key", "manifest"] | None = None
    digest: str | None = None
    failure: str | None = None
    if isinstance(holding, CompileFailure):
        failure = holding.kind
        text = _failure_text(holding)
    elif holding is not None:
        meta, via = holding
        held = "key" if via == "key" else "manifest"
        digest = meta.digest
        text = (
            f"held by its exact key: artifact {digest[:16]}"
            if held == "key"
            else f"held through a dependency-aware match: artifact {digest[:16]}, compiled for "
            "another recipe of this kernel whose recorded headers and include-set files are "
            "this recipe's"
        )
    elif seen_before:
        text = f"{SEEN_BEFORE}; {explanation.text}"
    else:
        text = explanation.text
    return ExplanationBody(
        recipe_key=key,
        held=held,
        digest=digest,
        failure=failure,
        seen_before=seen_before and holding is None,
        nearest_key=explanation.nearest_key,
        differences=list(explanation.differences),
        text=text,
    )


def _holding(state: ServerState, recipe: Recipe) -> Holding:
    """How the server holds ``recipe`` now (see :meth:`kcache.engine.Engine.holding`)."""
    try:
        return state.backends.engine.holding(recipe)
    except IncludeSetChangedError:  # a set it pins changed since: only a compile could say
        return None


def _explain_recipe(state: ServerState, recipe: Recipe, values: bool) -> ExplanationBody:
    state.audit.flush()  # recipes this process noted lately are recorded first
    key = recipe.key()
    holding = _holding(state, recipe)
    seen = holding is None and state.recipe_records.recorded(key)
    return _body(key, holding, seen, state.recipe_records.nearest(recipe, values=values))


def _check_prefix(given: str) -> None:
    """A 400 unless ``given`` is a recipe key or the start of one."""
    if not is_key_prefix(given):
        shown = given[:80]
        raise BadRequestError(
            f"recipe_key: must be a recipe key or the start of one ({MIN_KEY_PREFIX} to 64 "
            f"lowercase hex digits, as `kcache cache ls` prints them), got {shown!r}"
        )


def _whole_key(state: ServerState, given: str) -> str:
    """The recipe key ``given`` is, or begins; a 404 for none the server knows, a 400 for several."""
    if is_hex_key(given):
        return given
    keys = state.recipe_records.keys_starting(given, limit=_SHOWN + 1)
    if not keys:
        raise ArtifactNotFoundError(
            f"no recipe key this server knows begins with {given} (it never compiled, served or "
            "recorded one); explain the recipe itself (POST /v1/explain, or `kcache explain "
            "RECIPE_FILE`)"
        )
    if len(keys) > 1:
        shown = ", ".join(k[:16] for k in keys[:_SHOWN])
        more = " and more" if len(keys) > _SHOWN else ""
        raise BadRequestError(
            f"recipe_key: {given} is ambiguous on this server: it begins {shown}{more}; give "
            "more of its digits"
        )
    return keys[0]


def _explain_key(state: ServerState, given: str, values: bool) -> ExplanationBody:
    _check_prefix(given)
    state.audit.flush()  # recipes this process noted lately are recorded (and found) first
    key = _whole_key(state, given)
    records = state.recipe_records
    recipe = records.recipe(key)  # kept whole: a manifest match can be looked for too
    holding = (
        _holding(state, recipe) if recipe is not None else state.backends.engine.held_under(key)
    )
    explanation = records.nearest_to_key(key, values=values)
    if explanation is not None:  # recorded: seen before when not held now
        return _body(key, holding, holding is None, explanation)
    if holding is None:
        raise ArtifactNotFoundError(
            f"this server never recorded recipe {key}; explain the recipe itself "
            "(POST /v1/explain, or `kcache explain RECIPE_FILE`)"
        )
    return _body(key, holding, False, Explanation())  # held or failed, no fingerprint kept


@router.post(
    "/v1/explain",
    response_model=ExplanationBody,
    responses=ERRORS,
    openapi_extra=body_doc(ExplainRequest),
)
async def explain_recipe(request: Request, caller: Reader, state: State) -> ExplanationBody:
    """Whether the server holds this recipe and how (exact key, dependency-aware match); the
    nearest other recorded recipe of the same kernel and what this recipe differs in (macro and
    specialization values only for a ``compile`` token)."""

    def parse(raw: bytes) -> Recipe:
        return state.recipes.prepare(load_json_model(ExplainRequest, raw).recipe)

    recipe = await read_body(request, state, parse)
    result: ExplanationBody = await state.run(_explain_recipe, state, recipe, _values(caller))
    return result


@router.get("/v1/recipes/{recipe_key}/explain", response_model=ExplanationBody, responses=ERRORS)
async def explain_key(
    recipe_key: RecipeKeyPrefixPath, caller: Reader, state: State
) -> ExplanationBody:
    """The same for a recipe this server recorded or holds, by its key or the start of one
    (4 to 64 hex digits, as `kcache cache ls` prints them); 404 if none, 400 if several."""
    result: ExplanationBody = await state.run(_explain_key, state, recipe_key, _values(caller))
    return result
