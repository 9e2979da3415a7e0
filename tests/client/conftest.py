"""Fixtures for the client tests: a real ``kcache serve`` and a counting proxy in front of it."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # client_harness, warmup_worker

from client_harness import KcacheServer, Proxy, start_server


@pytest.fixture(scope="session")
def kserver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KcacheServer]:
    """One server for the session; tests use recipes of their own, so they do not interfere."""
    server = start_server(tmp_path_factory.mktemp("kserver") / "data")
    yield server
    server.stop()


@pytest.fixture
def proxy(kserver: KcacheServer) -> Iterator[Proxy]:
    """A counting, fault-injecting proxy in front of the session server, fresh per test."""
    p = Proxy(kserver.url)
    yield p
    p.close()
