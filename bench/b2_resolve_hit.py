"""B2: resolve hit, ``POST /v1/resolve`` with a 20-header recipe, against B1's ours in the same run.

Goal: >= 0.3 x the fetch-by-key req/s.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _harness
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support
from _harness import emit, kcache_server, post_json_lua, wrk

from tests.support import VECTOR_ADD

SECONDS = int(os.environ.get("BENCH_SECONDS", "5"))


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
    with kcache_server(workers=workers) as url:
        body = {"recipe": twenty_header_recipe(), "compile": True}
        first = httpx.post(url + "/v1/resolve", json=body, timeout=120).raise_for_status().json()
        hit = httpx.post(url + "/v1/resolve", json=body, timeout=30).raise_for_status().json()
        assert hit["status"] == "hit", hit
        resolve = wrk(url + "/v1/resolve", seconds=SECONDS, script=post_json_lua(body))
        fetch = wrk(f"{url}/v1/recipes/{first['recipe_key']}/artifact", seconds=SECONDS)
    emit(
        "B2.resolve_hit.rps",
        resolve["rps"],
        fetch["rps"],
        "req/s",
        goal=">= 0.3",
        p99_ms=resolve["p99_ms"],
        non_2xx=resolve["non_2xx"],
        workers=workers,
    )


if __name__ == "__main__":
    main()
