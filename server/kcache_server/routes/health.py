"""``GET /healthz`` (the process answers) and ``GET /readyz`` (database, store, workers, sandbox).

Both answer without a token, so what they say is for anyone who can reach the
port: a failed check names what failed and what to do, never a driver's error
text or a path (those go to the log, under the request id the answer gives).
"""

from __future__ import annotations

import logging
import os

import sqlalchemy as sa
from fastapi import APIRouter, Response

from kcache.fsutil import free_bytes
from kcache_server.request_ids import current_request_id
from kcache_server.routes._deps import State
from kcache_server.schemas import HealthBody, ReadyBody
from kcache_server.state import ServerState

router = APIRouter(tags=["health"])

log = logging.getLogger(__name__)


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
        # The driver's text can hold the host, user and database name: log it, do not answer it.
        request_id = current_request_id()
        cause = getattr(exc, "driver_error", None) or exc  # DatabaseUnavailableError's original
        log.warning(
            "readyz %s: the database check failed: %s: %s", request_id, type(cause).__name__, cause
        )
        checks["database"] = (
            f"failed: database unreachable (the server log has the error under request id {request_id})"
        )
    # A deleted SQLite file still answers (open connections keep its inode): look for it.
    db_file = state.backends.db_file
    vanished = db_file.problem() if db_file is not None else None
    if vanished is not None:
        checks["database"] = f"failed: {vanished}"
    checks["disk"] = _disk(state)
    blobs = state.backends.store.blobs
    if blobs.is_dir() and os.access(blobs, os.W_OK):
        checks["store"] = "ok"
    else:
        log.warning("readyz %s: the blob store %s is not writable", current_request_id(), blobs)
        checks["store"] = (
            "failed: the blob store is not writable (the server log names its directory)"
        )
    alive = state.backends.compiler.alive
    checks["compile_workers"] = (
        f"ok ({alive} running)" if alive else "failed: no compile worker is running"
    )
    checks["compile_sandbox"] = _sandbox(state)
    return checks


def _disk(state: ServerState) -> str:
    """Free space under the data directory (store, SQLite, compile scratch) against min_free_bytes."""
    minimum = state.settings.min_free_bytes
    try:
        free = free_bytes(state.settings.data_dir)
    except OSError as exc:
        return f"failed: cannot read the data directory's free space ({exc.strerror})"
    if free < minimum:
        return f"failed: {free} bytes free under the data directory, below min_free_bytes={minimum}"
    return f"ok ({free} bytes free)"


def _sandbox(state: ServerState) -> str:
    """Whether compile workers run confined by Landlock.

    ``degraded`` (the operator allowed unconfined workers: compile_sandbox best-effort
    or off) does not make the server unready, but says so on every probe; with
    ``required`` an unconfined worker never starts, so this never reads degraded then.
    """
    status = state.backends.compiler.sandbox
    if status is None:
        return "failed: no compile worker has reported its confinement yet"
    if status.active:
        return f"ok ({status.detail})"
    return (
        f"degraded: {status.detail} (compile_sandbox={state.settings.compile_sandbox_mode}); "
        "NVRTC in the workers can open any file this server can read"
    )


@router.get("/readyz", response_model=ReadyBody, responses={503: {"model": ReadyBody}})
async def readyz(state: State, response: Response) -> ReadyBody:
    """Readiness: 200 when the database, the store and at least one compile worker work.

    ``compile_sandbox`` reads ``degraded`` where the workers run unconfined by choice;
    that is reported, not a reason to take the server out of service.
    """
    checks = await state.run(_checks, state)
    ready = all(v.startswith("ok") or v.startswith("degraded") for v in checks.values())
    response.status_code = 200 if ready else 503
    return ReadyBody(status="ready" if ready else "not_ready", checks=checks)
