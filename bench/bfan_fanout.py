"""Bfan: a job's kernels cross the network once (issue 48 item 1). N nodes, one pack, from "go".

N simulated nodes (``BFAN_NODES``, a comma list, default ``2,4,8``), each a node tier
directory of its own and one rank process (the node's leader; this machine has two
cores, so no further ranks per node), in one gloo ``torch.distributed`` job whose store
the benchmark hosts (as torchrun's agent does). Every rank warms up with the manifest of
K kernels (``BFAN_KERNELS``, default 128, each a cubin of about 54 KB: ``BFAN_UNROLL``)
that a warm ``kcache serve`` holds; its tier starts empty. The processes start, import,
join the job and build their cache first, then wait for a "go" line; the wall time runs
from "go" to the last rank's return with every kernel of the manifest in its node tier,
verified (digest and bytes).

Per round (``BFAN_ROUNDS``, default 3; medians reported), interleaved:

* ``fanout``: ``KernelCache.warmup([], manifest=M)`` over the job's group: one rank asks
  the server for the bundle, the node leaders receive it over a gloo group of their own
  (kcache_client._fanout).
* ``per_node`` (the anchor): what warmup did before: each rank ``prefetch(M)`` (one
  ``POST /v1/bundle`` per node), then ``warmup([])`` over the same group (the barrier).

Figures, per N:

* ``Bfan.origin_bytes``: the bytes the server sent during a round (counted by a TCP
  relay in front of it: every response byte, headers included), against one pack (the
  bundle answer's length, measured once). Goal: <= 1.1 x whatever N (per-node HTTP is
  N x; it is reported beside).
* ``Bfan.wall_ms``: ``fanout`` against ``per_node`` in the same run. Both ride the same
  loopback here: the server and the ranks share two cores, so the origin's egress, which
  is what the fan-out saves at fleet scale, is not the limit it is on a real network;
  the figure says what the fan-out costs where the origin is not the bottleneck.

    python bfan_fanout.py                   # the benchmark
    BFAN_NODES=2,4 BFAN_ROUNDS=5 python bfan_fanout.py
    python bfan_fanout.py rank CONFIG RANK  # one rank (started by the benchmark)
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _harness
from _harness import emit, kcache_server

NODES = [int(n) for n in os.environ.get("BFAN_NODES", "2,4,8").split(",") if n.strip()]
KERNELS = int(os.environ.get("BFAN_KERNELS", "128"))
UNROLL = int(os.environ.get("BFAN_UNROLL", "192"))
ROUNDS = int(os.environ.get("BFAN_ROUNDS", "3"))
WORK_DIR = os.environ.get("BFAN_DIR") or tempfile.gettempdir()
TARGET = "sm_90"
TIMEOUT = 300.0


def kernel_source(i: int) -> str:
    """The i-th distinct kernel, its loop unrolled into tens of KB of cubin."""
    return (
        f'extern "C" __global__ void bfan_{i}(float* x, int n) {{\n'
        "  float a = x[threadIdx.x];\n"
        f"  #pragma unroll\n  for (int k = 0; k < {UNROLL}; ++k) {{\n"
        f"    a = a * 1.0001f + {i}.5f + k;\n"
        "    x[(threadIdx.x * 7 + k) % n] = a;\n"
        "  }\n"
        "}\n"
    )


# ---------------------------------------------------------------------------- one rank
def rank_main(config_path: str, rank: int) -> None:
    """One rank: join the job, build the cache, say ready, wait for "go", warm up, report."""
    import torch.distributed as dist
    from kcache_client import ClientSettings, KernelCache

    from kcache.job_manifest import JobManifest

    cfg = json.loads(Path(config_path).read_text())
    wait = timedelta(seconds=TIMEOUT)
    store = dist.TCPStore("127.0.0.1", cfg["port"], cfg["world"], is_master=False, timeout=wait)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=cfg["world"], timeout=wait)
    manifest = JobManifest.load(cfg["manifest"])
    settings = ClientSettings.from_env(send_events=False, host=f"node{rank}")
    cache = KernelCache(cfg["url"], cache_dir=cfg["tiers"][rank], settings=settings)
    dist.barrier()
    print("ready", flush=True)
    sys.stdin.readline()
    start, cpu = time.monotonic(), time.process_time()
    if cfg["mode"] == "fanout":
        cache.warmup([], None, timeout=TIMEOUT, manifest=manifest, progress=False)
    else:
        cache.prefetch(manifest)
        cache.warmup([], None, timeout=TIMEOUT, progress=False)
    end, cpu = time.monotonic(), time.process_time() - cpu
    verified = True
    for kernel in manifest.kernels:
        found = cache.tier.lookup_signed(kernel.recipe_key)
        verified = verified and found is not None and found[0].digest == kernel.digest
        verified = verified and hashlib.sha256(found[1]).hexdigest() == kernel.digest  # type: ignore[index]
    stats = cache.stats
    print(
        json.dumps(
            {
                "start": start,
                "end": end,
                "cpu_ms": cpu * 1000.0,
                "verified": verified,
                "bundle_requests": stats.bundle_requests,
                "fanout_sent": stats.fanout_sent,
                "fanout_received": stats.fanout_received,
                "fanout_failures": stats.fanout_failures,
            }
        ),
        flush=True,
    )
    cache.close()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------- the relay
class Relay:
    """A TCP relay in front of the server that counts the bytes the server sends."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.removeprefix("http://").split(":")
        self._upstream = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._lock = threading.Lock()
        self.sent = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self._upstream)
            threading.Thread(target=self._pipe, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, True), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, counted: bool) -> None:
        with contextlib.suppress(OSError):
            while True:
                data = source.recv(1 << 20)
                if not data:
                    break
                sink.sendall(data)
                if counted:
                    with self._lock:
                        self.sent += len(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self._listener.close()


# ---------------------------------------------------------------------------- a round
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def job_store(port: int) -> Iterator[Any]:
    import torch.distributed as dist

    store = dist.TCPStore(
        "127.0.0.1",
        port,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=TIMEOUT),
    )
    try:
        yield store
    finally:
        del store


