"""A job's manifest from the audit: every kernel it was served, with the artifact that served it.

Read from the audit events that name the job (``job_id``): its resolves and batch
resolves (a warmup's), its bundle fetches (``POST /v1/bundle`` with its context), and
the memory and node-tier hits its clients reported. A fetch by key
(``GET /v1/recipes/{key}/artifact``) carries no context, so it is not attributed to a
job; a job's warmup, which resolves, is. Per recipe key the latest served event
decides the digest; the artifact's kind and size come from the store's index while
it holds the artifact (empty and 0 once it is evicted). Events past the audit's
retention are gone, and with them a job's manifest: save it when the job runs.
"""

from __future__ import annotations

import sqlalchemy as sa

from kcache.job_manifest import MAX_KERNELS, JobManifest, ManifestKernel
from kcache.keys import is_hex_key
from kcache.outcomes import SERVED_OUTCOMES
from kcache_server.errors import InvalidRequestError
from kcache_server.models import artifacts_table as _artifacts
from kcache_server.models import audit_events_table as _events

__all__ = ["job_manifest"]


def job_manifest(db: sa.Engine, job_id: str) -> JobManifest:
    """The manifest of ``job_id`` (no kernels when the audit names none for it)."""
    if not isinstance(job_id, str) or not 1 <= len(job_id) <= 256:
        raise InvalidRequestError("job_id", "a job id is 1 to 256 characters")
    ev = _events.c
    served = sa.and_(
        ev.job_id == job_id,
        ev.recipe_key.is_not(None),
        ev.digest.is_not(None),
        ev.outcome.in_(sorted(SERVED_OUTCOMES)),
    )
    latest = (
        sa.select(sa.func.max(ev.id).label("id")).where(served).group_by(ev.recipe_key).subquery()
    )
    query = (
        sa.select(
            ev.recipe_key,
            ev.digest,
            ev.kernel,
            ev.target,
            ev.toolchain,
            _artifacts.c.kind,
            _artifacts.c.size,
        )
        .select_from(
            _events.join(latest, latest.c.id == ev.id).outerjoin(
                _artifacts, _artifacts.c.digest == ev.digest
            )
        )
        .limit(MAX_KERNELS + 1)
    )
    with db.connect() as conn:
        rows = conn.execute(query).all()
    if len(rows) > MAX_KERNELS:
        raise InvalidRequestError(
            "job_id", f"job {job_id!r} looked up more than {MAX_KERNELS} recipes"
        )
    kernels = [
        ManifestKernel(
            r.recipe_key,
            r.digest,
            kernel=r.kernel or "",
            target=r.target or "",
            toolchain=r.toolchain or "",
            kind=r.kind or "",
            size=int(r.size or 0),
        )
        for r in rows
        if is_hex_key(r.recipe_key) and is_hex_key(r.digest)
    ]
    return JobManifest.of(kernels, job_id)
