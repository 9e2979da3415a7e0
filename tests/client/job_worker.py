"""One rank of a job test: a real process in a gloo (CPU) torch.distributed job.

    python job_worker.py CONFIG.json RANK

Every rank opens a cache on the node's one tier, warms up from the job's manifest on
the world group (``warmup([], manifest=M, then="error")``), then asks for each covered
recipe and for one the manifest lacks, and writes ``<out>/<rank>.json``: the covered
origins, the late lookup's error (class and recipe key) and the prefetch counters.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
from kcache_client import ClientSettings, KernelCache, LateCompileError, RetryPolicy

from kcache import Recipe
from kcache.job_manifest import JobManifest


def main() -> None:
    cfg = json.loads(Path(sys.argv[1]).read_text())
    rank = int(sys.argv[2])
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{cfg['port']}",
        rank=rank,
        world_size=cfg["world"],
        timeout=timedelta(seconds=60),
    )
    settings = ClientSettings.from_env(
        auto_target="sm_80",
        retry=RetryPolicy(attempts=3, base_s=0.05, cap_s=0.2, budget_s=2.0),
        send_events=True,
        job_id=cfg["job"],
        known_servers=cfg["known"],
    )
    out: dict[str, object] = {"rank": rank}
    with KernelCache(cfg["url"], cache_dir=cfg["tier"], settings=settings) as cache:
        manifest = JobManifest.load(cfg["manifest"])
        cache.warmup([], manifest=manifest, then="error", timeout=60)
        out["frozen"] = cache.frozen
        covered = [Recipe.from_dict(r) for r in cfg["covered"]]
        out["origins"] = [cache.get(r).origin for r in covered]
        try:
            cache.get(Recipe.from_dict(cfg["late"]))
            out["late"] = None
        except LateCompileError as exc:
            out["late"] = {"class": type(exc).__name__, "recipe_key": exc.recipe_key}
        out["bundle_requests"] = cache.stats.bundle_requests
        out["late_lookups"] = cache.stats.late_lookups
    dist.destroy_process_group()
    Path(cfg["out"], f"{rank}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main()
