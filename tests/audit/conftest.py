"""Fixtures for the auditing tests: one real server after the scripted workload, per module,
and one headless Chromium per module for the dashboard's tests.

The workloads and their accounts are in :mod:`tests.audit.workload`,
:mod:`tests.audit.kernel_workload` and :mod:`tests.audit.foreign_workload`. Chromium is Debian's (``apt-get install chromium``),
driven by Playwright's Python package; Playwright never downloads a browser here.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from kcache_server import migrate
from kcache_server.db import open_database

from tests.audit.foreign_workload import ForeignWorkload, run_foreign_workload
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


@pytest.fixture(scope="module")
def foreign_workload(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ForeignWorkload]:
    """A real server on SQLite after the foreign workload (stopped after the module)."""
    from kcache_server import Settings

    data = tmp_path_factory.mktemp("audit-foreign") / "data"
    settings = Settings(data_dir=data, compile_workers=1, audit={"flush_s": 0.05}, auth_cache_s=0.0)
    server = ServerThread(settings)
    try:
        yield run_foreign_workload(server)
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


CHROMIUM = os.environ.get("KCACHE_TEST_CHROMIUM", "/usr/bin/chromium")
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def chromium_installed() -> bool:
    """Whether the dashboard's tests can run (a module skips without it)."""
    return os.path.exists(CHROMIUM) or shutil.which("chromium") is not None


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """One headless Chromium for the module."""
    os.environ.setdefault("PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD", "1")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture
def console_errors() -> list[str]:
    """What the page logs as errors; a test that provokes one removes it."""
    return []


@pytest.fixture
def page(browser: Any, console_errors: list[str]) -> Iterator[Any]:
    """A fresh page at a desktop size; fails the test on any script error."""
    context = browser.new_context(viewport={"width": 1440, "height": 1100}, device_scale_factor=1)
    page = context.new_page()
    errors = console_errors
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    yield page
    context.close()
    assert errors == [], f"the dashboard logged errors: {errors}"
