"""Fixtures for the server tests: real uvicorn servers, real NVRTC, real SQLite and PostgreSQL."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
import uvicorn

PG_ADMIN_URL = os.environ.get(
    "KCACHE_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
KCACHE = str(Path(sys.executable).with_name("kcache"))


@pytest.fixture(scope="session", autouse=True)
def _shared_toolchain_dir() -> None:
    """One extracted NVRTC header tree for the whole run (servers and their workers inherit it)."""
    if not os.environ.get("KCACHE_TOOLCHAIN_DIR"):
        os.environ["KCACHE_TOOLCHAIN_DIR"] = str(
            Path(tempfile.gettempdir()) / "kcache-test-toolchains"
        )


def vector_add(tag: str, target: str = "sm_80") -> dict[str, Any]:
    """A small, fast, valid recipe; ``tag`` makes its key new."""
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


def unique(prefix: str = "t") -> str:
    """A tag no other test run uses."""
    return f"{prefix}-{uuid.uuid4().hex}"


class ServerThread:
    """``create_app(settings)`` served by a real uvicorn on an ephemeral loopback port, in a thread."""

    def __init__(self, settings: Any) -> None:
        from kcache_server import create_app
        from kcache_server.app import serving_app

        self.settings = settings
        self.app = create_app(settings)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            serving_app(self.app), log_level="warning", lifespan="on", timeout_graceful_shutdown=10
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [sock]}, daemon=True
        )
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)

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


@pytest.fixture
def make_settings(tmp_path: Path) -> Callable[..., Any]:
    """Settings for a test server in ``tmp_path/data`` (fast audit flushes, no auth cache)."""
    from kcache_server import Settings

    def make(**overrides: Any) -> Any:
        values: dict[str, Any] = {
            "data_dir": tmp_path / "data",
            "compile_workers": 1,
            "audit": {"flush_s": 0.05},
            "auth_cache_s": 0.0,
        }
        values.update(overrides)
        return Settings(**values)

    return make


@pytest.fixture
def serve() -> Iterator[Callable[[Any], ServerThread]]:
    """Start servers for a test; all are stopped at its end."""
    started: list[ServerThread] = []

    def start(settings: Any) -> ServerThread:
        server = ServerThread(settings)
        started.append(server)
        return server

    yield start
    for server in reversed(started):
        server.stop()


def _admin_engine() -> sa.Engine:
    return sa.create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A fresh PostgreSQL database for one test, dropped afterwards."""
    admin = _admin_engine()
    name = f"kcache_test_{uuid.uuid4().hex[:16]}"
    try:
        with admin.connect() as conn:
            conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    except sa.exc.OperationalError as exc:
        pytest.skip(f"PostgreSQL is not reachable at {PG_ADMIN_URL}: {exc}")
    url = sa.engine.make_url(PG_ADMIN_URL).set(database=name).render_as_string(hide_password=False)
    try:
        yield url
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def upgrade(url: str) -> None:
    """Bring a database to the head revision with the real command."""
    result = subprocess.run(
        [KCACHE, "db", "upgrade", "--db-url", url], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr


def free_port() -> int:
    """A port that was free a moment ago (for servers in other processes)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def audit_rows(url: str, **where: Any) -> list[Any]:
    """Rows of audit_events matching ``where``."""
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            query = "SELECT * FROM audit_events"
            if where:
                query += " WHERE " + " AND ".join(f"{k} = :{k}" for k in where)
            return list(conn.execute(sa.text(query), where).all())
    finally:
        engine.dispose()
