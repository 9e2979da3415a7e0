"""``GET /v1/withdrawals``: the bindings verification withdrew, after a given id (read).

Clients (node tiers) read it at every warmup, prefetch and first lookup of a process and
at a bounded interval, keep the withdrawn (recipe key, digest) pairs and refuse any entry
or signed answer naming one (docs/design.md, "What a binding rests on"). Not signed: all a
row can do is make a client refuse and fetch again, which whoever can write its tier can
cause already. The body's shape is what ``kcache_client`` reads; keep it.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Query
from pydantic import BaseModel, Field

from kcache_server.routes._deps import ERRORS, Reader, State
from kcache_server.schemas import HEX_KEY_PATTERN, SchemaPattern
from kcache_server.withdrawals import MAX_READ, WithdrawalLog

__all__ = ["router"]

router = APIRouter(prefix="/v1/withdrawals", tags=["auditing"])

#: The largest id a row can have (a signed 64-bit integer): ``after`` beyond it names none.
_MAX_ID = (1 << 63) - 1


class WithdrawalBody(BaseModel):
    """One withdrawn binding: ``recipe_key`` no longer answers ``digest``."""

    id: int = Field(description="the withdrawal's id; ids grow, rows come in id order")
    recipe_key: Annotated[str, SchemaPattern(HEX_KEY_PATTERN)] = Field(
        description="the recipe key, or a removed foreign binding's binding_key"
    )
    digest: Annotated[str, SchemaPattern(HEX_KEY_PATTERN)] = Field(
        description="the artifact the key must no longer answer (other keys may still), or "
        "a removed foreign group's content digest (kcache.foreign.group_digest)"
    )
    at: datetime = Field(description="when it was withdrawn (RFC 3339, UTC)")
    reason: str = Field(
        description="why, in short (what a fresh compile found different, or an admin's removal)"
    )


class WithdrawalsResponse(BaseModel):
    """Body of ``GET /v1/withdrawals``."""

    withdrawals: list[WithdrawalBody] = Field(description="oldest first")
    last_id: int = Field(
        description="the largest id returned, or `after` when none: the next request's `after`"
    )


@router.get("", response_model=WithdrawalsResponse, responses=ERRORS)
async def withdrawals(
    _: Reader,
    state: State,
    after: Annotated[
        int, Query(ge=0, le=_MAX_ID, description="only withdrawals with a larger id")
    ] = 0,
    limit: Annotated[
        int, Query(ge=1, le=MAX_READ, description="at most this many (ask again from last_id)")
    ] = 1000,
) -> WithdrawalsResponse:
    """The withdrawals after id ``after``, in id order, at most ``limit``."""
    rows = await state.run(WithdrawalLog(state.backends.db).after, after, limit)
    return WithdrawalsResponse(
        withdrawals=[
            WithdrawalBody(
                id=r.id, recipe_key=r.recipe_key, digest=r.digest, at=r.at, reason=r.reason
            )
            for r in rows
        ],
        last_id=rows[-1].id if rows else after,
    )
