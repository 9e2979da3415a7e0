"""B12: a job's cold start on a warm server. N nodes x R ranks x K kernels, from "go".

A job restarts on nodes whose tiers are empty, with the manifest of its previous run.
N simulated nodes (``B12_NODES``, default 2), each its own node tier, each R real rank
processes (``B12_RANKS``, default 8, started as B8 starts them: import, build the cache,
say ready, wait for "go"); every rank must hold every one of K real cubins (``B12_KERNELS``,
a comma list, default ``24,800``, the issue's sizes), verified. The
wall time runs from "go" to the last rank holding the last kernel.

Per round (``B12_ROUNDS``, default 3; the median is reported), interleaved:

* ``manifest``: each rank calls ``KernelCache.prefetch(manifest)``, then ``get`` on every
  kernel. Goal: 1 request per node on the wire (the node's ranks share the manifest's
  lock; the one holding it makes the only ``POST /v1/bundle``, whose answer also stands for
  the withdrawals read: ``X-KCache-Withdrawals-Through``).
* ``complete``: the same, on the tiers the round above filled (fresh processes). Goal: 0
  requests (the completeness marker). What it makes is one per node: the read of the
  server's withdrawals that a tier answer rests on (docs/design.md, "What a binding rests
  on"), since no answer of the server comes first to stand for it; the goal predates
  withdrawals.
* ``per_kernel``: today's path, each rank ``get`` on every kernel on an empty tier (B8).
* anchor: one curl per node fetching one tar of the same cubins from nginx (1 worker), into
  that node's directory. Goal: ``manifest`` <= 1.2 x. Also reported against it: the
  ``manifest`` side's *node ready* time, from "go" until the node's tier holds the
  manifest (the prefetching rank's return), which is what the curl does.
* floor: the same rank processes, each reading its node's tar of the cubins (on disk
  already) and hashing every member: what any client's ranks pay at least to hold every
  kernel, verified, once the bytes are on the node.

Requests are the server's own count (``/metrics``, every route but ``/metrics``). Bytes
served: the length of the answers those requests get (a bundle stream; an artifact per
kernel), measured once after the rounds by asking the same again, against the tar's size.

    python b12_job_cold_start.py                 # the benchmark
    B12_NODES=1 B12_RANKS=2 python b12_job_cold_start.py  # one rank per core of this machine
    python b12_job_cold_start.py rank CONFIG     # one rank (started by the benchmark)
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import statistics
import sys
import tarfile
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _harness, b1_fetch, b8
from _harness import curls_wall_ms, emit, kcache_server
from b1_fetch import nginx_serving
from b8_rank_fetch import report, run_ranks

NODES = int(os.environ.get("B12_NODES", "2"))
RANKS = int(os.environ.get("B12_RANKS", "8"))
KERNELS = [int(k) for k in os.environ.get("B12_KERNELS", "24,800").split(",") if k.strip()]
ROUNDS = int(os.environ.get("B12_ROUNDS", "3"))
#: ``B12_PER_KERNEL=0`` leaves the per-kernel path out (16 x K requests a round: minutes at K = 800).
PER_KERNEL = os.environ.get("B12_PER_KERNEL", "1") != "0"
WORK_DIR = os.environ.get("B12_DIR") or tempfile.gettempdir()
TARGET = "sm_90"


def kernel_source(i: int) -> str:
    """The i-th distinct small kernel (a few KB of cubin)."""
    return (
        f'extern "C" __global__ void b12_{i}(const float* x, float* y, int n) {{\n'
        "  int j = blockIdx.x * blockDim.x + threadIdx.x;\n"
        f"  if (j < n) y[j] = {i + 2}.0f * x[j] + {i}.25f;\n"
        "}\n"
    )


# ---------------------------------------------------------------------------- one rank
def rank_main(config_path: str) -> None:
    """One rank: build the cache, say ready, wait for "go", hold every kernel, report."""
    # The job façade (prefetch, warmup), which the cache imports when a job step is first
    # called: imported here, with the rest, before "ready" (no import is inside the clock).
    import kcache_client._jobs  # noqa: F401
    from kcache_client import ClientSettings, KernelCache

    from kcache import Recipe
    from kcache.job_manifest import JobManifest

    cfg = json.loads(Path(config_path).read_text())
    if cfg.get("tar"):
        floor_rank(cfg["tar"])
        return
    recipes = [Recipe.from_dict(d) for d in cfg["recipes"]]
    manifest = JobManifest.load(cfg["manifest"]) if cfg["manifest"] else None
    settings = ClientSettings.from_env(send_events=False)
    cache = KernelCache(cfg["url"], cache_dir=cfg["tier"], settings=settings)
    print("ready", flush=True)
    sys.stdin.readline()
    start, cpu = time.monotonic(), time.process_time()
    if manifest is not None:
        cache.prefetch(manifest)
    prefetched = time.monotonic()
    artifacts = [cache.get(r) for r in recipes]
    end, cpu = time.monotonic(), time.process_time() - cpu
    verified = all(hashlib.sha256(a.data).hexdigest() == a.digest for a in artifacts)
    report(
        {
            "start": start,
            "prefetched": prefetched,
            "end": end,
            "cpu_ms": cpu * 1000.0,
            "origins": Counter(a.origin for a in artifacts),
            "digests": [a.digest for a in artifacts],
            "verified": verified,
            "bundle_requests": cache.stats.bundle_requests,
        }
    )
    cache.close()


def floor_rank(tar_path: str) -> None:
    """A floor rank: say ready, wait for "go", read the node's tar and hash every member."""
    print("ready", flush=True)
    sys.stdin.readline()
    start, cpu = time.monotonic(), time.process_time()
    with tarfile.open(tar_path) as tar:
        digests = []
        for member in tar:
            handle = tar.extractfile(member)
            assert handle is not None
            digests.append(hashlib.sha256(handle.read()).hexdigest())
    end, cpu = time.monotonic(), time.process_time() - cpu
    report({"start": start, "end": end, "cpu_ms": cpu * 1000.0, "digests": digests})


