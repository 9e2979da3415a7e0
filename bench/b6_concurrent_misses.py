"""B6: 64 concurrent identical misses: exactly 1 compile and 1 digest."""

from __future__ import annotations

import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _harness
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support
from _harness import emit, kcache_server

from tests.support import VECTOR_ADD

CLIENTS = 64


def main() -> None:
    recipe = {"source": VECTOR_ADD + f"// {time.time_ns()}\n", "target": "sm_90"}
    with (
        kcache_server() as url,
        httpx.Client(timeout=120, limits=httpx.Limits(max_connections=CLIENTS)) as client,
    ):
        start = threading.Barrier(CLIENTS)  # all 64 requests leave together

        def ask(_: int) -> dict[str, object]:
            start.wait()
            return (
                client.post(url + "/v1/resolve", json={"recipe": recipe}).raise_for_status().json()
            )  # type: ignore[no-any-return]

        started = time.perf_counter()
        with ThreadPoolExecutor(CLIENTS) as pool:
            replies = list(pool.map(ask, range(CLIENTS)))
        wall = time.perf_counter() - started
    compiles = sum(r["status"] == "compiled" for r in replies)
    digests = {r["artifact"]["digest"] for r in replies}  # type: ignore[index]
    emit(
        "B6.concurrent_misses.compiles",
        compiles,
        1,
        "compiles",
        digests=len(digests),
        statuses={s: sum(r["status"] == s for r in replies) for s in ("compiled", "waited", "hit")},
        wall_s=round(wall, 3),
        met=compiles == 1 and len(digests) == 1,
    )


if __name__ == "__main__":
    main()
