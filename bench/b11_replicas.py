"""B11: replicas sharing no filesystem. Fetch-by-key through nginx, and a cold replica's fill.

The topology of ``tests/server/test_load_balancer.py``: ``kcache serve`` replicas on one
PostgreSQL database, each with its own data directory, their blobs in a bucket on moto's
S3 server, Debian's nginx in front (the same generated config as that test).

Figures:

* ``B11.fetch_by_key.rps_2_vs_1``: ``GET /v1/recipes/{key}/artifact`` (one warm key)
  through an nginx balancing over 2 replicas, against an nginx in front of 1 of them
  (median of ``B11_ROUNDS`` rounds, default 3, the two interleaved). wrk where it is
  installed, else a threaded httpx loop.
* ``B11.cold_fetch_ms``: the first fetch of each of ``B11_KEYS`` (default 5) artifacts
  from a replica started with an empty data directory (it reads the bucket, verifies and
  keeps a local copy), against a fetch of the same keys once that replica is warm (median
  ms of each, straight to the replica, one keep-alive connection).

Needs PostgreSQL (``KCACHE_TEST_PG_URL``), moto's server (``scripts/ensure-services``) and
nginx. Each replica runs ``B11_WORKERS`` (default 1) uvicorn workers and one compile worker.

    python bench/b11_replicas.py
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _harness (puts the root on sys.path)
from _harness import emit, wrk

from kcache.signing import SigningKey
from tests.s3_server import s3_server
from tests.server.test_load_balancer import Nginx
from tests.support import ServerProcess, pg_database, unique, upgrade, vector_add

ROUNDS = int(os.environ.get("B11_ROUNDS", "3"))
KEYS = int(os.environ.get("B11_KEYS", "5"))
WORKERS = int(os.environ.get("B11_WORKERS", "1"))
SECONDS = int(os.environ.get("B11_SECONDS", "5"))
CONNECTIONS = 32


def httpx_rps(url: str, seconds: int = SECONDS, threads: int = 8) -> dict[str, float]:
    """Requests/s of ``threads`` keep-alive clients GETting ``url`` for ``seconds`` (wrk's stand-in)."""
    counts = [0] * threads
    failures = [0] * threads
    deadline = time.monotonic() + seconds

    def loop(i: int) -> None:
        with httpx.Client(timeout=30) as client:
            while time.monotonic() < deadline:
                if client.get(url).status_code == 200:
                    counts[i] += 1
                else:
                    failures[i] += 1

    pool = [threading.Thread(target=loop, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return {"rps": sum(counts) / seconds, "non_2xx": float(sum(failures))}


def fetch_rps(url: str) -> dict[str, float]:
    """One load round against ``url``."""
    if shutil.which("wrk"):
        return wrk(url, connections=CONNECTIONS, seconds=SECONDS)
    return httpx_rps(url)


def fetch_ms(client: httpx.Client, url: str) -> float:
    """One fetch's wall time in ms (the body read in full, checked to be 200)."""
    start = time.perf_counter()
    client.get(url).raise_for_status()
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    server = s3_server()  # pytest's Skipped, with the reason, where moto is missing
    with pg_database("kcache_b11") as db_url, tempfile.TemporaryDirectory(prefix="b11-") as tmp:
        root = Path(tmp)
        upgrade(db_url)
        # The replicas of one fleet sign with one key (a database refuses a second key).
        signing_key = root / "signing-key.pem"
        SigningKey.load_or_create(signing_key)
        env = {
            **os.environ,
            **server.env,
            "KCACHE_STORE_URL": f"s3://{server.new_bucket('kcache-b11')}/kcache",
            "KCACHE_COMPILE_WORKERS": "1",
            "KCACHE_SIGNING_KEY_FILE": str(signing_key),
        }
        a, b, cold = (
            ServerProcess(root / n, db_url=db_url, env=env, workers=WORKERS)
            for n in ("a", "b", "cold")
        )
        started: list[ServerProcess | Nginx] = []
        try:
            for replica in (a, b):
                replica.launch()
                started.append(replica)
            for replica in (a, b):
                replica.wait_ready()
            two = Nginx(root / "nginx-2", [a.url, b.url])
            started.append(two)
            one = Nginx(root / "nginx-1", [a.url])
            started.append(one)

            keys = []
            for i in range(KEYS):
                answer = httpx.post(
                    f"{two.url}/v1/resolve",
                    json={"recipe": vector_add(unique(f"b11-{i}"))},
                    timeout=300,
                )
                answer.raise_for_status()
                keys.append(answer.json()["recipe_key"])
            path = f"/v1/recipes/{keys[0]}/artifact"
            for replica in (a, b):  # both warm for the load key
                for _ in range(3):
                    httpx.get(replica.url + path, timeout=30).raise_for_status()

            rounds: dict[str, list[float]] = {"2": [], "1": []}
            bad = 0.0
            for _ in range(ROUNDS):
                for label, nginx in (("2", two), ("1", one)):
                    result = fetch_rps(nginx.url + path)
                    rounds[label].append(result["rps"])
                    bad += result["non_2xx"]
            emit(
                "B11.fetch_by_key.rps_2_vs_1",
                statistics.median(rounds["2"]),
                statistics.median(rounds["1"]),
                "req/s",
                rounds_2=[round(x) for x in rounds["2"]],
                rounds_1=[round(x) for x in rounds["1"]],
                non_2xx=bad,
                tool="wrk" if shutil.which("wrk") else "httpx",
                replica_workers=WORKERS,
                cpus=os.cpu_count(),
            )

            cold.start()
            started.append(cold)
            with httpx.Client(base_url=cold.url, timeout=60) as client:
                first = [fetch_ms(client, f"/v1/recipes/{k}/artifact") for k in keys]
                warm = [
                    fetch_ms(client, f"/v1/recipes/{k}/artifact") for _ in range(5) for k in keys
                ]
            emit(
                "B11.cold_fetch_ms",
                statistics.median(first),
                statistics.median(warm),
                "ms",
                cold_each=[round(x, 2) for x in first],
                keys=len(keys),
            )
        finally:
            for process in reversed(started):
                process.stop()


if __name__ == "__main__":
    try:
        main()
    except pytest.skip.Exception as missing:  # no PostgreSQL, moto or nginx: say which
        print(json.dumps({"bench": "B11", "skipped": str(missing)}), flush=True)
