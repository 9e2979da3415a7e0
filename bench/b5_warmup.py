"""B5: warmup, 8 ranks x 24 distinct kernels, empty caches: wall s and NVRTC compiles.

Ours: 8 real processes in a gloo (CPU) ``torch.distributed`` job call
``KernelCache.warmup`` against a real ``kcache serve`` with an empty store, all ranks
sharing one node-local tier (one node). The leader resolves the union through
``/v1/resolve/batch``; compiles are counted from the batch outcomes the leader
broadcasts (``compiled``) and cross-checked against the server's ``/v1/stats``.

Anchor: the same 8 processes, each compiling all 24 recipes for itself with the core
engine over its own private data dir (what per-process caches such as Triton's do):
8 x 24 = 192 compiles.

Wall time is measured inside the ranks, from a barrier after ``init_process_group``
(so interpreter and torch start-up, identical for both, are excluded) to the last
rank's end. The kernels: 24 - B5_CUB light kernels and B5_CUB CCCL/cub kernels
(default 3; a cub kernel takes ~3 s of NVRTC on this machine, so 8 ranks x 3 cub is
already ~75 s of CPU for the anchor on 2 cores).

Goal: compiles == 24 (not 192); wall <= 0.25 x the anchor.

    python b5_warmup.py               # the benchmark
    python b5_warmup.py rank CFG RANK  # one rank (started by the benchmark)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _harness
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support
from _harness import emit, kcache_server

from tests.support import free_port

WORLD = int(os.environ.get("B5_WORLD", "8"))
KERNELS = 24
CUB = int(os.environ.get("B5_CUB", "3"))
TIMEOUT = 600.0

CUB_SOURCES = [
    """#include <cub/block/block_reduce.cuh>
extern "C" __global__ void block_sum_{tag}(const float* x, float* out) {{
  using Reduce = cub::BlockReduce<float, 128>;
  __shared__ typename Reduce::TempStorage tmp;
  float total = Reduce(tmp).Sum(x[blockIdx.x * 128 + threadIdx.x]);
  if (threadIdx.x == 0) out[blockIdx.x] = total;
}}
""",
    """#include <cub/block/block_scan.cuh>
extern "C" __global__ void block_scan_{tag}(const int* x, int* out) {{
  using Scan = cub::BlockScan<int, 256>;
  __shared__ typename Scan::TempStorage tmp;
  int v = x[blockIdx.x * 256 + threadIdx.x];
  Scan(tmp).InclusiveSum(v, v);
  out[blockIdx.x * 256 + threadIdx.x] = v;
}}
""",
    """#include <cub/block/block_reduce.cuh>
