"""``GET``/``POST``/``DELETE /v1/pins``: recipe keys whose artifacts eviction never removes (admin)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, ConfigDict, Field

from kcache_server.errors import InvalidRequestError
from kcache_server.pins import MAX_KEYS, PinInfo, PinStore, check_group
from kcache_server.routes._deps import ERRORS, Admin, State, body_doc, read_body
from kcache_server.schemas import HEX_KEY_PATTERN, SchemaPattern, load_model, parse_json

__all__ = ["router"]

router = APIRouter(prefix="/v1/pins", tags=["storage"])


#: Recipe keys one ``DELETE /v1/pins`` names: they travel in the request line, which
#: uvicorn reads only up to 64 KiB of (this many keys take 20 KiB).
MAX_QUERY_KEYS = 256
#: What :func:`~kcache_server.pins.check_group` accepts, as the published schema states it.
GROUP_PATTERN = "^[^\\x00-\\x1f\\x7f-\\x9f]{1,256}$"
_GROUP_DOC = "a label for pins made together (a release, a job): 1 to 256 printable characters"


class PinRequest(BaseModel):
    """Body of ``POST /v1/pins``: recipe keys, or a job whose looked-up recipes to pin, under a group."""

    # Recipe keys, a job, or both: one of them is required (a 422 names recipe_keys).
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "anyOf": [
                {"required": ["recipe_keys"], "properties": {"recipe_keys": {"minItems": 1}}},
                {"required": ["job_id"], "properties": {"job_id": {"type": "string"}}},
            ]
        },
    )

    recipe_keys: list[Annotated[str, SchemaPattern(HEX_KEY_PATTERN)]] = Field(
        default_factory=list, max_length=MAX_KEYS, description="recipe keys to pin"
    )
    group: Annotated[str, SchemaPattern(GROUP_PATTERN)] | None = Field(
        default=None, description=_GROUP_DOC
    )
    job_id: str | None = Field(
        default=None,
        max_length=256,
        json_schema_extra={"minLength": 1},
        description="also pin every recipe this job was served (its audit events), e.g. its warmup set",
    )


class PinsResponse(BaseModel):
    """Body of ``GET /v1/pins``."""

    #: Each pin as the pin store gives it (its dataclass is the schema: one list of fields).
    pins: list[PinInfo]


class PinResult(BaseModel):
    """Body of ``POST /v1/pins``: how many keys were asked for and how many pins are new."""

    requested: int
    pinned: int


class UnpinResult(BaseModel):
    """Body of ``DELETE /v1/pins``."""

    unpinned: int


def _parse(raw: bytes) -> PinRequest:
    return load_model(PinRequest, parse_json(raw))


@router.get("", response_model=PinsResponse, responses=ERRORS)
async def list_pins(
    _: Admin,
    state: State,
    group: Annotated[
        str | None, Query(description=_GROUP_DOC, json_schema_extra={"pattern": GROUP_PATTERN})
    ] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_KEYS)] = 1000,
) -> PinsResponse:
    """Pins, newest first (of one group if given)."""
    pins = await state.run(PinStore(state.backends.db).list, group, limit)
    return PinsResponse(pins=pins)


@router.post("", response_model=PinResult, responses=ERRORS, openapi_extra=body_doc(PinRequest))
async def add_pins(request: Request, principal: Admin, state: State) -> PinResult:
    """Pin recipe keys (and a job's recipes); pinning a key twice is a no-op."""
    body = await read_body(request, state, _parse)
    check_group(body.group)
    if not body.recipe_keys and body.job_id is None:
        raise InvalidRequestError("recipe_keys", "name recipe keys to pin, or a job_id")
    store = PinStore(state.backends.db)

    def pin() -> PinResult:
        keys = list(body.recipe_keys)
        if body.job_id is not None:
            state.audit.flush()  # read-your-writes: the job's last lookups may still be queued
            keys += store.keys_of_job(body.job_id)
        return PinResult(
            requested=len(set(keys)), pinned=store.add(keys, body.group, principal.name)
        )

    result: PinResult = await state.run(pin)
    return result


@router.delete("", response_model=UnpinResult, responses=ERRORS)
async def remove_pins(
    _: Admin,
    state: State,
    recipe_key: Annotated[
        list[str] | None,
        Query(
            max_length=MAX_QUERY_KEYS,
            description="recipe keys to unpin (repeat the parameter)",
            json_schema_extra={"items": {"type": "string", "pattern": HEX_KEY_PATTERN}},
        ),
    ] = None,
    group: Annotated[
        str | None, Query(description=_GROUP_DOC, json_schema_extra={"pattern": GROUP_PATTERN})
    ] = None,
) -> UnpinResult:
    """Unpin the ``recipe_key`` s given (within ``group`` if given), or all pins of ``group``.

    With neither, no pin matches and none is removed: unpinning everything takes
    naming each group (a request without a filter never empties the pin list).
    """
    if not recipe_key and group is None:
        return UnpinResult(unpinned=0)
    removed = await state.run(PinStore(state.backends.db).remove, recipe_key or [], group)
    return UnpinResult(unpinned=removed)
