"""Shared pieces of the benchmarks: a real kcache server, wrk, JSON lines.

Ports, the server process and the recipes come from ``tests/support.py``, which the
tests use too (the repository root goes on ``sys.path`` here).

Every figure is a ratio against an anchor measured in the same run on the same
machine (bench/README.md); nothing here asserts a time.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support
from tests.support import ServerProcess

KCACHE = [sys.executable, "-m", "kcache.cli"]

ROOT = Path(__file__).resolve().parents[1]


def compile_packages() -> None:
    """Byte-compile kcache's three packages, as ``pip install`` does for a user.

    A checkout edited under ``PYTHONDONTWRITEBYTECODE=1`` (this project's machines set it)
    has no ``.pyc`` files, so each fresh process compiles every module it imports from
    source: a module imported at first use (the tier's publisher, its size) cost a rank
    5 ms of its timed gets that no installed copy pays. Quick when nothing changed.
    """
    packages = [str(ROOT / d) for d in ("kcache", "client/kcache_client", "server/kcache_server")]
    subprocess.run([sys.executable, "-m", "compileall", "-q", *packages], check=True)


# Every benchmark measures the code as it is installed: compiled once, here.
compile_packages()

# Each run's servers make their own signing keys on ephemeral ports: pins of one run
# must not meet a later run's server on a reused port (kcache_client._trust). The
# benchmarks' clients pin in a file of their own run.
os.environ.setdefault(
    "KCACHE_KNOWN_SERVERS",
    str(Path(tempfile.mkdtemp(prefix="kcache-bench-pins-")) / "known_servers.json"),
)


def emit(
    bench: str, ours: float, anchor: float | None, unit: str, **extra: object
) -> dict[str, object]:
    """Print one figure as a JSON line; ratio is ours / anchor."""
    line: dict[str, object] = {
        "bench": bench,
        "ours": round(ours, 3),
        "anchor": None if anchor is None else round(anchor, 3),
        "ratio": None if not anchor else round(ours / anchor, 3),
        "unit": unit,
        **extra,
    }
    print(json.dumps(line), flush=True)
    return line


@contextlib.contextmanager
def kcache_server(workers: int = 1, data_dir: Path | None = None) -> Iterator[str]:
    """A real ``kcache serve`` on an ephemeral loopback port, SQLite in a temp data dir; its URL."""
    with contextlib.ExitStack() as stack:
        if data_dir is None:
            data_dir = Path(
                stack.enter_context(tempfile.TemporaryDirectory(prefix="kcache-bench-"))
            )
        env = {**os.environ, "KCACHE_DATA_DIR": str(data_dir)}
        subprocess.run([*KCACHE, "db", "upgrade"], env=env, check=True, capture_output=True)
        with ServerProcess(data_dir, workers=workers, env=env) as server:
            yield server.url


# The least any ASGI app can do under uvicorn: the same bytes, no routing, no lookup.
_BARE_APP = """
BODY = open(__file__.replace("bare_app.py", "bare_body"), "rb").read()
HEADERS = [(b"content-type", b"application/octet-stream"), (b"content-length", str(len(BODY)).encode())]

async def app(scope, receive, send):
    if scope["type"] == "http":
        await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
        await send({"type": "http.response.body", "body": BODY})
"""


def bare_app_command(directory: Path, body: bytes, port: int, workers: int = 1) -> list[str]:
    """The command serving ``body`` from a bare ASGI app under uvicorn on ``port`` (an anchor)."""
    (directory / "bare_app.py").write_text(_BARE_APP)
    (directory / "bare_body").write_bytes(body)
    return [
        *(sys.executable, "-m", "uvicorn", "--app-dir", str(directory), "bare_app:app"),
        *("--port", str(port), "--workers", str(workers), "--no-access-log"),
    ]


_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3}


def _proc_table() -> dict[int, tuple[int, str, float]]:
    """Every process: pid -> (parent pid, command line, user + system CPU seconds)."""
    tick = os.sysconf("SC_CLK_TCK")
    table: dict[int, tuple[int, str, float]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:  # gone meanwhile
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
        table[int(entry)] = (int(fields[1]), cmdline, (int(fields[11]) + int(fields[12])) / tick)
    return table


def tree_cpu_s(needle: str) -> float:
    """CPU seconds used so far by the processes whose command line holds ``needle``, and their children.

    A server's own cost per request, which a neighbour on the machine (or wrk beside it)
    changes far less than its requests per second.
    """
    table = _proc_table()
    roots = {pid for pid, (_, cmdline, _) in table.items() if needle in cmdline}
    tree, grew = set(roots), True
    while grew:
        children = {pid for pid, (parent, _, _) in table.items() if parent in tree} - tree
        tree |= children
        grew = bool(children)
    return sum(table[pid][2] for pid in tree)


def _ms(text: str) -> float:
    match = re.match(r"([\d.]+)(us|ms|s)", text)
    if not match:
        raise ValueError(text)
    return float(match.group(1)) * _UNITS[match.group(2)]


def wrk(
    url: str,
    *,
    connections: int = 32,
    seconds: int = 5,
    threads: int = 2,
    script: str | None = None,
) -> dict[str, float]:
    """Run wrk against ``url``; returns requests/s, p99 ms and non-2xx count."""
    if shutil.which("wrk") is None:
        raise RuntimeError("wrk is not installed (Debian package wrk)")
    cmd = ["wrk", "-t", str(threads), "-c", str(connections), "-d", f"{seconds}s", "--latency"]
    with contextlib.ExitStack() as stack:
        if script:
            lua = stack.enter_context(tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False))
            lua.write(script)
            lua.flush()
            cmd += ["-s", lua.name]
        out = subprocess.run([*cmd, url], capture_output=True, text=True, check=True).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    p99 = _ms(re.search(r"^\s+99%\s+(\S+)", out, re.MULTILINE).group(1))  # type: ignore[union-attr]
    bad = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    errors = re.search(r"Socket errors:.*", out)
    return {
        "rps": rps,
        "p99_ms": p99,
        "non_2xx": float(bad.group(1)) if bad else 0.0,
        "socket_errors": 1.0 if errors else 0.0,
    }


def curls_wall_ms(work: Path, urls: Sequence[Sequence[str]]) -> float:
    """One curl process per item of ``urls``, each fetching its URLs in order over one
    connection into a directory of its own under ``work`` (removed afterwards): ms from "go"
    until the last has exited.

    Measured as ours is (B8's and B12's ranks): every curl is started and waits, set up,
    until it is released (curl reads its whole config from stdin before its first
    transfer: :func:`_blocked_reading_stdin`), and its exit is seen the moment it happens,
    by a blocking ``waitpid``. ``Popen.wait(timeout=...)`` polls instead, sleeping 0.5 ms
    and doubling up to 50 ms, which rounded every anchor up to 7.5, 15.5, 31.5 or 63.5 ms
    (bench/RESULTS.md, eleventh session); a transfer that hangs is ended by curl's own
    ``--max-time``.
    """
    with tempfile.TemporaryDirectory(prefix="curls-", dir=work) as scratch:
        configs = []
        for n, fetched in enumerate(urls):
            out = Path(scratch) / str(n)
            out.mkdir()
            configs.append(
                "".join(
                    f'url = "{url}"\noutput = "{out / str(i)}"\n' for i, url in enumerate(fetched)
                )
            )
        return _released_curls_ms(configs)


def _released_curls_ms(configs: list[str]) -> float:
    """One curl per config, released together once all are set up: ms until the last exits."""
    procs = [
        subprocess.Popen(
            ["curl", "--silent", "--fail", "--max-time", "120", "--config", "-"],
            stdin=subprocess.PIPE,
            text=True,
        )
        for _ in configs
    ]
    _blocked_reading_stdin(procs)
    go = time.monotonic()
    for proc, config in zip(procs, configs, strict=True):
        assert proc.stdin is not None
        proc.stdin.write(config)
        proc.stdin.close()
    for proc in procs:
        if proc.wait() != 0:  # no timeout: a blocking waitpid (see above)
            raise RuntimeError(f"curl exited {proc.returncode}")
    return (time.monotonic() - go) * 1000.0


#: ``read``'s system call number, as ``/proc/PID/syscall`` gives it.
_READ_SYSCALL = {"x86_64": "0", "aarch64": "63"}


def _blocked_reading_stdin(procs: list[subprocess.Popen[str]], timeout: float = 30.0) -> None:
    """Return once each process waits in ``read(0, ...)`` (``/proc/PID/syscall``: the call's
    number and its first argument): started, set up and waiting for input."""
    read = _READ_SYSCALL.get(platform.machine())
    if read is None:
        time.sleep(0.5)  # another architecture: time enough to start (their exit is still exact)
        return
    deadline = time.monotonic() + timeout
    waiting = list(procs)
    while waiting:
        for proc in list(waiting):
            if proc.poll() is not None:
                raise RuntimeError(f"{proc.args} exited {proc.returncode} before its input")
            try:
                fields = Path(f"/proc/{proc.pid}/syscall").read_text().split()
            except OSError:
                fields = []
            if fields[:2] == [read, "0x0"]:
                waiting.remove(proc)
        if waiting:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{waiting[0].args} never waited for its input")
            time.sleep(0.001)


def post_json_lua(body: dict[str, object]) -> str:
    """A wrk script that POSTs ``body`` as JSON."""
    text = json.dumps(body).replace("\\", "\\\\").replace('"', '\\"')
    return (
        'wrk.method = "POST"\n'
        'wrk.headers["Content-Type"] = "application/json"\n'
        f'wrk.body = "{text}"\n'
    )