extern "C" __global__ void block_isum_{tag}(const int* x, int* out) {{
  using Reduce = cub::BlockReduce<int, 256, cub::BLOCK_REDUCE_WARP_REDUCTIONS>;
  __shared__ typename Reduce::TempStorage tmp;
  int total = Reduce(tmp).Sum(x[blockIdx.x * 256 + threadIdx.x]);
  if (threadIdx.x == 0) out[blockIdx.x] = total;
}}
""",
]


def recipes(tag: str) -> list[dict[str, Any]]:
    """24 distinct recipes nobody has compiled: light kernels plus ``CUB`` cub kernels."""
    out: list[dict[str, Any]] = []
    for i in range(min(CUB, len(CUB_SOURCES))):
        out.append(
            {
                "source": CUB_SOURCES[i].format(tag=tag),
                "target": "sm_90",
                "flags": ["-std=c++17"],
            }
        )
    for i in range(KERNELS - len(out)):
        src = (
            f'extern "C" __global__ void k_{tag}_{i}(float* x, int n) {{\n'
            "  int j = blockIdx.x * blockDim.x + threadIdx.x;\n"
            f"  if (j < n) x[j] = x[j] * {i + 2}.0f + {i}.5f;\n}}\n"
        )
        out.append({"source": src, "target": "sm_90"})
    return out


# ---------------------------------------------------------------------------- one rank
def rank_main(cfg_path: str, rank: int) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    from kcache import Recipe

    cfg = json.loads(Path(cfg_path).read_text())
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{cfg['port']}",
        rank=rank,
        world_size=cfg["world"],
        timeout=timedelta(seconds=TIMEOUT),
    )
    own = [Recipe.from_dict(d) for d in cfg["recipes"]]
    out: dict[str, Any] = {"rank": rank}
    if cfg["mode"] == "ours":
        from kcache_client import ClientSettings, KernelCache

        settings = ClientSettings.from_env(
            auto_target="sm_90", job_id="bench-b5", send_events=False
        )
        cache = KernelCache(cfg["url"], cache_dir=cfg["cache_dir"], settings=settings)
        dist.barrier()
        out["start"] = time.time()
        result = cache.warmup(own, timeout=TIMEOUT, progress=False)
        out["end"] = time.time()
        out["statuses"] = result.statuses
        out["keys"] = [a.recipe_key for a in result.artifacts]
        out["digests"] = [a.digest for a in result.artifacts]
        out["leader"] = result.leader
        cache.close()
    else:
        from kcache.local_engine import open_local_engine

        engine = open_local_engine(Path(cfg["cache_dir"]) / f"rank{rank}")
        dist.barrier()
        out["start"] = time.time()
        statuses, digests = [], []
        for recipe in own:
            resolution = engine.resolve(recipe)
            statuses.append(resolution.status)
            digests.append(resolution.artifact.digest)
        out["end"] = time.time()
        out["statuses"] = statuses
        out["digests"] = digests
    dist.barrier()
    Path(cfg["out"], f"{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


# ---------------------------------------------------------------------------- driver
def run_ranks(mode: str, tmp: Path, recipe_dicts: list[dict[str, Any]], url: str | None) -> dict:
    """Start WORLD rank processes in ``mode``; returns wall s (barrier to last end) and reports."""
    work = tmp / mode
    (work / "out").mkdir(parents=True)
    cfg = {
        "mode": mode,
        "world": WORLD,
        "port": free_port(),
        "url": url,
        "recipes": recipe_dicts,
        "cache_dir": str(work / "cache"),
        "out": str(work / "out"),
    }
    cfg_path = work / "config.json"
    cfg_path.write_text(json.dumps(cfg))
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "rank", str(cfg_path), str(rank)],
            stderr=subprocess.PIPE,
        )
        for rank in range(WORLD)
    ]
    deadline = time.monotonic() + TIMEOUT
    try:
        for proc in procs:
            proc.wait(max(1.0, deadline - time.monotonic()))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    reports = []
    for rank, proc in enumerate(procs):
        path = work / "out" / f"{rank}.json"
        err = proc.stderr.read().decode(errors="replace")[-2000:] if proc.stderr else ""
        if proc.stderr:
            proc.stderr.close()
        if not path.exists():
            raise RuntimeError(
                f"{mode} rank {rank} wrote no report (exit {proc.returncode}):\n{err}"
            )
        reports.append(json.loads(path.read_text()))
    wall = max(r["end"] for r in reports) - min(r["start"] for r in reports)
    return {"wall": wall, "reports": reports}


def main() -> None:
    tag = str(time.time_ns())
    recipe_dicts = recipes(tag)
    with tempfile.TemporaryDirectory(prefix="kcache-b5-") as tmp_name:
        tmp = Path(tmp_name)
        with kcache_server() as url:
            ours = run_ranks("ours", tmp, recipe_dicts, url)
            stats = httpx.get(url + "/v1/stats", params={"job_id": "bench-b5"}, timeout=30).json()
        anchor = run_ranks("anchor", tmp, recipe_dicts, None)
    leader = next(r for r in ours["reports"] if r.get("leader"))
    ours_compiles = sum(s == "compiled" for s in leader["statuses"])
    server_compiles = stats.get("totals", {}).get("compiled")
    anchor_compiles = sum(s == "compiled" for r in anchor["reports"] for s in r["statuses"])
    same_digests = all(r["digests"] == leader["digests"] for r in ours["reports"])
    agree = leader["digests"] == anchor["reports"][0]["digests"]
    common = {"ranks": WORLD, "kernels": KERNELS, "cub_kernels": min(CUB, len(CUB_SOURCES))}
    emit(
        "B5.warmup.compiles",
        ours_compiles,
        anchor_compiles,
        "compiles",
        goal="ours == 24",
        server_stats_compiled=server_compiles,
        met=ours_compiles == KERNELS and server_compiles in (None, KERNELS),
        **common,
    )
    emit(
        "B5.warmup.wall_s",
        ours["wall"],
        anchor["wall"],
        "s",
        goal="<= 0.25",
        met=ours["wall"] <= 0.25 * anchor["wall"],
        all_ranks_same_digests=same_digests,
        digests_match_anchor=agree,
        **common,
    )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "rank":
        rank_main(sys.argv[2], int(sys.argv[3]))
    else:
        main()
