"""Bdeps: exact dependencies over many random sequences of failing and good compiles.

The same property the tests check with a few sequences (tests/deps_workload.py), run
long: in this process (an engine over a local cache directory, compiling in-process,
so fresh processes take over after the first failure) and through one server worker
(``KCACHE_COMPILE_WORKERS=1``), each good compile's recorded dependencies compared
with what the program's model says it reads, then edits of what it read, each of
which must miss. Prints the mismatch count of each (goal: 0) and the seeds.

    .venv/bin/python bench/bdeps_exact_dependencies.py [SEQUENCES_IN_PROCESS] [SEQUENCES_WORKER]
"""

from __future__ import annotations

import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _harness
from _harness import emit

from kcache.deps import PROBE, files_read
from kcache.errors import CompileError, RecipeError
from kcache.local_engine import open_local_engine
from kcache.recipe import Recipe
from tests.deps_workload import SET_NAME, run_sequence
from tests.support import ServerProcess


def _in_process(sequences: int, root: Path, base: int) -> tuple[int, float]:
    engine = open_local_engine(root / "data", include_sets={SET_NAME: root / "set"})

    def resolve(recipe: dict[str, Any]) -> tuple[str, list[str]]:
        try:
            found = engine.resolve(Recipe.from_dict(recipe))
        except (CompileError, RecipeError):
            return "error", []
        return found.status, [d.name for d in files_read(found.artifact.dependencies)]

    started = time.perf_counter()
    bad = 0
    for seed in range(base, base + sequences):
        for mismatch in run_sequence(seed, root / "set", resolve):
            bad += 1
            print(f"in-process mismatch: {mismatch}", flush=True)
    return bad, time.perf_counter() - started


def _one_worker(sequences: int, root: Path, base: int) -> tuple[int, float]:
    import os
    import subprocess

    data = root / "server"
    env = {
        **os.environ,
        "KCACHE_DATA_DIR": str(data),
        "KCACHE_INCLUDE_SETS": f'{{"{SET_NAME}": "{root / "set"}"}}',
    }
    subprocess.run(
        [sys.executable, "-m", "kcache.cli", "db", "upgrade"],
        env=env,
        check=True,
        capture_output=True,
    )
    with (
        ServerProcess(data, workers=1, env=env) as server,
        httpx.Client(base_url=server.url, timeout=300) as client,
    ):

        def resolve(recipe: dict[str, Any]) -> tuple[str, list[str]]:
            answer = client.post("/v1/resolve", json={"recipe": recipe})
            if answer.status_code == 422:
                return "error", []
            answer.raise_for_status()
            body = answer.json()
            return body["status"], [
                d["name"] for d in body["artifact"]["dependencies"] if PROBE not in d["name"]
            ]

        started = time.perf_counter()
        bad = 0
        for seed in range(base, base + sequences):
            for mismatch in run_sequence(seed, root / "set", resolve):
                bad += 1
                print(f"worker mismatch: {mismatch}", flush=True)
        return bad, time.perf_counter() - started


def main() -> None:
    in_process = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    worker = int(sys.argv[2]) if len(sys.argv) > 2 else 1000
    base = random.SystemRandom().randrange(1 << 32)
    with tempfile.TemporaryDirectory(prefix="kcache-bdeps-") as tmp:
        for name, count, run in (
            ("in_process", in_process, _in_process),
            ("one_worker", worker, _one_worker),
        ):
            root = Path(tmp) / name  # the same seeds make the same files: one tree each
            (root / "set").mkdir(parents=True)
            bad, seconds = run(count, root, base)
            emit(
                f"Bdeps.{name}.mismatches",
                bad,
                None,
                "mismatches",
                sequences=count,
                seeds=f"{base}..{base + count - 1}",
                seconds=round(seconds, 1),
                goal="0",
                met=bad == 0,
            )


if __name__ == "__main__":
    main()