# ---------------------------------------------------------------------------- the benchmark
def job(url: str, work: Path, cfg: dict[str, Any], tiers: list[Path]) -> dict[str, Any]:
    """One cold start: RANKS processes on each tier; wall ms from "go", server requests, and
    (with a manifest) when the last node's tier was ready (its first rank back from prefetch)."""
    configs = []
    for n, tier in enumerate(tiers):
        config = work / f"{tier.name}-{n}.json"
        config.write_text(json.dumps({**cfg, "url": url, "tier": str(tier)}))
        configs += [config] * RANKS
    ran = run_ranks(__file__, configs, url, timeout=600)
    nodes = [ran["reports"][n * RANKS : (n + 1) * RANKS] for n in range(len(tiers))]
    ran["node_ready_ms"] = (
        max(min(r["prefetched"] for r in node) for node in nodes) - ran["go"]
    ) * 1000.0
    return ran


def floor(url: str, work: Path, tar_path: Path) -> dict[str, Any]:
    """RANKS processes per node reading the tar of the kernels and hashing each: wall ms, and
    the CPU of all of them (``cpu_ms``)."""
    config = work / "floor.json"
    config.write_text(json.dumps({"tar": str(tar_path)}))
    return run_ranks(__file__, [config] * (RANKS * NODES), url, timeout=600)


def served_bytes(url: str, keys: list[str]) -> tuple[int, int]:
    """The bytes of one bundle answer for ``keys``, and of one artifact answer per key."""
    with httpx.Client(base_url=url, timeout=60) as client:
        bundle = client.post("/v1/bundle", json={"recipe_keys": keys})
        bundle.raise_for_status()
        per_key = 0
        for key in keys:
            answer = client.get(f"/v1/recipes/{key}/artifact")
            answer.raise_for_status()
            per_key += len(answer.content)
    return len(bundle.content), per_key


