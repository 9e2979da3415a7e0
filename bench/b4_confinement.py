"""B4 (confinement): what Landlock adds to one compile in a server compile worker.

Two real worker pools side by side, one confined by Landlock (``compile_sandbox``
best-effort, on a kernel that has it) and one with confinement turned off; rounds
alternate between them, so both see the same machine noise. Each recipe is new (a
distinct constant), so every call really compiles a vector add. The anchor is the
unconfined pool; the figure is the median per-compile difference. Goal: <= 5 ms.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _harness
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support
from _harness import emit
from kcache_server.compile_pool import ProcessPoolCompiler

from kcache.include_sets import IncludeSets
from kcache.recipe import Recipe
from kcache.sandbox import probe
from kcache.toolchain import load_toolchain
from tests.support import VECTOR_ADD

ROUNDS = int(os.environ.get("BENCH_ROUNDS", "30"))


def source(i: int, salt: str) -> str:
    return VECTOR_ADD.replace("x[i] + y[i]", f"x[i] + y[i] * {i}.0f /* {salt} */")


def main() -> None:
    toolchain = load_toolchain()
    salt = str(time.time_ns())
    with tempfile.TemporaryDirectory(prefix="kcache-b4c-") as tmp:
        pools = {
            mode: ProcessPoolCompiler(
                toolchain,
                IncludeSets(),
                workers=1,
                timeout_s=120,
                memory_mb=8192,
                queue_limit=0,
                tmp_dir=Path(tmp) / mode,
                compile_sandbox=mode,
            )
            for mode in ("best-effort", "off")
        }
        times: dict[str, list[float]] = {mode: [] for mode in pools}
        try:
            for pool in pools.values():
                pool.start()
            confined = pools["best-effort"].sandbox
            for i in range(ROUNDS + 1):
                for mode, pool in pools.items():
                    recipe = Recipe(
                        source=source(i, f"{mode} {salt}"), target="sm_90", toolchain=toolchain.id
                    )
                    started = time.perf_counter()
                    pool.compile(recipe)
                    if i:  # round 0 warms both workers' first real compile
                        times[mode].append((time.perf_counter() - started) * 1e3)
        finally:
            for pool in pools.values():
                pool.close()
    ours, anchor = statistics.median(times["best-effort"]), statistics.median(times["off"])
    diffs = [a - b for a, b in zip(times["best-effort"], times["off"], strict=True)]
    added = statistics.median(diffs)
    emit(
        "B4.confinement.compile_median_ms",
        ours,
        anchor,
        "ms",
        confined=bool(confined and confined.active),
        sandbox=confined.detail if confined else probe().detail,
        added_ms_median=round(added, 3),
        goal="confinement adds <= 5 ms per compile",
        met=added <= 5.0,
        rounds=ROUNDS,
    )


if __name__ == "__main__":
    main()
