"""One rank of a multi-rank warmup test: a real process in a gloo (CPU) torch.distributed job.

    python warmup_worker.py CONFIG.json RANK

The config gives the world size, the rendezvous port, the server URL, each rank's
recipes, cache directory and auto target. The rank writes ``<out>/<rank>.json``
with what it got (digests, targets, statuses) or the error it raised.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
from kcache_client import KernelCache, RetryPolicy, WarmupError

from kcache import Recipe
from kcache.errors import CompileError


def main() -> None:
    cfg = json.loads(Path(sys.argv[1]).read_text())
    rank = int(sys.argv[2])
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{cfg['port']}",
        rank=rank,
        world_size=cfg["world"],
        timeout=timedelta(seconds=cfg["timeout"] * 2),
    )
    recipes = [Recipe.from_dict(d) for d in cfg["recipes"][rank]]
    cache = KernelCache(
        url=cfg["url"],
        cache_dir=cfg["cache_dirs"][rank],
        auto_target=cfg["targets"][rank],
        retry=RetryPolicy(**cfg.get("retry", {})),
        job_id="warmup-test",
        host=cfg["hosts"][rank] if "hosts" in cfg else None,
        send_events=False,
    )
    out: dict[str, object] = {"rank": rank}
    started = time.monotonic()
    try:
        result = cache.warmup(
            recipes, timeout=cfg["timeout"], per_node=cfg.get("per_node", False), progress=rank == 0
        )
        out.update(
            ok=True,
            keys=[a.recipe_key for a in result.artifacts],
            digests=[a.digest for a in result.artifacts],
            targets=[a.metadata.target for a in result.artifacts],
            statuses=result.statuses,
            leader=result.leader,
            union=result.union_size,
            verified=all(hashlib.sha256(a.data).hexdigest() == a.digest for a in result.artifacts),
            paths=[str(a.path) for a in result.artifacts],
        )
    except WarmupError as exc:
        out.update(
            ok=False,
            error=type(exc).__name__,
            message=str(exc),
            recipe_key=exc.recipe_key,
            compile_error=isinstance(exc, CompileError),
            log=exc.log,
        )
    out["seconds"] = time.monotonic() - started
    cache.close()
    Path(cfg["out"], f"{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
