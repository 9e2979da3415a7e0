"""One rank of a warmup over a long-lived TCPStore the test hosts: gloo on CPU, no server.

    python stale_store_worker.py CONFIG.json RANK

The config gives ``world``, ``port`` (the test's TCPStore), ``timeout``, ``out`` and
``recipes`` (kernel names). ``absent``: ranks that join the process group but never
call the warmup (they exit at once, as a rank that crashed would). ``run_id``: set as
``TORCHELASTIC_RUN_ID`` before the warmup. ``garbage``: ``{"key", "value"}`` written
into the job's default store by rank 0 before the warmup (every rank waits for every
other to be past its init first) to stand for anything a foreign writer left there.

The cache is a stub with the shape ``warmup`` needs (the collectives over the store are
what is under test): every recipe resolves to synthetic bytes, instantly. Each rank
writes ``<out>/<rank>.json``: ``ok``, or the error's class, message and missing ranks.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
from kcache_client import Artifact, WarmupError

from kcache import Recipe
from kcache.artifact import ArtifactMeta
from kcache.errors import KCacheError

TOOLCHAIN = "nvrtc-12.8"


def recipe(name: str) -> Recipe:
    """A concrete recipe (target and toolchain given): the stub never needs to fill them in."""
    source = f'extern "C" __global__ void {name}(float* x) {{ x[0] = 1.0f; }}\n'
    return Recipe(source=source, target="sm_80", toolchain=TOOLCHAIN)


class StubCache:
    """What ``kcache_client._warmup.warmup`` asks of a cache, answered from nothing."""

    def __init__(self, rank: int, host: str = "node") -> None:
        self.rank = rank
        self.host = host
        self.resolved: list[str] = []

    def prepare(self, recipe: Recipe) -> Recipe:
        return recipe

    def artifact(self, recipe: Recipe, origin: Any) -> Artifact:
        data = f"cubin of {recipe.key()}".encode()
        meta = ArtifactMeta(
            digest=hashlib.sha256(data).hexdigest(),
            size=len(data),
            kind="cubin",
            target="sm_80",
            toolchain=TOOLCHAIN,
        )
        return Artifact(
            recipe_key=recipe.key(),
            base_key=recipe.base_key(),
            digest=meta.digest,
            data=data,
            blob_path=f"/nonexistent/{meta.digest}",
            metadata=meta,
            recipe=recipe,
            origin=origin,
        )

    def get(self, recipe: Recipe, *, compile: bool = True) -> Artifact:
        return self.artifact(recipe, "node")

    def get_many(
        self,
        recipes: Sequence[Recipe],
        *,
        compile: bool = True,
        progress: bool = False,
        context: Mapping[str, Any] | None = None,
    ) -> list[Artifact | KCacheError]:
        self.resolved.extend(r.key() for r in recipes)
        return [self.artifact(r, "compiled") for r in recipes]

    def context(self) -> dict[str, Any]:
        return {"rank": self.rank}


def main() -> None:
    from kcache_client._warmup import warmup

    cfg = json.loads(Path(sys.argv[1]).read_text())
    rank = int(sys.argv[2])
    timeout = timedelta(seconds=30)
    store = dist.TCPStore("127.0.0.1", cfg["port"], cfg["world"], is_master=False, timeout=timeout)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=cfg["world"], timeout=timeout
    )
    report = Path(cfg["out"], f"{rank}.json")
    default = dist.distributed_c10d._get_default_store()
    garbage = cfg.get("garbage")
    if garbage and rank == 0:
        default.set(garbage["key"], garbage["value"])
    # Every rank past its init (gloo's handshake ends at different times on different
    # ranks) and the garbage written, before anyone warms up or leaves.
    arrived = f"test/{Path(cfg['out']).name}/initialised"
    default.add(arrived, 1)
    while int(default.add(arrived, 0)) < cfg["world"]:
        time.sleep(0.01)
    if rank in cfg.get("absent", []):
        report.write_text(json.dumps({"rank": rank, "absent": True}))
        os._exit(0)  # as a crash would: nothing torn down, no warmup
    if cfg.get("run_id"):
        os.environ["TORCHELASTIC_RUN_ID"] = cfg["run_id"]
    cache = StubCache(rank)
    started = time.monotonic()
    out: dict[str, Any] = {"rank": rank}
    try:
        result = warmup(cache, [recipe(n) for n in cfg["recipes"]], timeout=cfg["timeout"])
        out.update(ok=True, union=result.union_size, leader=result.leader, resolved=cache.resolved)
        out["digests"] = [a.digest for a in result.artifacts]
    except WarmupError as exc:
        out.update(
            ok=False,
            error=type(exc).__name__,
            message=str(exc),
            missing_ranks=exc.missing_ranks,
        )
    out["seconds"] = time.monotonic() - started
    report.write_text(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
