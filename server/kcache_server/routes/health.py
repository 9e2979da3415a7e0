"""``GET /healthz`` (the process answers) and ``GET /readyz`` (database, store and workers work)."""

from __future__ import annotations

import os

import sqlalchemy as sa
from fastapi import APIRouter
from fastapi.responses import JSONResponse

from kcache_server.routes._deps import State
from kcache_server.schemas import HealthBody, ReadyBody
from kcache_server.service import ServerState

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=HealthBody)
async def healthz() -> HealthBody:
    """Liveness: the event loop answers."""
    return HealthBody(status="ok")


def _checks(state: ServerState) -> dict[str, str]:
    checks: dict[str, str] = {}
    try:
        with state.backends.db.connect() as conn:
            conn.execute(sa.text("SELECT 1"))
        checks["database"] = "ok"
    except Exception as exc:  # any driver error means not ready
        checks["database"] = f"failed: {type(exc).__name__}: {exc}"[:300]
    blobs = state.backends.store.blobs
    checks["store"] = "ok" if blobs.is_dir() and os.access(blobs, os.W_OK) else f"failed: {blobs} is not writable"
    alive = state.backends.compiler.alive
    checks["compile_workers"] = f"ok ({alive} running)" if alive else "failed: no compile worker is running"
    return checks


@router.get("/readyz", response_model=ReadyBody, responses={503: {"model": ReadyBody}})
async def readyz(state: State) -> JSONResponse:
    """Readiness: 200 when the database, the store and at least one compile worker work."""
    checks = await state.run(_checks, state)
    ready = all(v.startswith("ok") for v in checks.values())
    return JSONResponse({"status": "ready" if ready else "not_ready", "checks": checks}, 200 if ready else 503)