def tar_of(artifacts: list[Any]) -> bytes:
    """The cubins as one uncompressed tar (what an image or a blob store would ship)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for i, art in enumerate(artifacts):
            info = tarfile.TarInfo(f"k{i:04d}.cubin")
            info.size = len(art.data)
            tar.addfile(info, io.BytesIO(art.data))
    return buffer.getvalue()


def one_size(
    url: str, work: Path, k: int, seeded: list[Any], recipes: list[Any], everything: Any
) -> None:
    """Every round for K = ``k`` kernels (the first K of ``everything``'s); emits the figures."""
    from kcache.job_manifest import JobManifest

    arts, wanted = seeded[:k], recipes[:k]
    keys = [a.recipe_key for a in arts]
    chosen = set(keys)
    manifest = JobManifest.of(
        [kern for kern in everything.kernels if kern.recipe_key in chosen], "b12"
    )
    manifest_path = work / f"manifest-{k}.json"
    manifest.save(manifest_path)
    payload = [r.to_dict() for r in wanted]
    files = work / f"files-{k}"
    files.mkdir()
    tar = tar_of(arts)
    (files / "k.tar").write_bytes(tar)
    (files / "blob").write_bytes(arts[0].data)  # what nginx_serving probes
    expected = [a.digest for a in arts]
    with_manifest = {"recipes": payload, "manifest": str(manifest_path)}
    per_kernel = {"recipes": payload, "manifest": None}
    rounds: dict[str, list[dict[str, Any]]] = {"manifest": [], "complete": [], "per_kernel": []}
    anchor: list[float] = []
    floors: list[float] = []
    floors_cpu: list[float] = []
    with nginx_serving(files) as blob_url:
        tar_url = blob_url.rsplit("/", 1)[0] + "/k.tar"
        for n in range(ROUNDS):
            tiers = [work / f"tier-{k}-{n}-node{i}" for i in range(NODES)]
            rounds["manifest"].append(job(url, work, with_manifest, tiers))
            anchor.append(curls_wall_ms(work, [[tar_url]] * NODES))  # one per node
            rounds["complete"].append(job(url, work, with_manifest, tiers))
            fresh = [work / f"pk-{k}-{n}-node{i}" for i in range(NODES)]
            if PER_KERNEL:
                rounds["per_kernel"].append(job(url, work, per_kernel, fresh))
            floored = floor(url, work, files / "k.tar")
            floors.append(floored["wall_ms"])
            floors_cpu.append(floored["cpu_ms"])
            for tier in tiers + fresh:
                shutil.rmtree(tier, ignore_errors=True)
    for mode in rounds.values():
        for r in mode:
            for rank_report in r["reports"]:
                if rank_report["digests"] != expected or not rank_report["verified"]:
                    raise RuntimeError("a rank got other bytes than the server's")
    bundle_bytes, per_key_bytes = served_bytes(url, keys)

    def med(mode: str, field: str) -> float:
        return float(statistics.median(r[field] for r in rounds[mode]))

    requests = {m: [r["server"] for r in rs] for m, rs in rounds.items()}
    origins: Counter[str] = Counter()
    for rank_report in rounds["manifest"][-1]["reports"]:
        origins.update(rank_report["origins"])
    common = {"nodes": NODES, "ranks_per_node": RANKS, "kernels": k, "rounds": ROUNDS}
    emit(
        f"B12.job_cold_start.k{k}.requests_per_node",
        med("manifest", "server") / NODES,
        1.0,
        "requests",
        goal="1 per node with a manifest, 0 with a complete tier",
        met=max(requests["manifest"]) == NODES and max(requests["complete"]) == 0,
        manifest_per_round=requests["manifest"],
        complete_tier_per_round=requests["complete"],
        per_kernel_path_per_round=requests["per_kernel"],
        origins_last_round=dict(origins),
        **common,
    )
    emit(
        f"B12.job_cold_start.k{k}.bytes_served",
        float(bundle_bytes * NODES),
        float(len(tar) * NODES),
        "bytes",
        goal="about the tar's bytes (one bundle per node)",
        bundle_bytes=bundle_bytes,
        per_kernel_path_bytes=per_key_bytes * NODES,
        tar_bytes=len(tar),
        **common,
    )
    ours = med("manifest", "wall_ms")
    emit(
        f"B12.job_cold_start.k{k}.wall_ms",
        ours,
        statistics.median(anchor),
        "ms",
        goal="<= 1.2 x (one curl per node fetching a tar of the same bytes from nginx)",
        met=ours <= 1.2 * statistics.median(anchor),
        ours_per_round=[round(r["wall_ms"], 1) for r in rounds["manifest"]],
        anchor_per_round=[round(a, 1) for a in anchor],
        complete_tier_ms=round(med("complete", "wall_ms"), 1),
        ranks_cpu_ms=round(med("manifest", "cpu_ms"), 1),
        floor_ms=round(statistics.median(floors), 1),
        floor_per_round=[round(f, 1) for f in floors],
        **common,
    )
    complete = med("complete", "wall_ms")
    emit(
        f"B12.job_cold_start.k{k}.complete_tier_vs_floor",
        complete,
        statistics.median(floors),
        "ms",
        goal="<= 1.5 x (every rank holding every kernel from a complete tier, against ranks "
        "that only read and hash a tar already on the node)",
        met=complete <= 1.5 * statistics.median(floors),
        complete_per_round=[round(r["wall_ms"], 1) for r in rounds["complete"]],
        floor_per_round=[round(f, 1) for f in floors],
        # The CPU of all ranks together: what the wall time is made of on a loaded machine.
        complete_cpu_ms=round(med("complete", "cpu_ms"), 1),
        floor_cpu_ms=round(statistics.median(floors_cpu), 1),
        cpu_ratio=round(med("complete", "cpu_ms") / statistics.median(floors_cpu), 3),
        **common,
    )
    ready = med("manifest", "node_ready_ms")
    emit(
        f"B12.job_cold_start.k{k}.node_ready_ms",
        ready,
        statistics.median(anchor),
        "ms",
        goal="(not the issue's goal, which is the whole job above) the node's tier holding the "
        "manifest, against the curl that puts the tar on the node",
        met=ready <= 1.2 * statistics.median(anchor),
        ours_per_round=[round(r["node_ready_ms"], 1) for r in rounds["manifest"]],
        **common,
    )
    emit(
        f"B12.job_cold_start.k{k}.vs_floor",
        ours,
        statistics.median(floors),
        "ms",
        goal="(a reference, not a goal) every rank holding every kernel against ranks that "
        "only read and hash a tar already on the node",
        **common,
    )
    if not PER_KERNEL:
        return
    emit(
        f"B12.job_cold_start.k{k}.vs_per_kernel_path",
        ours,
        med("per_kernel", "wall_ms"),
        "ms",
        goal="< 1 (a manifest beats a get per kernel)",
        met=ours < med("per_kernel", "wall_ms"),
        per_kernel_per_round=[round(r["wall_ms"], 1) for r in rounds["per_kernel"]],
        per_kernel_cpu_ms=round(med("per_kernel", "cpu_ms"), 1),
        **common,
    )


def main() -> None:
    from kcache_client import ClientSettings, KernelCache

    from kcache import Recipe

    if shutil.which("nginx") is None or shutil.which("curl") is None:
        emit("B12.job_cold_start.wall_ms", 0.0, None, "ms", skipped="needs nginx and curl")
        return
    with (
        tempfile.TemporaryDirectory(prefix="kcache-b12-", dir=WORK_DIR) as tmp_name,
        kcache_server() as url,
    ):
        work = Path(tmp_name)
        toolchain = httpx.get(f"{url}/v1/toolchains", timeout=10).json()["default"]
        recipes = [
            Recipe(source=kernel_source(i), target=TARGET, toolchain=toolchain)
            for i in range(max(KERNELS))
        ]
        # Compiled on the server beforehand, through another node's tier; then warm:
        # the fast path's memory caches hold every kernel.
        quiet = ClientSettings.from_env(send_events=False)
        with KernelCache(url, cache_dir=work / "seed", settings=quiet) as seed:
            seed.warmup(recipes, progress=False)
            seeded = [seed.get(r) for r in recipes]
            everything = seed.manifest("b12")
        for art in seeded:
            httpx.get(f"{url}/v1/recipes/{art.recipe_key}/artifact", timeout=10).raise_for_status()
        for k in KERNELS:
            one_size(url, work, k, seeded, recipes, everything)


if __name__ == "__main__":
    if sys.argv[1:2] == ["rank"]:
        rank_main(sys.argv[2])
    else:
        main()
