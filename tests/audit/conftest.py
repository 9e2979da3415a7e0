"""Fixtures for the auditing tests: one real server after the scripted workload, per module.

The workload and its account are in :mod:`tests.audit.workload`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from kcache_server import migrate
from kcache_server.db import open_database

from tests.audit.workload import Workload, run_workload
from tests.support import ROOT, ServerThread


@pytest.fixture(scope="module")
def workload(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Workload]:
    """A real server on SQLite after the scripted workload (stopped after the module)."""
    from kcache_server import Settings

    data = tmp_path_factory.mktemp("audit") / "data"
    settings = Settings(data_dir=data, compile_workers=1, audit={"flush_s": 0.05}, auth_cache_s=0.0)
    server = ServerThread(settings)
    try:
        yield run_workload(server)
    finally:
        server.stop()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def engine(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[sa.Engine]:
    """A database of each kind at the head revision (a module may define its own)."""
    url = (
        f"sqlite:///{tmp_path / 'audit.db'}"
        if request.param == "sqlite"
        else request.getfixturevalue("pg_url")
    )
    migrate.upgrade(url)
    db = open_database(url)
    yield db
    db.dispose()


@pytest.fixture(scope="session")
def artifacts_dir() -> Path:
    """``test-artifacts/`` at the repository root (gitignored): screenshots land here."""
    artifacts = ROOT / "test-artifacts"
    artifacts.mkdir(exist_ok=True)
    return artifacts
