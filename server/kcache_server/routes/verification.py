"""``GET /v1/verification``: what the server found compiling served artifacts again (admin)."""

from __future__ import annotations

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, Field

from kcache_server.routes._deps import ERRORS, Admin

__all__ = ["router"]

router = APIRouter(prefix="/v1/verification", tags=["auditing"])


class DivergenceBody(BaseModel):
    """One served artifact a fresh compile of its recipe disagreed with (it was withdrawn)."""

    at: str = Field(description="when it was found (ISO 8601, UTC)")
    recipe_key: str
    base_key: str
    via: str = Field(description="how it had been served: key (exact) or manifest (a match)")
    stored_digest: str = Field(description="the artifact that was served")
    fresh_digest: str | None = Field(description="what the recipe compiles to now, served since")
    kernel: str
    differences: list[str] = Field(description="what differed: code, dependencies, lowered names")


class VerificationBody(BaseModel):
    """Verified hits over a window."""

    enabled: bool
    disabled_reason: str | None = Field(
        default=None,
        description="why verification is off (turned off, or this server cannot compile); null when on",
    )
    verified: dict[str, int] = Field(
        description="verifications by result: same_bytes, diverged, failed (events from before compiles were seeded may say same_code or inconclusive)"
    )
    served_recipes: int = Field(description="recipes this process saw served (candidates)")
    verified_recipes: int = Field(description="of those, verified by this process")
    coverage: float | None = Field(description="verified_recipes / served_recipes")
    divergences: list[DivergenceBody]


@router.get(
    "",
    responses=ERRORS,
    summary="Verified hits: counts by result, coverage, divergences with details",
)
async def verification(
    request: Request,
    _: Admin,
    days: float = Query(default=30.0, gt=0, le=3650, description="look back this many days"),
    limit: int = Query(default=50, ge=1, le=1000, description="divergences listed at most"),
) -> VerificationBody:
    """Verifications of the last ``days`` by result, the share of served recipes verified, and
    the latest divergences: recipe key, how it was served (key or manifest), both digests and
    what differed."""
    from starlette.concurrency import run_in_threadpool

    verifier = request.app.state.verifier
    report = await run_in_threadpool(verifier.report, since_days=days, limit=limit)
    return VerificationBody.model_validate(report.to_dict())
