"""B13: what verified hits cost: B1 and B2 with verification on (its defaults) and off, and a
real compile's wait while the verifier is busy.

Two real ``kcache serve`` processes, alike but for ``KCACHE_VERIFY_ENABLED``, each holding
the same 40 kernels and serving hits on all of them before the rounds, so the one with
verification on has a served set to sample from (at the default rate, one exact-key hit
in twenty is queued for a recompile, each at most once a day). Rounds alternate the two
servers (``BENCH_ROUNDS``, 3): B1's fetch by key and B2's resolve hit with wrk, 32
connections; each figure is the median round, and the ratio is on / off (goal: >= 0.95).

The compile wait: with the verifier made busy (``KCACHE_VERIFY_SAMPLE_RATE=1`` on a third
server, every one of 40 served kernels queued for a recompile), then 5 cold compiles of
new kernels are timed one after another, against the same on the server with
verification off; ratio busy / off (goal: <= 1.05: the verifier runs niced, on its own
worker, within its CPU share, and never holds a key's compile lock).
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _harness import KCACHE, emit, post_json_lua, wrk
from b1_fetch import median_round

from tests.support import VECTOR_ADD, ServerProcess

SECONDS = int(os.environ.get("BENCH_SECONDS", "5"))
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "4"))
KERNELS = 40


def _recipe(i: int) -> dict[str, object]:
    return {"source": VECTOR_ADD + f"\n// kernel {i}\n", "target": "sm_90"}


@contextlib.contextmanager
def _server(tmp: Path, name: str, **verify: str) -> Iterator[str]:
    data = tmp / name
    data.mkdir()
    env = {**os.environ, "KCACHE_DATA_DIR": str(data)}
    env.update({f"KCACHE_VERIFY_{k.upper()}": v for k, v in verify.items()})
    subprocess.run([*KCACHE, "db", "upgrade"], env=env, check=True, capture_output=True)
    with ServerProcess(data, env=env) as server:
        yield server.url


def _fill(url: str) -> tuple[str, dict[str, object]]:
    """Compile and serve the kernels; the first one's fetch URL and a resolve-hit body."""
    keys = []
    for i in range(KERNELS):
        body = {"recipe": _recipe(i), "compile": True}
        keys.append(httpx.post(url + "/v1/resolve", json=body, timeout=120).json()["recipe_key"])
    for key in keys:  # hits: the served set verification samples from
        for _ in range(3):
            httpx.get(f"{url}/v1/recipes/{key}/artifact", timeout=30).raise_for_status()
    return f"{url}/v1/recipes/{keys[0]}/artifact", {"recipe": _recipe(0), "compile": True}


def _compile_waits(url: str, first: int) -> list[float]:
    """Seconds each of 5 cold compiles (new kernels ``first``, ``first + 1``, ...) took."""
    waits = []
    for i in range(first, first + 5):
        body = {"recipe": _recipe(i), "compile": True}
        started = time.perf_counter()
        httpx.post(url + "/v1/resolve", json=body, timeout=120).raise_for_status()
        waits.append(time.perf_counter() - started)
    return waits


def main() -> None:
    fetch: dict[str, list[dict[str, float]]] = {"on": [], "off": []}
    resolve: dict[str, list[dict[str, float]]] = {"on": [], "off": []}
    with tempfile.TemporaryDirectory(prefix="kcache-b13-") as tmp_name:
        tmp = Path(tmp_name)
        with _server(tmp, "on", enabled="true") as on, _server(tmp, "off", enabled="false") as off:
            urls = {"on": on, "off": off}
            fetch_urls, bodies = {}, {}
            for name, url in urls.items():
                fetch_urls[name], bodies[name] = _fill(url)
            for round_ in range(ROUNDS):
                # Alternate which server goes first (ABBA): a round's first run was seen
                # faster or slower than its second for reasons of neither server.
                for name in ("on", "off") if round_ % 2 == 0 else ("off", "on"):
                    fetch[name].append(wrk(fetch_urls[name], seconds=SECONDS))
                    time.sleep(0.5)
                    script = post_json_lua(bodies[name])
                    resolve[name].append(
                        wrk(urls[name] + "/v1/resolve", seconds=SECONDS, script=script)
                    )
                    time.sleep(0.5)
            verified = httpx.get(on + "/metrics").text
            off_waits = _compile_waits(off, 10_000)
        with _server(tmp, "busy", enabled="true", sample_rate="1") as busy:
            _fill(busy)  # every served kernel queued for a recompile: the verifier is busy
            busy_waits = _compile_waits(busy, 20_000)
            busy_metrics = httpx.get(busy + "/metrics").text
    for what, rounds in (("B1.fetch_by_key", fetch), ("B2.resolve_hit", resolve)):
        on_r, off_r = median_round(rounds["on"]), median_round(rounds["off"])
        emit(
            f"B13.{what}_verify_on.rps",
            on_r["rps"],
            off_r["rps"],
            "req/s",
            goal=">= 0.95 (verification on at its defaults vs off)",
            p99_ms_on=on_r["p99_ms"],
            p99_ms_off=off_r["p99_ms"],
            rounds_on=[r["rps"] for r in rounds["on"]],
            rounds_off=[r["rps"] for r in rounds["off"]],
        )
    emit(
        "B13.compile_wait_verifier_busy.s",
        statistics.median(busy_waits),
        statistics.median(off_waits),
        "s",
        goal="<= 1.05 (a real compile does not wait for verification)",
        busy=[round(w, 3) for w in busy_waits],
        off=[round(w, 3) for w in off_waits],
        verified_lines=[ln for ln in busy_metrics.splitlines() if ln.startswith("kcache_verified")],
        default_rate_verified=[
            ln for ln in verified.splitlines() if ln.startswith("kcache_verified_total")
        ],
    )


if __name__ == "__main__":
    main()
