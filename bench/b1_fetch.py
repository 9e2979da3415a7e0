"""B1: fetch a cubin by recipe key over HTTP, warm, 32 connections, 5 s.

Ours: ``GET /v1/recipes/{key}/artifact`` on a real ``kcache serve``. Anchors, in the
same run: nginx (1 worker) serving the same file from disk, and Redis GET of the
same bytes (redis-benchmark, 32 clients) as Triton's remote cache backend does.
A third side, a bare ASGI app under uvicorn returning the same bytes, shows
what uvicorn itself allows here. Goal (stock uvicorn): >= 0.25 x nginx req/s, p99 < 10 ms.
Both servers stay up and their rounds alternate (``BENCH_ROUNDS``, 3); the figures are the median rounds.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _harness
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support
from _harness import bare_app_command, emit, kcache_server, wrk

from tests.support import VECTOR_ADD, answers_200, free_port, wait_until

SECONDS = int(os.environ.get("BENCH_SECONDS", "5"))
#: Interleaved rounds of ours and nginx; each figure is the median round.
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "3"))


@contextlib.contextmanager
def nginx_serving(directory: Path) -> Iterator[str]:
    """nginx with one worker serving ``directory`` on an ephemeral port."""
    port = free_port()
    conf = directory.parent / "nginx.conf"
    conf.write_text(
        f"""worker_processes 1; daemon off; pid {directory.parent}/nginx.pid;
error_log {directory.parent}/error.log;
events {{ worker_connections 1024; }}
http {{ access_log off; sendfile on; tcp_nopush on;
  client_body_temp_path {directory.parent}/tmp; proxy_temp_path {directory.parent}/tmp;
  fastcgi_temp_path {directory.parent}/tmp; uwsgi_temp_path {directory.parent}/tmp;
  scgi_temp_path {directory.parent}/tmp;
  server {{ listen 127.0.0.1:{port}; root {directory}; }} }}
"""
    )
    # Run as root, nginx's workers drop to ``nobody``: the temp dirs (0700) must be readable.
    for path in (directory.parent, directory):
        path.chmod(0o755)
    for path in directory.iterdir():
        path.chmod(0o644)
    proc = subprocess.Popen(["nginx", "-c", str(conf), "-p", str(directory.parent)])
    try:
        wait_until(lambda: answers_200(f"http://127.0.0.1:{port}/blob"), "nginx", timeout=15)
        yield f"http://127.0.0.1:{port}/blob"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def redis_get_rps(size: int) -> float | None:
    """redis-benchmark GET of a value of the cubin's size on the machine's Redis (None if absent).

    ``-t set,get`` first SETs the benchmark key to ``size`` bytes, then GETs it back:
    the same number of bytes per request as our route serves.
    """
    try:
        pong = subprocess.run(["redis-cli", "ping"], capture_output=True, text=True).stdout.strip()
    except FileNotFoundError:
        return None
    if pong != "PONG":
        return None
    out = subprocess.run(
        ["redis-benchmark", "-c", "32", "-n", "200000", "-t", "set,get", "-d", str(size), "--csv"],
        capture_output=True,
        text=True,
    ).stdout
    match = re.search(r'"GET","([\d.]+)"', out)
    return float(match.group(1)) if match else None


@contextlib.contextmanager
def warm_artifact(workers: int) -> Iterator[tuple[str, str, bytes]]:
    """A real server holding a compiled vector add: its URL, the fetch URL and the cubin."""
    with kcache_server(workers=workers) as url:
        body = {"recipe": {"source": VECTOR_ADD, "target": "sm_90"}, "compile": True}
        resolved = httpx.post(url + "/v1/resolve", json=body, timeout=120).raise_for_status().json()
        artifact_url = f"{url}/v1/recipes/{resolved['recipe_key']}/artifact"
        yield url, artifact_url, httpx.get(artifact_url).raise_for_status().content


@contextlib.contextmanager
def bare_uvicorn(directory: Path, workers: int) -> Iterator[str]:
    """A bare ASGI app under uvicorn (as many workers as ours) serving ``directory/blob``."""
    port = free_port()
    cmd = bare_app_command(directory, (directory / "blob").read_bytes(), port, workers)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}/"
        wait_until(lambda: answers_200(url), "the bare uvicorn app", timeout=30)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def median_round(rounds: list[dict[str, float]]) -> dict[str, float]:
    """The round with the median requests/s (its p99 with it: one real round, not a mix)."""
    return sorted(rounds, key=lambda r: r["rps"])[len(rounds) // 2]


def main() -> None:
    workers = int(os.environ.get("BENCH_WORKERS", str(os.cpu_count() or 1)))
    ours_rounds: list[dict[str, float]] = []
    anchor_rounds: list[dict[str, float]] = []
    bare_rounds: list[dict[str, float]] = []
    with warm_artifact(workers) as (_, artifact_url, data), tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "www"
        root.mkdir()
        (Path(tmp) / "tmp").mkdir()
        (root / "blob").write_bytes(data)
        with nginx_serving(root) as nginx_url, bare_uvicorn(root, workers) as bare_url:
            # All stay up; their rounds alternate, so each sees the same machine.
            for _ in range(ROUNDS):
                ours_rounds.append(wrk(artifact_url, seconds=SECONDS))
                time.sleep(0.5)
                anchor_rounds.append(wrk(nginx_url, seconds=SECONDS))
                time.sleep(0.5)
                bare_rounds.append(wrk(bare_url, seconds=SECONDS))
                time.sleep(0.5)
    ours, anchor = median_round(ours_rounds), median_round(anchor_rounds)
    bare = median_round(bare_rounds)
    emit(
        "B1.fetch_by_key.rps",
        ours["rps"],
        anchor["rps"],
        "req/s",
        goal=">= 0.25",
        met=ours["rps"] >= 0.25 * anchor["rps"],
        bytes=len(data),
        workers=workers,
        rounds_ours=[round(r["rps"]) for r in ours_rounds],
        rounds_anchor=[round(r["rps"]) for r in anchor_rounds],
        non_2xx=sum(r["non_2xx"] for r in ours_rounds),
    )
    emit(
        "B1.fetch_by_key.p99_ms",
        ours["p99_ms"],
        anchor["p99_ms"],
        "ms",
        goal="ours < 10 ms",
        met=ours["p99_ms"] < 10,
    )
    # What uvicorn itself allows on this machine: ours against a bare app, and that app
    # against nginx (the ceiling of any app served by uvicorn here).
    emit(
        "B1.fetch_by_key.vs_bare_uvicorn",
        ours["rps"],
        bare["rps"],
        "req/s",
        bare_vs_nginx=round(bare["rps"] / anchor["rps"], 3),
        rounds_bare=[round(r["rps"]) for r in bare_rounds],
    )
    redis_rps = redis_get_rps(len(data))
    if redis_rps is not None:
        emit("B1.fetch_by_key.vs_redis_get", ours["rps"], redis_rps, "req/s")


if __name__ == "__main__":
    main()
