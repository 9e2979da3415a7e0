"""B1n: fetch by key through the deploy's nginx to one replica, warm, 32 connections, 5 s.

Ours: ``GET /v1/recipes/{key}/artifact`` sent to nginx running
``deploy/nginx/kcache.conf.template`` as it is, in front of one ``kcache serve`` with
``KCACHE_ACCEL_REDIRECT`` and ``KCACHE_EDGE_LOG``: nginx answers a fetch it answered in
the last 2 s for the same token from its cache (a tmpfs-like temp dir here), logging each
to the edge log, which the replica follows and audits (its cost is in the figure); the
rest go to the replica. One token, as a job's ranks share one. Anchor, in the same run:
nginx (1 worker, as the deploy's) serving the same file directly (B1's anchor). Goal:
>= 0.9 x. ``edge_log_lines``: the B1n fetches nginx answered from its cache (each
audited by the replica from the log). ``server_cpu_us_per_fetch``: the CPU time the
serving processes (nginx's and the replica's, for B1n) spent per fetch, a figure a busy
neighbour on the machine moves less than requests per second; ``replica_cpu_us_per_fetch``
the replica's share (reading the edge log, auditing, the entries' refills);
``anchor_cpu_us_per_fetch`` nginx's own serving the file.

Also, interleaved in the same rounds, B1 without nginx two ways (issue 46 item 2): ``kcache
serve`` alone (stock uvicorn, httptools, with the ASGI fast paths in front of the app: B1's
goal, >= 0.25 x nginx), and the same app with no fast path, every fetch routed by FastAPI
(``routed``): what the fast paths buy. All servers share one data directory; rounds
alternate (``BENCH_ROUNDS``, 3), each figure is the median round.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _harness, b1_fetch
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support
from _harness import KCACHE, emit, kcache_server, tree_cpu_s, wrk
from b1_fetch import median_round, nginx_serving

from tests.support import VECTOR_ADD, ServerProcess, answers_200, free_port, wait_until

SECONDS = int(os.environ.get("BENCH_SECONDS", "5"))
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "3"))
TEMPLATE = Path(__file__).resolve().parents[1] / "deploy" / "nginx" / "kcache.conf.template"


@contextlib.contextmanager
def deploy_nginx(root: Path, replica: str, blobs: Path, edge_log: Path) -> Iterator[str]:
    """nginx with 1 worker running the deploy's file in front of ``replica``; its URL."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "cache").mkdir(mode=0o700)
    port = free_port()
    conf = TEMPLATE.read_text()
    values = {
        "KCACHE_LISTEN": f"127.0.0.1:{port}",
        "KCACHE_REPLICA": replica,
        "KCACHE_BLOBS": str(blobs),
        "KCACHE_EDGE_CACHE": str(root / "cache"),
        "KCACHE_EDGE_LOG": str(edge_log),
    }
    for name, value in values.items():
        conf = conf.replace("${" + name + "}", value)
    assert "${" not in conf, "a template name the bench does not set"
    (root / "kcache.conf").write_text(conf)
    user = "user root;" if os.geteuid() == 0 else ""
    temps = " ".join(
        f"{k}_temp_path {root};" for k in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    (root / "nginx.conf").write_text(
        f"{user} daemon off; worker_processes 1; pid {root}/nginx.pid; error_log {root}/error.log;\n"
        f"events {{ worker_connections 1024; }}\n"
        f"http {{ access_log off; {temps} include {root}/kcache.conf; }}\n"
    )
    argv = ["nginx", "-p", str(root), "-e", str(root / "error.log"), "-c", str(root / "nginx.conf")]
    proc = subprocess.Popen(argv)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: answers_200(url + "/healthz"), "the deploy's nginx", timeout=15)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@contextlib.contextmanager
def routed_uvicorn(data_dir: Path, workers: int) -> Iterator[str]:
    """The FastAPI app alone (no fast path) under uvicorn, as ``kcache serve`` runs it; its URL."""
    port = free_port()
    code = (
        "import uvicorn; uvicorn.run('kcache_server.serving.app:create_app', factory=True, "
        f"host='127.0.0.1', port={port}, workers={workers}, http='httptools', "
        "access_log=False, log_level='warning')"
    )
    env = {**os.environ, "KCACHE_DATA_DIR": str(data_dir)}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: answers_200(url + "/healthz"), "the routed app", timeout=60)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def median_of(rounds: list[dict[str, float]], name: str) -> float:
    """The median over rounds of one figure of theirs."""
    return statistics.median(r[name] for r in rounds)


