"""What the tests and the benchmarks share: free ports, real kcache servers, small recipes, waiting.

Tests import it as ``tests.support``; the benchmarks run as ``python bench/x.py`` and put
the repository root on ``sys.path`` first. Fixtures live in the ``conftest.py`` files and
build on what is here; nothing here is a fixture.

Only the standard library and httpx are imported at module level, so a client-only
install (and a benchmark) can import this module; what needs the server's packages
(uvicorn, SQLAlchemy, ``kcache_server``) or pytest imports it where it is used.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

__all__ = [
    "KCACHE",
    "NEVER_FINISHES",
    "PG_ADMIN_URL",
    "ROOT",
    "VECTOR_ADD",
    "ServerProcess",
    "ServerThread",
    "answers_200",
    "audit_rows",
    "free_port",
    "never_finishes",
    "pg_database",
    "unique",
    "upgrade",
    "vector_add",
    "wait_until",
]

#: The repository root.
ROOT = Path(__file__).resolve().parents[1]
#: The console script a user runs (the venv's), not ``python -m``.
KCACHE = str(Path(sys.executable).with_name("kcache"))
#: A PostgreSQL role that may create databases; tests make their own databases under it.
PG_ADMIN_URL = os.environ.get(
    "KCACHE_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)


# ------------------------------------------------------------------------------ ports, names
def free_port() -> int:
    """A loopback port nobody listened on a moment ago (for servers in other processes).

    In-process servers bind port 0 themselves (:class:`ServerThread`), which cannot race.
    """
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def unique(prefix: str = "t") -> str:
    """A tag no other test run uses (put into a recipe, it makes the recipe's key new)."""
    return f"{prefix}-{uuid.uuid4().hex}"


# ------------------------------------------------------------------------------ recipes
#: A bounds-checked vector add, ``add(x, y, out, n)``: the core tests' and benchmarks' kernel.
VECTOR_ADD = """
extern "C" __global__ void add(const float* x, const float* y, float* out, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = x[i] + y[i];
}
"""

#: A template that never finishes instantiating: it runs into any compile time limit.
NEVER_FINISHES = (
    "template <int N, unsigned long long K> struct X {\n"
    "  enum : unsigned long long { v = X<N - 1, K * 2>::v + X<N - 1, K * 2 + 1>::v };\n"
    "};\n"
    "template <unsigned long long K> struct X<0, K> { enum : unsigned long long { v = K }; };\n"
    "__global__ void k(unsigned long long* o) { *o = X<60, 1>::v; }\n"
)


def vector_add(tag: str, target: str = "sm_80") -> dict[str, Any]:
    """A small, fast, valid recipe (kernel ``vadd``) as an API body; ``tag`` makes its key new."""
    return {
        "source": (
            f"// {tag}\n"
            'extern "C" __global__ void vadd(float* out, const float* a, const float* b, int n) {\n'
            "  int i = blockIdx.x * blockDim.x + threadIdx.x;\n"
            "  if (i < n) out[i] = a[i] + b[i];\n"
            "}\n"
        ),
        "target": target,
    }


def never_finishes(tag: str, target: str = "sm_80") -> dict[str, Any]:
    """A recipe of :data:`NEVER_FINISHES` as an API body; ``tag`` makes its key new."""
    return {"source": f"// {tag}\n{NEVER_FINISHES}", "target": target}


# ------------------------------------------------------------------------------ waiting
def wait_until(
    condition: Callable[[], object], what: str, timeout: float = 60.0, interval: float = 0.02
) -> None:
    """Return as soon as ``condition()`` is true; AssertionError naming ``what`` after ``timeout`` s.

    The timeout is a liveness bound (it fails only if the event never comes), not a timing.
    """
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


def answers_200(url: str) -> bool:
    """Whether ``url`` answers 200 right now (an unreachable server is a no, not an error)."""
    try:
        return httpx.get(url, timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def requests_counted(metrics: str, route: str, method: str, status: str) -> float:
    """``kcache_http_requests_total`` for one route, method and status, read from ``/metrics`` text."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = {"route": route, "method": method, "status": status}
    return sum(
        s.value
        for family in text_string_to_metric_families(metrics)
        if family.name == "kcache_http_requests"
        for s in family.samples
        if s.name.endswith("_total") and s.labels == wanted
    )


# ------------------------------------------------------------------------------ servers
class ServerThread:
    """``create_app(settings)`` served by a real uvicorn on an ephemeral loopback port, in a thread.

    For tests that look inside the server (its state, its settings); :class:`ServerProcess`
    runs the real ``kcache serve`` command instead.
    """

    def __init__(self, settings: Any) -> None:
        import uvicorn
        from kcache_server import create_app
        from kcache_server.app import serving_app
        from kcache_server.http_protocol import CoalescingHttpToolsProtocol

        self.settings = settings
        self.app = create_app(settings)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = int(sock.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            serving_app(self.app),
            log_level="warning",
            lifespan="on",
            timeout_graceful_shutdown=10,
            http=CoalescingHttpToolsProtocol,  # as `kcache serve` runs it
            access_log=settings.access_log,  # (with the access log on, it answers nothing itself)
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [sock]}, daemon=True
        )
        self.thread.start()
        try:
            wait_until(
                lambda: self.server.started or not self.thread.is_alive(),
                "the test server to start",
            )
        except AssertionError:
            self.stop()
            raise
        if not self.server.started:
            raise RuntimeError("the test server did not start (its thread ended)")

    @property
    def state(self) -> Any:
        """The app's ServerState."""
        return self.app.state.kcache

    def client(self, token: str | None = None, **kwargs: Any) -> httpx.Client:
        """A client for this server."""
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=120, **kwargs)

    def stop(self) -> None:
        """Graceful shutdown (workers stopped, audit flushed)."""
        self.server.should_exit = True
        self.thread.join(timeout=30)


class ServerProcess:
    """``kcache serve`` in its own process on a free loopback port; its output goes to ``log``.

    ``env`` replaces the environment (default: this process's); ``args`` are further
    ``serve`` flags. Use it as a context manager, or call :meth:`start` and :meth:`stop`.
    """

    def __init__(
        self,
        data_dir: Path,
        *,
        db_url: str | None = None,
        workers: int | None = None,
        env: Mapping[str, str] | None = None,
        args: Sequence[str] = (),
        log: Path | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.data_dir = data_dir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log or data_dir / f"serve-{self.port}.log"
        self.argv = [
            sys.executable,
            "-m",
            "kcache.cli",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--data-dir",
            str(data_dir),
            *(["--db-url", db_url] if db_url else []),
            *(["--workers", str(workers)] if workers is not None else []),
            *args,
        ]
        self.env = dict(os.environ if env is None else env)
        self.cwd = cwd
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60.0, ready: str = "/healthz") -> ServerProcess:
        """:meth:`launch`, then :meth:`wait_ready`."""
        self.launch()
        self.wait_ready(timeout, ready)
        return self

    def launch(self) -> None:
        """Start the process and return at once (start several, then wait for each)."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                self.argv, env=self.env, cwd=self.cwd, stdout=log, stderr=subprocess.STDOUT
            )

    def wait_ready(self, timeout: float = 60.0, ready: str = "/healthz") -> None:
        """Until ``ready`` answers 200; RuntimeError with the log's end if it exits or never does."""
        proc = self.proc
        assert proc is not None, "launch() first"
        try:
            wait_until(
                lambda: proc.poll() is not None or answers_200(self.url + ready),
                f"{self.url}{ready} to answer 200",
                timeout,
                interval=0.1,
            )
        except AssertionError as exc:
            self.stop()
            raise RuntimeError(f"{exc}; the server's log ends:\n{self.log_tail()}") from None
        if proc.poll() is not None:
            raise RuntimeError(
                f"kcache serve exited {proc.returncode}; its log ends:\n{self.log_tail()}"
            )

    def log_tail(self, chars: int = 3000) -> str:
        """The end of the server's output."""
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except FileNotFoundError:
            return ""

    def stop(self) -> None:
        """SIGTERM (a graceful shutdown: the audit is flushed), then SIGKILL if it lingers."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(15)

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


# ------------------------------------------------------------------------------ databases
def upgrade(url: str) -> None:
    """Bring a database to the head revision with the real command."""
    result = subprocess.run(
        [KCACHE, "db", "upgrade", "--db-url", url], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr


@contextlib.contextmanager
def pg_database(prefix: str = "kcache_test") -> Iterator[str]:
    """The URL of a new, empty PostgreSQL database, dropped afterwards.

    Skips the test where PostgreSQL is not reachable at :data:`PG_ADMIN_URL`.
    """
    import pytest
    import sqlalchemy as sa

    admin = sa.create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
    name = f"{prefix}_{uuid.uuid4().hex[:16]}"
    try:
        with admin.connect() as conn:
            conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    except sa.exc.OperationalError as exc:
        admin.dispose()
        pytest.skip(f"PostgreSQL is not reachable at {PG_ADMIN_URL}: {exc}")
    url = sa.engine.make_url(PG_ADMIN_URL).set(database=name).render_as_string(hide_password=False)
    try:
        yield url
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def audit_rows(url: str, **where: Any) -> list[Any]:
    """Rows of ``audit_events`` in the database at ``url`` matching ``where`` (column = value)."""
    import sqlalchemy as sa

    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            query = "SELECT * FROM audit_events"
            if where:
                query += " WHERE " + " AND ".join(f"{k} = :{k}" for k in where)
            return list(conn.execute(sa.text(query), where).all())
    finally:
        engine.dispose()
