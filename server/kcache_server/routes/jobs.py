"""``GET /v1/jobs/{job_id}/manifest``: the kernels a job was served, as a versioned manifest."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path
from pydantic import BaseModel, Field

from kcache.job_manifest import JobManifest
from kcache_server.job_manifests import job_manifest
from kcache_server.routes._deps import ERRORS, Reader, State
from kcache_server.routes.foreign import ForeignFileBody
from kcache_server.schemas import PRINTABLE_PATTERN, JobManifestBody
from kcache_server.state import ServerState

__all__ = ["router"]

router = APIRouter(prefix="/v1/jobs", tags=["audit"])


class ManifestForeignBody(BaseModel):
    """A foreign group the job's library hooks used (docs/design.md section 10)."""

    library: str
    version: str
    target: str
    toolchain: str
    key: str
    binding_key: str = Field(description="sha256 of the name (kcache.foreign.binding_key)")
    files: list[ForeignFileBody]


class JobManifestWithForeignBody(JobManifestBody):
    """A job's manifest; ``foreign`` only in a version 2 one (a job whose hooks used any)."""

    foreign: list[ManifestForeignBody] = Field(
        default_factory=list,
        description="foreign groups, by binding key; absent in a version 1 manifest",
    )


def _manifest(state: ServerState, job_id: str) -> JobManifest:
    # Read-your-writes: the job's last lookups may still wait in the audit writer.
    state.audit.flush()
    return job_manifest(state.backends.db, job_id)


@router.get(
    "/{job_id}/manifest",
    response_model=JobManifestWithForeignBody,
    response_model_exclude_unset=True,
    responses=ERRORS,
)
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
) -> JobManifestWithForeignBody:
    """Every kernel the job was served (from the audit events that name it), sorted by recipe key,
    and the foreign groups its library hooks looked up that the server holds (version 2).

    A job the audit names no served lookups for has a manifest without kernels. Save it
    with ``kcache manifest save --job JOB -o FILE``; ``kcache manifest diff`` compares two.
    """
    manifest: JobManifest = await state.run(_manifest, state, job_id)
    return JobManifestWithForeignBody.model_validate(manifest.to_dict())