def main() -> None:
    workers = int(os.environ.get("BENCH_WORKERS", str(os.cpu_count() or 1)))
    rounds: dict[str, list[dict[str, float]]] = {
        "b1n": [],
        "nginx": [],
        "serve": [],
        "routed": [],
    }
    with tempfile.TemporaryDirectory(prefix="kcache-b1n-") as tmp:
        root = Path(tmp)
        data_dir = root / "data"
        data_dir.mkdir()
        with kcache_server(workers=workers, data_dir=data_dir) as serve_url:
            body = {"recipe": {"source": VECTOR_ADD, "target": "sm_90"}, "compile": True}
            resolved = httpx.post(serve_url + "/v1/resolve", json=body, timeout=120)
            path = f"/v1/recipes/{resolved.raise_for_status().json()['recipe_key']}/artifact"
            data = httpx.get(serve_url + path).raise_for_status().content
            www = root / "www"
            www.mkdir()
            (root / "tmp").mkdir()
            (www / "blob").write_bytes(data)
            env = {**os.environ, "KCACHE_DATA_DIR": str(data_dir)}
            subprocess.run([*KCACHE, "db", "upgrade"], env=env, check=True, capture_output=True)
            edge_log = root / "edge.log"
            accel_env = {
                **env,
                "KCACHE_ACCEL_REDIRECT": "/_kcache_blobs/",
                "KCACHE_EDGE_LOG": str(edge_log),
            }
            replica = ServerProcess(data_dir, workers=workers, env=accel_env, log=root / "r.log")
            with (
                replica,
                deploy_nginx(
                    root / "deploy",
                    replica.url.removeprefix("http://"),
                    data_dir / "blobs",
                    edge_log,
                ) as b1n_url,
                nginx_serving(www) as nginx_url,
                routed_uvicorn(data_dir, workers) as routed_url,
            ):
                urls = {
                    "b1n": b1n_url + path,
                    "nginx": nginx_url,
                    "serve": serve_url + path,
                    "routed": routed_url + path,
                }
                # Each side's serving processes (nginx's workers, the replica's), by command line.
                serving = {
                    "b1n": {
                        "nginx": f"-c {root / 'deploy' / 'nginx.conf'}",
                        "replica": f"--port {replica.port}",
                    },
                    "nginx": {"nginx": f"-c {root / 'nginx.conf'}"},
                    "serve": {"replica": f"--port {serve_url.rsplit(':', 1)[1]}"},
                    "routed": {"replica": f"port={routed_url.rsplit(':', 1)[1]},"},
                }
                for url in urls.values():  # warm every process's caches, and check the bytes
                    for _ in range(4 * workers):
                        assert httpx.get(url).content == data, url
                for _ in range(ROUNDS):
                    for side, url in urls.items():
                        before = {part: tree_cpu_s(n) for part, n in serving[side].items()}
                        got = wrk(url, seconds=SECONDS)
                        for part, needle in serving[side].items():
                            spent = tree_cpu_s(needle) - before[part]
                            got[f"{part}_cpu_us"] = spent * 1e6 / (got["rps"] * SECONDS)
                        got["cpu_us"] = sum(got[f"{part}_cpu_us"] for part in serving[side])
                        rounds[side].append(got)
                        time.sleep(0.5)
                time.sleep(1.5)  # nginx flushes its edge log every second
                with open(edge_log, "rb") as lines:
                    edge_log_lines = sum(
                        chunk.count(b"\n") for chunk in iter(lambda: lines.read(1 << 20), b"")
                    )
    med = {side: median_round(r) for side, r in rounds.items()}
    anchor = med["nginx"]["rps"]
    each = {f"rounds_{side}": [round(r["rps"]) for r in rs] for side, rs in rounds.items()}
    emit(
        "B1n.fetch_by_key_through_deploy_nginx.rps",
        med["b1n"]["rps"],
        anchor,
        "req/s",
        goal=">= 0.9",
        met=med["b1n"]["rps"] >= 0.9 * anchor,
        bytes=len(data),
        replica_workers=workers,
        non_2xx=sum(r["non_2xx"] for r in rounds["b1n"]),
        edge_log_lines=edge_log_lines,
        p99_ms=med["b1n"]["p99_ms"],
        server_cpu_us_per_fetch=round(median_of(rounds["b1n"], "cpu_us"), 2),
        replica_cpu_us_per_fetch=round(median_of(rounds["b1n"], "replica_cpu_us"), 2),
        anchor_cpu_us_per_fetch=round(median_of(rounds["nginx"], "cpu_us"), 2),
        **each,
    )
    emit(
        "B1.fetch_by_key.kcache_serve.rps",
        med["serve"]["rps"],
        anchor,
        "req/s",
        goal=">= 0.25",
        met=med["serve"]["rps"] >= 0.25 * anchor,
        server_cpu_us_per_fetch=round(median_of(rounds["serve"], "cpu_us"), 2),
    )
    emit(
        "B1.fetch_by_key.fastapi_routed.rps",
        med["routed"]["rps"],
        anchor,
        "req/s",
        fast_path_vs_routed=round(med["serve"]["rps"] / med["routed"]["rps"], 3),
        server_cpu_us_per_fetch=round(median_of(rounds["routed"], "cpu_us"), 2),
    )


if __name__ == "__main__":
    main()
