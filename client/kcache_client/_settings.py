"""Everything a ``KernelCache`` can be told, in one object: :class:`ClientSettings`.

Read from the environment (design §7) by :meth:`ClientSettings.from_env`, whose
arguments override it; or built directly. A plain dataclass rather than
pydantic-settings: the client is installed into training images and keeps its
dependencies to httpx, filelock and tqdm.

Local compiles default to on when no server is configured (nothing else could
compile a miss) and to off when one is: a worker that silently compiled for itself
while its server is down would hide the outage and key with its own NVRTC.
``KCACHE_LOCAL_COMPILE`` or ``local_compile=`` decide either way.
"""

from __future__ import annotations

import os
import random
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType

import httpx

from kcache._env import env_flag
from kcache.dirs import cache_dir as default_cache_dir
from kcache.errors import KCacheError
from kcache.eviction import parse_size

__all__ = ["DEFAULT_TIMEOUT", "ClientSettings", "RetryPolicy"]

#: A compile can take minutes on a cold server; connecting should not.
DEFAULT_TIMEOUT = httpx.Timeout(600.0, connect=5.0)


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded retries: at most ``attempts`` tries and ``budget_s`` seconds of waiting in all.

    The wait before try ``n`` is uniform in ``[0, min(cap_s, base_s * 2**n)]`` ("full
    jitter", so a thousand ranks retrying at once spread out), or the server's
    ``Retry-After`` when it gave one (capped by ``max_retry_after_s``).
    """

    attempts: int = 6
    base_s: float = 0.2
    cap_s: float = 10.0
    budget_s: float = 60.0
    max_retry_after_s: float = 30.0

    def backoff(self, attempt: int) -> float:
        """The jittered wait before retry number ``attempt`` (0-based)."""
        return random.uniform(0.0, min(self.cap_s, self.base_s * (2.0**attempt)))


def _job_id_from_env() -> str | None:
    # The launcher's own job id when kcache's is not set: audit rows then group by job.
    for name in ("KCACHE_JOB_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID"):
        value = os.environ.get(name)
        if value:
            return value
    return None


def _include_sets(sets: Mapping[str, str | os.PathLike[str]] | None) -> Mapping[str, Path]:
    out: dict[str, Path] = {}
    for name, root in (sets or {}).items():
        path = Path(root)
        if not path.is_dir():
            raise KCacheError(f"include set {name!r}: {path} is not a directory")
        out[name] = path
    return MappingProxyType(out)


def _cache_max_bytes(explicit: int | str | None) -> int | None:
    value = explicit if explicit is not None else os.environ.get("KCACHE_CACHE_MAX_BYTES") or None
    if value is None:
        return None
    what = "cache_max_bytes" if explicit is not None else "KCACHE_CACHE_MAX_BYTES"
    try:
        return parse_size(value, what)
    except ValueError as exc:
        raise KCacheError(str(exc)) from None


def _url(value: str | None) -> str | None:
    return (value or "").strip() or None


@dataclass(frozen=True)
class ClientSettings:
    """How a ``KernelCache`` reaches its server, where its node tier is, and how it behaves.

    Server: ``url`` (``KCACHE_URL``; None: no server), ``token`` (``KCACHE_TOKEN``),
    ``retry`` (a :class:`RetryPolicy`), ``timeout`` (an ``httpx.Timeout``; default 600 s
    to read, for compiles, and 5 s to connect). Node tier: ``cache_dir``
    (``KCACHE_CACHE_DIR``, else ``~/.cache/kcache/client``), ``cache_max_bytes`` (its
    cap, ``KCACHE_CACHE_MAX_BYTES``: None for the default of 10 GiB or 10 % of its
    filesystem, 0 for none), ``lock_timeout_s`` (how long a process waits for another
    one's download of the same kernel). This process: ``memory_entries`` (artifacts kept
    in memory), ``auto_target`` (what ``target="auto"`` means; default the device's
    ``sm_XY``), ``device`` (the CUDA device asked for it), ``host``, ``client_id``
    (``KCACHE_CLIENT_ID``) and ``job_id`` (``KCACHE_JOB_ID`` or the launcher's) for
    the audit, ``send_events`` (report node-local hits to the server). Local compiles:
    ``local_compile`` (``KCACHE_LOCAL_COMPILE``; None: on exactly when there is no
    server, see :attr:`compiles_locally`) and ``include_sets`` (name -> directory they
    may read for the include sets a recipe names; a server has its own).
    """

    url: str | None = None
    token: str | None = None
    cache_dir: Path = field(default_factory=default_cache_dir)
    cache_max_bytes: int | None = None
    local_compile: bool | None = None
    include_sets: Mapping[str, Path] = field(default_factory=lambda: MappingProxyType({}))
    job_id: str | None = None
    client_id: str | None = None
    host: str | None = None
    auto_target: str | None = None
    device: int | None = None
    send_events: bool = True
    memory_entries: int = 4096
    lock_timeout_s: float = 900.0
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    timeout: httpx.Timeout = field(default_factory=lambda: DEFAULT_TIMEOUT)

    def __post_init__(self) -> None:
        if self.memory_entries < 1:
            raise KCacheError(f"memory_entries must be at least 1, not {self.memory_entries}")
        if not self.lock_timeout_s > 0:
            raise KCacheError(f"lock_timeout_s must be positive, not {self.lock_timeout_s}")
        if self.cache_max_bytes is not None and self.cache_max_bytes < 0:
            raise KCacheError(f"cache_max_bytes must not be negative, not {self.cache_max_bytes}")

    @property
    def compiles_locally(self) -> bool:
        """Whether a miss the server cannot answer is compiled here (given NVRTC)."""
        return self.url is None if self.local_compile is None else self.local_compile

    @property
    def hostname(self) -> str:
        """``host``, else this machine's name."""
        return self.host or socket.gethostname()

    @classmethod
    def from_env(
        cls,
        *,
        url: str | None = None,
        token: str | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_max_bytes: int | str | None = None,
        local_compile: bool | None = None,
        include_sets: Mapping[str, str | os.PathLike[str]] | None = None,
        job_id: str | None = None,
        client_id: str | None = None,
        host: str | None = None,
        auto_target: str | None = None,
        device: int | None = None,
        send_events: bool = True,
        memory_entries: int = 4096,
        lock_timeout_s: float = 900.0,
        retry: RetryPolicy | None = None,
        timeout: httpx.Timeout | None = None,
    ) -> ClientSettings:
        """Arguments first, then the environment, then the defaults.

        ``cache_max_bytes`` also takes sizes such as ``"10GiB"``.
        """
        if local_compile is None:
            local_compile = env_flag("KCACHE_LOCAL_COMPILE")
        return cls(
            url=_url(url or os.environ.get("KCACHE_URL")),
            token=token or os.environ.get("KCACHE_TOKEN") or None,
            cache_dir=default_cache_dir(cache_dir),
            cache_max_bytes=_cache_max_bytes(cache_max_bytes),
            local_compile=local_compile,
            include_sets=_include_sets(include_sets),
            job_id=job_id or _job_id_from_env(),
            client_id=client_id or os.environ.get("KCACHE_CLIENT_ID") or None,
            host=host,
            auto_target=auto_target,
            device=device,
            send_events=send_events,
            memory_entries=memory_entries,
            lock_timeout_s=lock_timeout_s,
            retry=retry or RetryPolicy(),
            timeout=timeout or DEFAULT_TIMEOUT,
        )

    def located(
        self,
        url: str | None = None,
        token: str | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
    ) -> ClientSettings:
        """A copy with the server and cache directory given (what is None is kept)."""
        if url is None and token is None and cache_dir is None:
            return self
        return replace(
            self,
            url=self.url if url is None else _url(url),
            token=self.token if token is None else token or None,
            cache_dir=self.cache_dir if cache_dir is None else default_cache_dir(cache_dir),
        )
