"""Fixtures shared by the whole test tree: the real toolchain and fresh PostgreSQL databases.

Helpers (ports, servers, recipes) are in :mod:`tests.support`; this file holds fixtures only.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kcache.toolchain import Toolchain, load_toolchain
from tests.support import pg_database


@pytest.fixture(scope="session", autouse=True)
def _shared_toolchain_dir() -> None:
    """One extracted NVRTC header tree for the whole run (servers, workers and commands inherit it)."""
    if not os.environ.get("KCACHE_TOOLCHAIN_DIR"):
        os.environ["KCACHE_TOOLCHAIN_DIR"] = str(
            Path(tempfile.gettempdir()) / "kcache-test-toolchains"
        )


@pytest.fixture(scope="session")
def toolchain(_shared_toolchain_dir: None) -> Toolchain:
    """The real NVRTC/nvJitLink toolchain with its bundled headers (installed once)."""
    return load_toolchain()


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A fresh PostgreSQL database for one test, dropped afterwards (a skip where none runs)."""
    with pg_database() as url:
        yield url
