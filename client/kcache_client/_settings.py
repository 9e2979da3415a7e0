"""Client settings from the environment (docs/design.md section 7); arguments override them.

A plain dataclass rather than pydantic-settings: the client is installed into
training images and keeps its dependencies to httpx, filelock and tqdm.

Local compiles default to on when no server is configured (nothing else could
compile a miss) and to off when one is: a worker that silently compiled for itself
while its server is down would hide the outage and key with its own NVRTC.
``KCACHE_LOCAL_COMPILE`` or ``local_compile=`` decide either way.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kcache._env import env_flag
from kcache.dirs import cache_dir as default_cache_dir
from kcache.errors import KCacheError
from kcache.eviction import parse_size

__all__ = ["ClientSettings"]


def _job_id_from_env() -> str | None:
    # The launcher's own job id when kcache's is not set: audit rows then group by job.
    for name in ("KCACHE_JOB_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID"):
        value = os.environ.get(name)
        if value:
            return value
    return None


def _include_sets(sets: Mapping[str, str | os.PathLike[str]] | None) -> dict[str, Path]:
    out: dict[str, Path] = {}
    for name, root in (sets or {}).items():
        path = Path(root)
        if not path.is_dir():
            raise KCacheError(f"include set {name!r}: {path} is not a directory")
        out[name] = path
    return out


def _cache_max_bytes(explicit: int | str | None) -> int | None:
    value = explicit if explicit is not None else os.environ.get("KCACHE_CACHE_MAX_BYTES") or None
    if value is None:
        return None
    what = "max_bytes" if explicit is not None else "KCACHE_CACHE_MAX_BYTES"
    try:
        return parse_size(value, what)
    except ValueError as exc:
        raise KCacheError(str(exc)) from None


@dataclass(frozen=True)
class ClientSettings:
    """``KCACHE_URL``, ``KCACHE_TOKEN``, ``KCACHE_CACHE_DIR``, ``KCACHE_CACHE_MAX_BYTES``, ``KCACHE_LOCAL_COMPILE``, ``KCACHE_JOB_ID``.

    ``include_sets`` (name -> directory) are what local compiles may read for the
    include sets a recipe names; a server has its own.
    """

    url: str | None
    token: str | None
    cache_dir: Path
    local_compile: bool
    job_id: str | None
    include_sets: dict[str, Path] = field(default_factory=dict)
    #: The node tier's cap (``KCACHE_CACHE_MAX_BYTES``): None for the default, 0 for none.
    cache_max_bytes: int | None = None

    @classmethod
    def from_env(
        cls,
        *,
        url: str | None = None,
        token: str | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        local_compile: bool | None = None,
        job_id: str | None = None,
        include_sets: Mapping[str, str | os.PathLike[str]] | None = None,
        max_bytes: int | str | None = None,
    ) -> ClientSettings:
        """Arguments first, then the environment, then the defaults."""
        resolved_url = (url or os.environ.get("KCACHE_URL") or "").strip() or None
        if local_compile is None:
            local_compile = env_flag("KCACHE_LOCAL_COMPILE")
        return cls(
            url=resolved_url,
            token=(token or os.environ.get("KCACHE_TOKEN") or None),
            cache_dir=default_cache_dir(cache_dir),
            local_compile=resolved_url is None if local_compile is None else local_compile,
            job_id=job_id or _job_id_from_env(),
            include_sets=_include_sets(include_sets),
            cache_max_bytes=_cache_max_bytes(max_bytes),
        )
