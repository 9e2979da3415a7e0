"""``GET /healthz`` (the process answers) and ``GET /readyz`` (database, bucket, store, workers, sandbox).

``/readyz`` also names the release this replica runs (``version``), so a rolling
upgrade shows which replicas run which. The ``kcache_ready`` gauges of
:mod:`kcache_server.metrics` say what ``/readyz`` would answer now: every scrape of
``/metrics`` runs the same checks (:func:`install_readiness_gauges`; the bucket's answer
is kept a few seconds, as for probes), so the "replica not ready" alert reads a current
value on a server nothing probes, not the 0 a gauge starts at.

Both answer without a token, so what they say is for anyone who can reach the
port: a failed check names what failed and what to do, never a driver's error
text or a path (those go to the log, under the request id the answer gives).

The checks that ask another service (the database; the bucket, with a
``store_url``) are bounded in time (:mod:`kcache_server.readiness`): they run at
once, each on a thread of its own outside the engine's limiter, and one that does
not answer within ``readiness_timeout_s`` fails, so ``/readyz`` answers within
about that long whatever a backend does.
"""

from __future__ import annotations

import logging
from typing import Any

import anyio
from fastapi import APIRouter, Request, Response

from kcache._version import __version__
from kcache.errors import StoreUnavailableError
from kcache.fsutil import free_bytes
from kcache_server.readiness import BoundedCheck, Readiness, compiler_checks
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


def _readiness(request: Request, state: ServerState) -> Readiness:
    """The app's bounded backend checks (made on the first probe; kept with the app)."""
    readiness = getattr(request.app.state, "readiness", None)
    if not isinstance(readiness, Readiness):
        readiness = Readiness(state.backends, timeout_s=state.settings.readiness_timeout_s)
        request.app.state.readiness = readiness
    return readiness


def install_readiness_gauges(app: Any, state: ServerState) -> None:
    """Make every scrape of ``/metrics`` set ``kcache_ready`` from the checks ``/readyz`` runs.

    The checks are the app's (one :class:`Readiness`, shared with ``/readyz``); the
    scrape runs them on its own worker thread, each within ``readiness_timeout_s``.
    """
    readiness = Readiness(state.backends, timeout_s=state.settings.readiness_timeout_s)
    app.state.readiness = readiness

    def sample() -> None:
        checks = {
            check.name: check.status()
            for check in (readiness.database, readiness.bucket)
            if check is not None
        }
        _record(state, _merged(checks, _checks(state)))

    state.metrics.add_sampler(sample)


def _merged(checks: dict[str, str], local: dict[str, str]) -> dict[str, str]:
    """The backends' checks and the local ones; a vanished SQLite file says more than SELECT 1."""
    if "database" in local:
        checks["database"] = local.pop("database")
    checks.update(local)
    return checks


def _record(state: ServerState, checks: dict[str, str]) -> bool:
    """Whether ``checks`` make the server ready, set in its ``kcache_ready`` gauges too."""
    ready = all(v.startswith("ok") or v.startswith("degraded") for v in checks.values())
    state.metrics.readiness(ready, {name: not v.startswith("failed") for name, v in checks.items()})
    return ready


async def _backends(readiness: Readiness) -> dict[str, str]:
    """The database's and the bucket's checks, run at once, each within its bound."""
    checks: dict[str, str] = {}
    bounded = [c for c in (readiness.database, readiness.bucket) if c is not None]

    async def one(check: BoundedCheck) -> None:
        checks[check.name] = await anyio.to_thread.run_sync(check.status)

    async with anyio.create_task_group() as group:
        for check in bounded:
            group.start_soon(one, check)
    return {check.name: checks[check.name] for check in bounded}


def _checks(state: ServerState) -> dict[str, str]:
    """The local checks: the SQLite file, the disk, the store's directory, the workers."""
    checks: dict[str, str] = {}
    # A deleted SQLite file still answers (open connections keep its inode): look for it.
    db_file = state.backends.db_file
    vanished = db_file.problem() if db_file is not None else None
    if vanished is not None:
        checks["database"] = f"failed: {vanished}"
    checks["disk"] = _disk(state)
    try:
        state.backends.store.probe()  # its own medium: a bucket behind it is the bounded check's
        checks["store"] = "ok"
    except StoreUnavailableError as exc:
        log.warning("readyz %s: the blob store failed its probe: %s", current_request_id(), exc)
        checks["store"] = (
            "failed: the blob store is not writable (the server log names its directory)"
        )
    checks.update(compiler_checks(state.backends.compiler, state.settings.compile_sandbox_mode))
    return checks


def _disk(state: ServerState) -> str:
    """Free space under the data directory (store, SQLite, compile scratch) against min_free_bytes."""
    minimum = state.settings.min_free_bytes
    try:
        free = free_bytes(state.settings.data_dir)
    except OSError as exc:
        return f"failed: cannot read the data directory's free space ({exc.strerror})"
    if free < minimum:
        return (
            f"failed: {free} bytes free under the data directory, below min_free_bytes={minimum} "
            "(KCACHE_MIN_FREE_BYTES): free some space (kcache db gc removes unreferenced blobs)"
        )
    return f"ok ({free} bytes free)"


@router.get("/readyz", response_model=ReadyBody, responses={503: {"model": ReadyBody}})
async def readyz(request: Request, state: State, response: Response) -> ReadyBody:
    """Readiness: 200 when the database, the bucket (if any), the store and a compile worker work.

    A server that cannot compile (no NVRTC >= 13.3) reads ``degraded`` on
    ``compile_workers`` and ``compile_sandbox``, with the reason, and is ready: it serves
    fetches (:func:`kcache_server.readiness.compiler_checks`).

    The database and the bucket are asked within ``readiness_timeout_s`` each (the
    bucket's answer is kept a few seconds); one that is down or slow is a 503 whose
    ``checks`` say which. ``compile_sandbox`` reads ``degraded`` where the workers run
    unconfined by choice; that is reported, not a reason to take the server out of service.
    """
    checks = await _backends(_readiness(request, state))
    # Local checks on a thread outside the engine's limiter: a probe never queues behind compiles.
    local = await anyio.to_thread.run_sync(_checks, state)
    checks = _merged(checks, local)
    ready = _record(state, checks)
    response.status_code = 200 if ready else 503
    return ReadyBody(status="ready" if ready else "not_ready", version=__version__, checks=checks)
