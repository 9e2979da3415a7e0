"""Instant commands (issue 13 item 6): how long a user waits for the CLI and the service.

Figures, each the median of ``BENCH_ROUNDS`` (5) runs, ours and the anchor alternating:

- ``kcache --help`` and ``kcache key FILE --target sm_90`` (no server: keyed with the
  local NVRTC's version) against the interpreter starting and exiting
  (``python -c pass``, the floor of any Python command). Goal: < 0.3 s each.
- ``kcache serve`` answering ``/readyz`` (SQLite, a migrated data directory) against
  a bare ASGI app under uvicorn answering its first request. Goal: < 2 s.
- ``scripts/serve`` with an up-to-date ``.venv`` answering ``/readyz`` (it checks the
  environment, migrates, serves): same anchor. Goal: < 5 s.

The three packages are byte-compiled first, as ``pip install`` does
(``_harness.compile_packages``).
"""

from __future__ import annotations

import contextlib
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _harness
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support
from _harness import KCACHE, bare_app_command, emit

from tests.support import VECTOR_ADD, answers_200, free_port

ROOT = Path(__file__).resolve().parents[1]
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "5"))


def run_s(cmd: list[str], env: dict[str, str] | None = None) -> float:
    """Seconds ``cmd`` takes to run to its end (it must succeed)."""
    started = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, env=env, cwd=ROOT)
    return time.perf_counter() - started


def _accepts(port: int) -> bool:
    """Whether something listens on ``port``: a connect, far cheaper than an HTTP request."""
    with contextlib.suppress(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    return False


def ready_s(cmd: list[str], port: int, path: str, env: dict[str, str]) -> float:
    """Seconds from starting ``cmd`` until ``path`` on ``port`` answers 200; the process is then stopped.

    The port is polled with bare connects and asked over HTTP only once it accepts: an
    HTTP client polling every few milliseconds would take most of one of the two
    cores from the server it is timing.
    """
    url = f"http://127.0.0.1:{port}{path}"
    started = time.perf_counter()
    proc = subprocess.Popen(
        cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        while not (_accepts(port) and answers_200(url)):
            if proc.poll() is not None:
                raise RuntimeError(f"{cmd} exited with {proc.returncode} before {url} answered")
            if time.perf_counter() - started > 120:
                raise RuntimeError(f"{url} did not answer within 120 s")
            time.sleep(0.01)
        return time.perf_counter() - started
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def interleaved(ours: Callable[[], float], anchor: Callable[[], float]) -> tuple[float, float]:
    """Medians of ``ROUNDS`` alternating measurements of ``ours`` and ``anchor``."""
    a: list[float] = []
    b: list[float] = []
    for _ in range(ROUNDS):
        a.append(ours())
        b.append(anchor())
    return statistics.median(a), statistics.median(b)


def main() -> None:
    python = sys.executable
    env = {k: v for k, v in os.environ.items() if not k.startswith("KCACHE_")}
    floor = [python, "-c", "pass"]
    with tempfile.TemporaryDirectory(prefix="kcache-bench-cmd-") as tmp:
        source = Path(tmp) / "vector_add.cu"
        source.write_text(VECTOR_ADD)
        for name, cmd in (
            ("help", [*KCACHE, "--help"]),
            ("key", [*KCACHE, "key", str(source), "--target", "sm_90"]),
        ):
            ours, anchor = interleaved(partial(run_s, cmd, env), partial(run_s, floor, env))
            emit(f"Bcmd.kcache_{name}_s", ours, anchor, "s", goal="< 0.3 s", met=ours < 0.3)

        data_dir = Path(tmp) / "data"
        serve_env = {**env, "KCACHE_DATA_DIR": str(data_dir)}
        subprocess.run([*KCACHE, "db", "upgrade"], env=serve_env, check=True, capture_output=True)

        def bare() -> float:
            port = free_port()
            cmd = bare_app_command(Path(tmp), b"ok", port)
            return ready_s(cmd, port, "/", env)

        def serve(script: bool) -> Callable[[], float]:
            def one() -> float:
                port = free_port()
                cmd = (
                    [str(ROOT / "scripts/serve"), "--port", str(port)]
                    if script
                    else [*KCACHE, "serve", "--port", str(port)]
                )
                return ready_s(cmd, port, "/readyz", serve_env)

            return one

        for name, goal in (("kcache_serve", 2.0), ("scripts_serve", 5.0)):
            ours, anchor = interleaved(serve(name == "scripts_serve"), bare)
            emit(f"Bcmd.{name}_ready_s", ours, anchor, "s", goal=f"< {goal:g} s", met=ours < goal)


if __name__ == "__main__":
    main()
