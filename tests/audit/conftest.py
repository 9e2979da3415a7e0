"""Fixtures for the auditing tests: one real server after the scripted workload, per module.

The workload and its account are in :mod:`tests.audit.workload`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

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


@pytest.fixture(scope="session")
def artifacts_dir() -> Path:
    """``test-artifacts/`` at the repository root (gitignored): screenshots land here."""
    artifacts = ROOT / "test-artifacts"
    artifacts.mkdir(exist_ok=True)
    return artifacts
