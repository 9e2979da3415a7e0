"""``/v1/cache``: the server store's size, contents and removals, for ``kcache cache --server`` (admin).

``GET /v1/cache`` (bytes used of the cap, artifacts, pins, oldest and newest use,
evictions), ``GET /v1/cache/entries`` (most recently used first), ``POST
/v1/cache/remove`` (evict the artifacts of some recipe keys or digests now) and
``POST /v1/cache/clear`` (evict every unpinned artifact). Removals go through the
evictor: rows first, blobs last, every replica told through the eviction log.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, ConfigDict, Field

from kcache_server.errors import OverloadedError
from kcache_server.eviction import (
    RemovalReport,
    StoreEntry,
    StoreEvictor,
    StoreInfo,
    list_entries,
)
from kcache_server.pins import MAX_KEYS
from kcache_server.routes._deps import ERRORS, Admin, State, body_doc, read_body
from kcache_server.schemas import HEX_KEY_PATTERN, SchemaPattern, check_key, load_model, parse_json

__all__ = ["router"]

router = APIRouter(prefix="/v1/cache", tags=["storage"])


# The answers are the evictor's dataclasses under the API's names: their fields (and each
# field's description) are written once, there; pydantic reads dataclasses as schemas.
@dataclass(frozen=True)
class CacheInfo(StoreInfo):
    """Body of ``GET /v1/cache``."""


@dataclass(frozen=True)
class CacheEntry(StoreEntry):
    """One stored artifact."""


@dataclass(frozen=True)
class RemoveResult(RemovalReport):
    """What a removal did; pinned and unknown keys are left alone and listed."""


class CacheEntries(BaseModel):
    """Body of ``GET /v1/cache/entries``."""

    entries: list[CacheEntry]


class RemoveRequest(BaseModel):
    """Body of ``POST /v1/cache/remove``: recipe keys or artifact digests."""

    model_config = ConfigDict(extra="forbid")

    keys: list[Annotated[str, SchemaPattern(HEX_KEY_PATTERN)]] = Field(
        min_length=1,
        max_length=MAX_KEYS,
        description="recipe keys or digests (each checked: a 400)",
    )


def evictor_of(request: Request) -> StoreEvictor:
    """The app's evictor."""
    evictor: StoreEvictor = request.app.state.evictor
    return evictor


def _parse_remove(raw: bytes) -> RemoveRequest:
    body = load_model(RemoveRequest, parse_json(raw))
    for i, key in enumerate(body.keys):
        check_key(key, f"keys[{i}]")
    return body


@router.get("", response_model=CacheInfo, responses=ERRORS)
async def cache_info(request: Request, _: Admin, state: State) -> CacheInfo:
    """How full the store is, and what eviction has done."""
    info: StoreInfo = await state.run(evictor_of(request).info)
    return CacheInfo(**vars(info))


@router.get("/entries", response_model=CacheEntries, responses=ERRORS)
async def cache_entries(
    _: Admin, state: State, limit: Annotated[int, Query(ge=1, le=MAX_KEYS)] = 100
) -> CacheEntries:
    """The most recently used artifacts first."""
    entries: list[StoreEntry] = await state.run(list_entries, state.backends.db, limit)
    return CacheEntries(entries=[CacheEntry(**vars(e)) for e in entries])


async def _removal(state: State, run: object) -> RemoveResult:
    try:
        report: RemovalReport = await state.run(run)
    except TimeoutError as exc:
        raise OverloadedError(str(exc)) from exc
    return RemoveResult(**vars(report))


@router.post(
    "/remove", response_model=RemoveResult, responses=ERRORS, openapi_extra=body_doc(RemoveRequest)
)
async def cache_remove(request: Request, _: Admin, state: State) -> RemoveResult:
    """Evict the artifacts these recipe keys (or digests) name, now; pinned ones stay."""
    body = await read_body(request, state, _parse_remove)
    evictor = evictor_of(request)
    return await _removal(state, lambda: evictor.remove(body.keys))


@router.post("/clear", response_model=RemoveResult, responses=ERRORS)
async def cache_clear(request: Request, _: Admin, state: State) -> RemoveResult:
    """Evict every artifact that is not pinned."""
    return await _removal(state, evictor_of(request).clear)
