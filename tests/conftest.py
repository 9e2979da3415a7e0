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
from tests.support import SLOW_RUNS, pg_database

#: Why a ``slow`` test did not run (the scheduled CI run is documented in the README).
SLOW_SKIPPED = "slow: runs with --slow (`scripts/test --slow`, CI's nightly run)"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--slow",
        action="store_true",
        default=False,
        help="also run the tests marked slow (CCCL/cub compiles, many processes) and the "
        "property runs at full size; without it each property run is a bounded, seeded sample",
    )


def pytest_configure(config: pytest.Config) -> None:
    """``--slow`` is told to the tests (tests.support.full_runs) and the processes they start."""
    if config.getoption("--slow"):
        os.environ[SLOW_RUNS] = "1"
    else:
        os.environ.pop(SLOW_RUNS, None)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--slow"):
        return
    skip = pytest.mark.skip(reason=SLOW_SKIPPED)
    for item in items:
        if item.get_closest_marker("slow") is not None:
            item.add_marker(skip)


def _one_signing_key() -> None:
    """One signing key for every server of the run, trusted by every client, and a pin file
    of the run's own; set when this file is imported, before any test module builds its
    settings (several do at import).

    Servers start on ephemeral ports, so a later server may get a port an earlier one
    had: with a key each, a client that pinned the first would (rightly) refuse the
    second. Clients are given the key (as a fleet's images would be), so no test's
    request count includes a first contact's ``GET /v1/keys``; tests of keys, pins and
    rotation give their servers and clients their own (tests/client/test_trust_chain.py).
    """
    from kcache.signing import SigningKey

    if os.environ.get("KCACHE_SIGNING_KEY_FILE"):
        return
    home = Path(tempfile.mkdtemp(prefix="kcache-test-trust-"))
    key = SigningKey.load_or_create(home / "signing-key.pem")
    os.environ["KCACHE_SIGNING_KEY_FILE"] = str(home / "signing-key.pem")
    os.environ["KCACHE_TRUSTED_KEYS"] = key.public_key
    os.environ["KCACHE_KNOWN_SERVERS"] = str(home / "known_servers.json")


_one_signing_key()


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
