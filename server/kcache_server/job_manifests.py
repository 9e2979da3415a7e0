"""A job's manifest from the audit: every kernel it was served, with the artifact that served it.

Read from the audit events that name the job (``job_id``): its resolves and batch
resolves (a warmup's), its bundle fetches (``POST /v1/bundle`` with its context), and
the memory and node-tier hits its clients reported, and its fetches by key
(``GET /v1/recipes/{key}/artifact``, whose context comes in ``X-KCache-Context``). A fetch
that nginx answers from its edge cache carries no context and is not attributed to a
job. Per recipe key the latest served event
decides the digest; the artifact's kind and size come from the store's index while
it holds the artifact (empty and 0 once it is evicted). Events past the audit's
retention are gone, and with them a job's manifest: save it when the job runs.

The foreign groups the job's library hooks used come from its foreign lookups (route
``foreign``: a hook's ``GET /v1/foreign/...`` and a bundle's foreign groups, each with
the caller's context), hit or miss (a miss is followed by the library's compile and the
hook's publish under that name), for the bindings the server holds now, with their files
as stored (docs/design.md section 10). The name is read back from the row's kernel
(``foreign:<library>:<key>``), target and toolchain (``<library>-<version>/<toolchain>``);
a row at a column's bound may have been cut and is left out rather than misread.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from kcache.foreign import ForeignFileRef, ForeignName, ForeignNameError
from kcache.job_manifest import MAX_KERNELS, JobManifest, ManifestForeign, ManifestKernel
from kcache.keys import is_hex_key
from kcache.outcomes import SERVED_OUTCOMES
from kcache_server.errors import InvalidRequestError
from kcache_server.models import artifacts_table as _artifacts
from kcache_server.models import audit_events_table as _events
from kcache_server.models import foreign_bindings_table as _bindings
from kcache_server.models import foreign_files_table as _files

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
    # One bound for both: what is left of it after the kernels is what the groups may take.
    foreign = _foreign_groups(db, job_id, MAX_KERNELS - len(kernels))
    return JobManifest.of(kernels, job_id, foreign=foreign)


#: The audit columns a foreign lookup's name is read back from, and their sizes: a value
#: this long may have been cut (``models.AuditEvent``).
_KERNEL_CHARS, _TARGET_CHARS, _TOOLCHAIN_CHARS = 1024, 32, 128
_PREFIX = "foreign:"


def _foreign_name(
    kernel: str | None, target: str | None, toolchain: str | None
) -> ForeignName | None:
    """The name of a foreign lookup's audit row, or None
    for a row that is not one, or whose fields may have been cut to their columns."""
    if not kernel or not target or not toolchain or not kernel.startswith(_PREFIX):
        return None
    if (
        len(kernel) >= _KERNEL_CHARS
        or len(target) >= _TARGET_CHARS
        or len(toolchain) >= _TOOLCHAIN_CHARS
    ):
        return None
    library, _, key = kernel[len(_PREFIX) :].partition(":")
    if not toolchain.startswith(f"{library}-"):
        return None
    version, _, compiler = toolchain[len(library) + 1 :].partition("/")
    try:
        return ForeignName(library, version, target, compiler, key).check()
    except ForeignNameError:
        return None


def _foreign_groups(db: sa.Engine, job_id: str, most: int) -> list[ManifestForeign]:
    """The foreign groups ``job_id`` looked up that the server holds now (module docstring);
    more than ``most`` looked up (what the manifest's bound leaves after the job's kernels)
    is refused as the kernels' bound is, naming the bound both share."""
    ev = _events.c
    query = (
        sa.select(ev.kernel, ev.target, ev.toolchain)
        .where(
            ev.job_id == job_id,
            ev.route == "foreign",
            ev.kernel.like(f"{_PREFIX}%"),
            ev.recipe_key.is_(None),
        )
        .distinct()
        .limit(most + 1)
    )
    with db.connect() as conn:
        rows = conn.execute(query).all()
        if len(rows) > most:
            raise InvalidRequestError(
                "job_id",
                f"job {job_id!r} looked up more than {MAX_KERNELS} recipes and foreign groups "
                "together, the most one manifest lists",
            )
        names = {n for r in rows if (n := _foreign_name(r.kernel, r.target, r.toolchain))}
        by_key = {n.binding_key: n for n in names}
        return _held(conn, by_key)


def _held(conn: sa.Connection, names: dict[str, ForeignName]) -> list[ManifestForeign]:
    """The bindings of ``names`` (binding key -> name) the server holds, with their files."""
    found: list[ManifestForeign] = []
    keys: Sequence[str] = sorted(names)
    for start in range(0, len(keys), 500):
        chunk = keys[start : start + 500]
        rows = conn.execute(
            sa.select(_bindings.c.binding_key, _files.c.name, _files.c.digest, _files.c.size)
            .select_from(_bindings.join(_files, _files.c.binding_id == _bindings.c.id))
            .where(_bindings.c.binding_key.in_(chunk))
        ).all()
        files: dict[str, list[ForeignFileRef]] = {}
        for r in rows:
            files.setdefault(r.binding_key, []).append(
                ForeignFileRef(r.name, r.digest, int(r.size))
            )
        found += [ManifestForeign.of(names[k], files[k]) for k in chunk if k in files]
    return found
