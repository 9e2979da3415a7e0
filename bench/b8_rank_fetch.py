"""B8: what a rank does. N processes of one node, one empty node tier, ``get()`` 24 kernels.

Ours: N (``B8_RANKS``, default 8) real processes share one empty node-local tier and
each call ``KernelCache.get`` on the same 24 kernels, which a warm ``kcache serve`` holds
(compiled beforehand, its memory caches filled by one fetch each). The processes start,
import and build their cache first, then wait for a "go" line; the wall time runs from
"go" to the last rank holding all 24 verified artifacts. The ranks stay up until every rank
has reported, as a job's ranks go on to their work (:func:`report`).

Figures (median of ``B8_ROUNDS`` rounds, default 5, ours and the anchor interleaved):

* ``B8.rank_fetch.requests``: HTTP requests that reached the server during a round,
  from its ``/metrics`` (every route but ``/metrics``), against the goal of 24 for the
  node: one request per kernel (``GET /v1/recipes/{key}/artifact`` carries the bytes
  and the metadata), made once per node (the tier's per-key lock makes the other ranks
  wait and read the tier), not 24 x N and not 48. The ranks' own counts
  (``KernelCache.requests``) and where their artifacts came from are reported too.
* ``B8.rank_fetch.wall_ms``: against N curl processes each fetching the same 24 files
  from nginx (1 worker, files on disk) over one connection, started beforehand and
  released at "go" the same way (curl reads its URL list from stdin). Beside it: one
  rank alone on an empty tier (what the node's one fetch of each kernel costs, publishing
  included) and one curl fetching the 24 files once. Goal <= 1.5 x. Also the CPU the
  ranks spent in their gets (process time, all ranks together, and one rank alone):
  on a small shared machine the wall time swings with other work, the CPU much less.

Where the files go matters on this machine: everything (the tiers, curl's files) is
written under ``B8_DIR``, by default the system's temp directory. Creating a file or a
directory there cost anywhere from 12 us to 0.7 ms of CPU on the benchmark machine's
ext4, from one hour to the next, and both sides create files (curl 192 a round, the
tier about 4 per kernel), so the figure reports that cost as measured in the same
directory just before the rounds (``file_create_us``); ``B8_DIR=/dev/shm`` (a tmpfs)
leaves the filesystem out.

    python b8_rank_fetch.py                 # the benchmark
    B8_DIR=/dev/shm python b8_rank_fetch.py # the same on a tmpfs
    B8_PROFILE=DIR python b8_rank_fetch.py  # each rank's gets profiled into DIR/rank-PID.prof
    python b8_rank_fetch.py rank CONFIG     # one rank (started by the benchmark)
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _harness, b1_fetch
from _harness import curls_wall_ms, emit, kcache_server
from b1_fetch import nginx_serving

RANKS = int(os.environ.get("B8_RANKS", "8"))
WORK_DIR = os.environ.get("B8_DIR") or tempfile.gettempdir()
ROUNDS = int(os.environ.get("B8_ROUNDS", "5"))
KERNELS = 24
TARGET = "sm_90"


def kernel_source(i: int) -> str:
    """The i-th of 24 distinct small kernels (a few KB of cubin each)."""
    return (
        f'extern "C" __global__ void axpb_{i}(const float* x, float* y, int n) {{\n'
        "  int j = blockIdx.x * blockDim.x + threadIdx.x;\n"
        f"  if (j < n) y[j] = {i + 2}.0f * x[j] + {i}.5f;\n"
        "}\n"
    )


# ---------------------------------------------------------------------------- one rank
def rank_main(config_path: str) -> None:
    """One rank: build the cache, say ready, wait for "go", get the 24 kernels, report."""
    from kcache_client import ClientSettings, KernelCache

    from kcache import Recipe

    cfg = json.loads(Path(config_path).read_text())
    recipes = [Recipe.from_dict(d) for d in cfg["recipes"]]
    settings = ClientSettings.from_env(send_events=False)
    cache = KernelCache(cfg["url"], cache_dir=cfg["tier"], settings=settings)
    print("ready", flush=True)
    sys.stdin.readline()
    profile = _profiler()
    start, cpu = time.monotonic(), time.process_time()
    artifacts = [cache.get(r) for r in recipes]
    end, cpu = time.monotonic(), time.process_time() - cpu
    if profile is not None:
        profile.disable()
        profile.dump_stats(Path(os.environ["B8_PROFILE"]) / f"rank-{os.getpid()}.prof")
    verified = all(hashlib.sha256(a.data).hexdigest() == a.digest for a in artifacts)
    report(
        {
            "start": start,
            "end": end,
            "cpu_ms": cpu * 1000.0,
            "requests": cache.requests,
            "origins": Counter(a.origin for a in artifacts),
            "digests": [a.digest for a in artifacts],
            "verified": verified,
        }
    )
    cache.close()


def report(payload: dict[str, Any]) -> None:
    """A rank's report (its last line of output); then the rank stays up until the benchmark
    has every rank's (its stdin closed), as a job's ranks go on to their work.

    A rank that exited at once spent its interpreter's teardown (about 25 ms of CPU in a
    process that imported kcache, on the benchmark machine) on the cores that the ranks
    still getting their kernels needed: a cost of the harness, not of getting kernels
    (B8 and B12 run their ranks this way; bench/RESULTS.md, ninth session).
    """
    print(json.dumps(payload), flush=True)
    sys.stdin.read()


def _profiler() -> Any:
    """A running cProfile when ``B8_PROFILE`` names a directory (each rank writes its
    ``rank-PID.prof`` there: where the ranks' CPU goes), else None."""
    if not os.environ.get("B8_PROFILE"):
        return None
    import cProfile

    profile = cProfile.Profile()
    profile.enable()
    return profile


# ---------------------------------------------------------------------------- the benchmark
def server_requests(url: str) -> int:
    """Requests the server has answered so far, every route but ``/metrics`` itself."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name == "kcache_http_requests_total" and sample.labels["route"] != "/metrics":
                total += sample.value
    return int(total)


def run_ranks(script: str, configs: list[Path], url: str, timeout: float) -> dict[str, Any]:
    """One ``script rank CONFIG`` process per config, released together at "go".

    Each is started and waited for until it says "ready" (imports done, cache built), so
    the wall time runs from "go" to the last rank's end; also the ranks' CPU, the server's
    requests meanwhile and each rank's report (its line of JSON, :func:`report`: the ranks
    exit only once every rank has reported). B12 runs its ranks the same way.
    """
    procs = [
        subprocess.Popen(
            [sys.executable, script, "rank", str(config)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for config in configs
    ]
    for proc in procs:
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError("a rank did not start")
    before = server_requests(url)
    go = time.monotonic()
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
    reports = []
    for proc in procs:  # each rank's report, while every rank is still up (report())
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"a rank exited {proc.wait(timeout=timeout)} without a report")
        reports.append(json.loads(line))
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.close()
        if proc.wait(timeout=timeout) != 0:
            raise RuntimeError(f"a rank exited {proc.returncode}")
    return {
        "go": go,
        "wall_ms": (max(r["end"] for r in reports) - go) * 1000.0,
        "cpu_ms": sum(r["cpu_ms"] for r in reports),
        "server": server_requests(url) - before,
        "reports": reports,
    }


def ours(
    url: str, work: Path, recipes: list[dict[str, Any]], ranks: int, tag: str
) -> dict[str, Any]:
    """One round of ``ranks`` ranks on an empty tier: wall ms, server-side requests, their reports."""
    config = work / f"ours-{tag}.json"
    config.write_text(
        json.dumps({"url": url, "tier": str(work / f"tier-{tag}"), "recipes": recipes})
    )
    return run_ranks(__file__, [config] * ranks, url, timeout=300)


def file_create_us(directory: Path, files: int = 100) -> float:
    """CPU per file created in ``directory`` (created, written, closed), in microseconds."""
    scratch = directory / "create-probe"
    scratch.mkdir()
    started = time.process_time()
    for i in range(files):
        (scratch / f"f{i}").write_bytes(b"x" * 4096)
    spent = time.process_time() - started
    shutil.rmtree(scratch)
    return spent / files * 1e6


def main() -> None:
    from kcache_client import ClientSettings, KernelCache

    from kcache import Recipe

    if shutil.which("nginx") is None or shutil.which("curl") is None:
        emit("B8.rank_fetch.wall_ms", 0.0, None, "ms", skipped="needs nginx and curl")
        return
    with (
        tempfile.TemporaryDirectory(prefix="kcache-b8-", dir=WORK_DIR) as tmp_name,
        kcache_server() as url,
    ):
        work = Path(tmp_name)
        toolchain = httpx.get(f"{url}/v1/toolchains", timeout=10).json()["default"]
        recipes = [
            Recipe(source=kernel_source(i), target=TARGET, toolchain=toolchain)
            for i in range(KERNELS)
        ]
        # Compiled on the server beforehand, through another node's tier.
        quiet = ClientSettings.from_env(send_events=False)
        with KernelCache(url, cache_dir=work / "seed", settings=quiet) as seed:
            seed.warmup(recipes, progress=False)
            artifacts = [seed.get(r) for r in recipes]
        files = work / "files"  # nginx_serving opens its parent (the temp dir) to nginx
        files.mkdir(parents=True)
        for i, art in enumerate(artifacts):
            (files / f"k{i:02d}.cubin").write_bytes(art.data)
        (files / "blob").write_bytes(artifacts[0].data)  # what nginx_serving probes
        keys = [r.key() for r in recipes]
        for key in keys:  # warm: the fast path's memory caches hold every kernel
            httpx.get(f"{url}/v1/recipes/{key}/artifact", timeout=10).raise_for_status()
        expected = [a.digest for a in artifacts]
        payload = [r.to_dict() for r in recipes]
        with nginx_serving(files) as blob_url:
            base = blob_url.rsplit("/", 1)[0]
            urls = [f"{base}/k{i:02d}.cubin" for i in range(KERNELS)]
            create_us = file_create_us(work)
            rounds, anchor, alone, single = [], [], [], []
            for n in range(ROUNDS):
                rounds.append(ours(url, work, payload, RANKS, f"{n}-all"))
                anchor.append(curls_wall_ms(work, [urls] * RANKS))
                alone.append(ours(url, work, payload, 1, f"{n}-one"))
                single.append(curls_wall_ms(work, [urls]))
    for r in rounds:
        for rank_report in r["reports"]:
            if rank_report["digests"] != expected or not rank_report["verified"]:
                raise RuntimeError("a rank got other bytes than the server's")
    server = [r["server"] for r in rounds]
    clients = [sum(rep["requests"] for rep in r["reports"]) for r in rounds]
    origins: Counter[str] = Counter()
    for rank_report in rounds[-1]["reports"]:
        origins.update(rank_report["origins"])
    emit(
        "B8.rank_fetch.requests",
        float(statistics.median(server)),
        float(KERNELS),
        "requests",
        goal="== 24 per node (not 24 x N, not 48)",
        met=max(server) == KERNELS,
        ranks=RANKS,
        server_per_round=server,
        client_counted_per_round=clients,
        origins_last_round=dict(origins),
        without_a_shared_tier=KERNELS * RANKS,
    )
    emit(
        "B8.rank_fetch.wall_ms",
        statistics.median(r["wall_ms"] for r in rounds),
        statistics.median(anchor),
        "ms",
        goal="<= 1.5 x (N curl processes, 24 files each, from nginx)",
        met=statistics.median(r["wall_ms"] for r in rounds) <= 1.5 * statistics.median(anchor),
        ranks=RANKS,
        rounds=ROUNDS,
        ours_per_round=[round(r["wall_ms"], 1) for r in rounds],
        anchor_per_round=[round(a, 1) for a in anchor],
        one_rank_alone_ms=round(statistics.median(a["wall_ms"] for a in alone), 1),
        one_curl_24_files_ms=round(statistics.median(single), 1),
        ranks_cpu_ms=round(statistics.median(r["cpu_ms"] for r in rounds), 1),
        work_dir=WORK_DIR,
        file_create_us=round(create_us, 1),
        one_rank_cpu_ms=round(statistics.median(a["cpu_ms"] for a in alone), 1),
    )


if __name__ == "__main__":
    if sys.argv[1:2] == ["rank"]:
        rank_main(sys.argv[2])
    else:
        main()
