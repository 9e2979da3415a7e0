"""Bstall: the longest the server's event loop stalls while a large request body arrives.

A real ``kcache serve`` (SQLite, one compile worker) in its own process; a poller in
this one asks ``/healthz`` every 2 ms on a kept-alive connection while each body
shape of :mod:`tests.loop_stall` is posted (``BENCH_ROUNDS`` times, default 3): the
issue's 17 MiB resolve of a million specialization keys and its 30 MiB kin (refused
unparsed: over ``max_request_values``), the largest resolve still parsed (190k keys),
a batch of 1024 recipes, 5,000 client events and a 28 MiB source. Each figure is the
longest ``/healthz`` answer over the rounds, in ms; a first round of each shape warms
the server (the first recipes it checks load the toolchain's tables, once per process)
and is reported apart (``first_round_ms``), not counted.

Anchor: the longest ``/healthz`` answer of the same poller over as long with no body
posted (what the poller and the machine cost by themselves). Goal: every shape under
100 ms on a quiet machine (CI asserts only "under 1 s": tests/server/test_loop_stall.py).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _harness
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support
from _harness import emit, kcache_server

from tests.loop_stall import SHAPES, HealthPoller, body_of, measure

ROUNDS = int(os.environ.get("BENCH_ROUNDS", "3"))
GOAL_MS = 100.0


def main() -> None:
    os.environ.setdefault("KCACHE_COMPILE_WORKERS", "1")
    os.environ.setdefault("KCACHE_VERIFY_ENABLED", "false")
    with kcache_server() as url:
        for shape in SHAPES:
            path, body = body_of(shape)
            started = time.perf_counter()
            first, *results = list(measure(url, path, body, rounds=ROUNDS + 1))
            took = time.perf_counter() - started
            with HealthPoller(url) as quiet:  # the anchor: as long as a round, nothing posted
                time.sleep(max(0.0, took / (ROUNDS + 1) - 0.4))
            worst_ms = max(stall for stall, _ in results) * 1000
            emit(
                f"Bstall.{shape}.max_ms",
                worst_ms,
                quiet.worst * 1000,
                "ms",
                goal=f"< {GOAL_MS:g} ms",
                met=worst_ms < GOAL_MS,
                body_mib=round(len(body) / 2**20, 1),
                statuses=sorted({status for _, status in results}),
                rounds_ms=[round(stall * 1000, 1) for stall, _ in results],
                first_round_ms=round(first[0] * 1000, 1),
            )


if __name__ == "__main__":
    main()
