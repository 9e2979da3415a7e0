"""What a ``KernelCache`` does for a job as a whole: its warmup, a prefetch, the server's manifest.

The job façade's steps, each a function of what it needs of the cache. ``KernelCache``
imports this module when one of them is first called: a rank that only ``get``\\ s
(a first launch is timed in milliseconds, B7) never loads the warmup, the collectives
or the fan-out (:mod:`~kcache_client._warmup`, :mod:`~kcache_client._collective`,
:mod:`~kcache_client._fanout`). The freeze mode and the process's own manifest are the
get path's (:mod:`~kcache_client._lookup`); a warmup sets the one and fills the other.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol
from urllib.parse import quote

from kcache.errors import KCacheError
from kcache.job_manifest import JobManifest
from kcache.recipe import Recipe
from kcache_client._bundle import BundleCache, PrefetchResult, prefetch
from kcache_client._fanout import prefetch_in_group
from kcache_client._freeze import Freezer, after_warmup_mode
from kcache_client._include_pins import IncludeSetPins
from kcache_client._warmup import WarmupCache, WarmupResult, warmup
from kcache_client._withdrawal_watch import WithdrawalWatch

__all__ = ["JobCache", "prefetch_manifest", "run_warmup", "server_manifest"]


class JobCache(WarmupCache, BundleCache, Protocol):
    """What a job's steps need of a ``KernelCache``: a warmup's and a bundle's needs, and
    the include sets it pins (a job start pins them again)."""

    include_pins: IncludeSetPins


def run_warmup(
    cache: JobCache,
    recipes: Iterable[Recipe],
    group: Any,
    *,
    freezer: Freezer,
    watch: WithdrawalWatch | None,
    per_node: bool,
    timeout: float,
    compile: bool,
    progress: bool | None,
    manifest: JobManifest | None,
    then: str | None,
) -> WarmupResult:
    """``KernelCache.warmup``: see its docstring. ``freezer`` and ``watch`` are the cache's
    get path's: thawed and told that the job starts while the warmup runs."""
    mode = after_warmup_mode(then, cache.settings.after_warmup)
    cache.include_pins.refresh()  # a job start: the server's include sets as they are now
    before = freezer.mode
    freezer.set("allow")
    try:
        if watch is not None:  # a job start: its first local answer reads withdrawals first
            watch.expire(True)
        if manifest is not None:  # one request per job, fanned out over the group
            prefetch_in_group(cache, manifest, group, timeout=timeout, host=cache.host)
        result = warmup(
            cache,
            recipes,
            group,
            per_node=per_node,
            timeout=timeout,
            compile=compile,
            progress=progress,
        )
    finally:
        freezer.set(before)  # a failed warmup leaves the cache as it was
        if watch is not None:  # what the server answered needs no read; nor what follows
            watch.expire(False)
    if mode is not None:
        freezer.set(mode)
    return result


def server_manifest(cache: BundleCache, job_id: str | None) -> JobManifest:
    """``KernelCache.job_manifest``: see its docstring."""
    job = job_id or cache.settings.job_id
    if not job:
        raise KCacheError("no job id: pass one, or set KCACHE_JOB_ID")
    body = cache._require_server().transport.request_json(
        "GET", f"/v1/jobs/{quote(job, safe='')}/manifest"
    )
    return JobManifest.from_dict(body)


def prefetch_manifest(
    cache: BundleCache, manifest: JobManifest, group: Any, *, timeout: float, host: str
) -> PrefetchResult:
    """``KernelCache.prefetch``: this node alone without a ``group``, else fanned out over it."""
    if group is None:
        return prefetch(cache, manifest)
    return prefetch_in_group(cache, manifest, group, timeout=timeout, host=host)
