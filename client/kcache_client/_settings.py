"""Client settings from the environment (ARCHITECTURE section 7); arguments override them.

A plain dataclass rather than pydantic-settings: the client is installed into
training images and keeps its dependencies to httpx, filelock and tqdm.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from kcache_client._tier import default_cache_dir

__all__ = ["ClientSettings"]

_TRUE = {"1", "true", "yes", "on"}


def _job_id_from_env() -> str | None:
    # The launcher's own job id when kcache's is not set: audit rows then group by job.
    for name in ("KCACHE_JOB_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID"):
        value = os.environ.get(name)
        if value:
            return value
    return None


@dataclass(frozen=True)
class ClientSettings:
    """``KCACHE_URL``, ``KCACHE_TOKEN``, ``KCACHE_CACHE_DIR``, ``KCACHE_LOCAL_COMPILE``, ``KCACHE_JOB_ID``."""

    url: str | None
    token: str | None
    cache_dir: Path
    local_compile: bool
    job_id: str | None

    @classmethod
    def from_env(
        cls,
        *,
        url: str | None = None,
        token: str | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        local_compile: bool | None = None,
        job_id: str | None = None,
    ) -> ClientSettings:
        """Arguments first, then the environment, then the defaults."""
        env_local = os.environ.get("KCACHE_LOCAL_COMPILE", "").strip().lower() in _TRUE
        return cls(
            url=(url or os.environ.get("KCACHE_URL") or None),
            token=(token or os.environ.get("KCACHE_TOKEN") or None),
            cache_dir=Path(cache_dir) if cache_dir is not None else default_cache_dir(),
            local_compile=env_local if local_compile is None else local_compile,
            job_id=job_id or _job_id_from_env(),
        )