def one_round(
    relay: Relay, work: Path, manifest_path: Path, nodes: int, mode: str, tag: str
) -> dict[str, Any]:
    """``nodes`` rank processes on empty tiers, released together at "go": wall, bytes, reports."""
    port = free_port()
    cfg = {
        "world": nodes,
        "port": port,
        "url": relay.url,
        "manifest": str(manifest_path),
        "tiers": [str(work / f"tier-{tag}-{i}") for i in range(nodes)],
        "mode": mode,
    }
    config = work / f"config-{tag}.json"
    config.write_text(json.dumps(cfg))
    with job_store(port):
        procs = [
            subprocess.Popen(
                [sys.executable, __file__, "rank", str(config), str(rank)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            for rank in range(nodes)
        ]
        for proc in procs:
            assert proc.stdout is not None
            if proc.stdout.readline().strip() != "ready":
                raise RuntimeError("a rank did not start")
        before = relay.sent
        go = time.monotonic()
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        reports = []
        for proc in procs:
            assert proc.stdout is not None and proc.stdin is not None
            out = proc.stdout.read()
            proc.stdin.close()
            if proc.wait(timeout=TIMEOUT) != 0:
                raise RuntimeError(f"a rank exited {proc.returncode}")
            reports.append(json.loads(out.strip().splitlines()[-1]))
        sent = relay.sent - before
    if not all(r["verified"] for r in reports):
        raise RuntimeError("a rank's tier does not hold the manifest's bytes")
    return {
        "wall_ms": (max(r["end"] for r in reports) - go) * 1000.0,
        "origin_bytes": sent,
        "cpu_ms": sum(r["cpu_ms"] for r in reports),
        "requests": sum(r["bundle_requests"] for r in reports),
        "received": sum(r["fanout_received"] for r in reports),
        "failures": sum(r["fanout_failures"] for r in reports),
    }


def main() -> None:
    from kcache_client import ClientSettings, KernelCache

    from kcache import Recipe

    with (
        tempfile.TemporaryDirectory(prefix="kcache-bfan-", dir=WORK_DIR) as tmp_name,
        kcache_server() as url,
    ):
        work = Path(tmp_name)
        toolchain = httpx.get(f"{url}/v1/toolchains", timeout=10).json()["default"]
        recipes = [
            Recipe(source=kernel_source(i), target=TARGET, toolchain=toolchain)
            for i in range(KERNELS)
        ]
        quiet = ClientSettings.from_env(send_events=False)
        with KernelCache(url, cache_dir=work / "seed", settings=quiet) as seed:
            seed.warmup(recipes, progress=False)
            manifest = seed.manifest("bfan")
        manifest_path = manifest.save(work / "manifest.json")
        # One pack: the bundle answer's body, as a rank is sent it (warms the server too).
        body = {"recipe_keys": manifest.recipe_keys, "context": {}}
        pack = len(httpx.post(f"{url}/v1/bundle", json=body, timeout=60).content)
        relay = Relay(url)
        try:
            for nodes in NODES:
                rounds: dict[str, list[dict[str, Any]]] = {"fanout": [], "per_node": []}
                for n in range(ROUNDS):
                    for mode in ("fanout", "per_node") if n % 2 == 0 else ("per_node", "fanout"):
                        rounds[mode].append(
                            one_round(
                                relay, work, manifest_path, nodes, mode, f"{nodes}-{n}-{mode}"
                            )
                        )

                def med(mode: str, field: str, rounds: dict[str, Any] = rounds) -> float:
                    return float(statistics.median(r[field] for r in rounds[mode]))

                emit(
                    "Bfan.origin_bytes",
                    med("fanout", "origin_bytes"),
                    float(pack),
                    "bytes",
                    nodes=nodes,
                    kernels=len(manifest),
                    per_node_bytes=med("per_node", "origin_bytes"),
                    per_node_ratio=round(med("per_node", "origin_bytes") / pack, 3),
                    rounds=[r["origin_bytes"] for r in rounds["fanout"]],
                )
                emit(
                    "Bfan.wall_ms",
                    med("fanout", "wall_ms"),
                    med("per_node", "wall_ms"),
                    "ms",
                    nodes=nodes,
                    pack_bytes=pack,
                    rounds=[round(r["wall_ms"], 1) for r in rounds["fanout"]],
                    anchor_rounds=[round(r["wall_ms"], 1) for r in rounds["per_node"]],
                    bundle_requests=[r["requests"] for r in rounds["fanout"]],
                    anchor_requests=[r["requests"] for r in rounds["per_node"]],
                    received=[r["received"] for r in rounds["fanout"]],
                    failures=[r["failures"] for r in rounds["fanout"]],
                    cpu_ms=round(med("fanout", "cpu_ms"), 1),
                    anchor_cpu_ms=round(med("per_node", "cpu_ms"), 1),
                )
        finally:
            relay.close()


if __name__ == "__main__":
    if sys.argv[1:2] == ["rank"]:
        rank_main(sys.argv[2], int(sys.argv[3]))
    else:
        main()
