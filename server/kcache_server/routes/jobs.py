"""``GET /v1/jobs/{job_id}/manifest``: the kernels a job was served, as a versioned manifest."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path

from kcache.job_manifest import JobManifest
from kcache_server.job_manifests import job_manifest
from kcache_server.routes._deps import ERRORS, Reader, State
from kcache_server.schemas import PRINTABLE_PATTERN, JobManifestBody
from kcache_server.state import ServerState

__all__ = ["router"]

router = APIRouter(prefix="/v1/jobs", tags=["audit"])


def _manifest(state: ServerState, job_id: str) -> JobManifest:
    # Read-your-writes: the job's last lookups may still wait in the audit writer.
    state.audit.flush()
    return job_manifest(state.backends.db, job_id)


@router.get("/{job_id}/manifest", response_model=JobManifestBody, responses=ERRORS)
async def get_job_manifest(
    job_id: Annotated[
        str,
        Path(
            min_length=1,
            max_length=256,
            # Stated for the schema; a control character in a path is refused (400) before routing.
            json_schema_extra={"pattern": PRINTABLE_PATTERN},
        ),
    ],
    _: Reader,
    state: State,
) -> JobManifestBody:
    """Every kernel the job was served (from the audit events that name it), sorted by recipe key.

    A job the audit names no served lookups for has a manifest without kernels. Save it
    with ``kcache manifest save --job JOB -o FILE``; ``kcache manifest diff`` compares two.
    """
    manifest: JobManifest = await state.run(_manifest, state, job_id)
    return JobManifestBody.model_validate(manifest.to_dict())
