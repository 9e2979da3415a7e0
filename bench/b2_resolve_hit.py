"""B2: resolve hit, ``POST /v1/resolve`` with a 20-header recipe, against B1's ours in the same run.

One server holds both artifacts (B1's vector add and B2's 20-header recipe). Rounds
alternate B1's fetch by key (the anchor, measured with B1's own functions) and the
resolve hit (``BENCH_ROUNDS``, 3), so both see the same machine; each figure is its
median round. Goal: >= 0.3 x the fetch-by-key req/s.

Also in the same rounds, the resolve hit with no fast path (``routed``: the same app and
data directory under uvicorn, every resolve through FastAPI's route): what the resolve
fast path buys.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _harness, b1_fetch
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support
from _harness import emit, kcache_server, post_json_lua, wrk
from b1_fetch import median_round
from b1n_nginx_topology import routed_uvicorn

from tests.support import VECTOR_ADD

SECONDS = int(os.environ.get("BENCH_SECONDS", "5"))
#: Interleaved rounds of B2 and its B1 anchor; each figure is the median round.
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "3"))


def twenty_header_recipe() -> dict[str, object]:
    """A vector add that includes 10 of 20 supplied headers (each a few hundred bytes)."""
    headers = {
        f"h{i:02d}.cuh": f"#pragma once\n#define H{i} {i}\n" + "// padding\n" * 20
        for i in range(20)
    }
    includes = "".join(f'#include "h{i:02d}.cuh"\n' for i in range(10))
    return {"source": includes + VECTOR_ADD, "target": "sm_90", "headers": headers}


def main() -> None:
    workers = int(os.environ.get("BENCH_WORKERS", str(os.cpu_count() or 1)))
    resolve_rounds: list[dict[str, float]] = []
    fetch_rounds: list[dict[str, float]] = []
    routed_rounds: list[dict[str, float]] = []
    with (
        tempfile.TemporaryDirectory(prefix="kcache-b2-") as tmp,
        kcache_server(workers=workers, data_dir=Path(tmp)) as url,
    ):
        fetch = {"recipe": {"source": VECTOR_ADD, "target": "sm_90"}, "compile": True}
        resolved = httpx.post(url + "/v1/resolve", json=fetch, timeout=120).raise_for_status()
        artifact_url = f"{url}/v1/recipes/{resolved.json()['recipe_key']}/artifact"
        httpx.get(artifact_url).raise_for_status()
        body = {"recipe": twenty_header_recipe(), "compile": True}
        httpx.post(url + "/v1/resolve", json=body, timeout=120).raise_for_status()
        with routed_uvicorn(Path(tmp), workers) as routed:
            for server in (url, routed):
                for _ in range(2 * workers):  # every worker has answered it (and warmed its memory)
                    hit = httpx.post(server + "/v1/resolve", json=body, timeout=30)
                    assert hit.raise_for_status().json()["status"] == "hit", hit.text
            script = post_json_lua(body)
            for _ in range(ROUNDS):
                fetch_rounds.append(wrk(artifact_url, seconds=SECONDS))
                time.sleep(0.5)
                resolve_rounds.append(wrk(url + "/v1/resolve", seconds=SECONDS, script=script))
                time.sleep(0.5)
                routed_rounds.append(wrk(routed + "/v1/resolve", seconds=SECONDS, script=script))
                time.sleep(0.5)
    resolve, fetch = median_round(resolve_rounds), median_round(fetch_rounds)
    routed = median_round(routed_rounds)
    emit(
        "B2.resolve_hit.rps",
        resolve["rps"],
        fetch["rps"],
        "req/s",
        goal=">= 0.3",
        met=resolve["rps"] >= 0.3 * fetch["rps"],
        p99_ms=resolve["p99_ms"],
        workers=workers,
        rounds_ours=[round(r["rps"]) for r in resolve_rounds],
        rounds_anchor=[round(r["rps"]) for r in fetch_rounds],
        non_2xx=sum(r["non_2xx"] for r in resolve_rounds),
    )
    emit(
        "B2.resolve_hit.fastapi_routed.rps",
        resolve["rps"],
        routed["rps"],
        "req/s",
        fast_path_vs_routed=round(resolve["rps"] / routed["rps"], 3),
        rounds_routed=[round(r["rps"]) for r in routed_rounds],
        non_2xx=sum(r["non_2xx"] for r in routed_rounds),
    )


if __name__ == "__main__":
    main()
