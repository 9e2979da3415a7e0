"""Fixtures for the server tests: settings for a test server, and servers stopped at a test's end.

The servers themselves, recipes and database helpers are in :mod:`tests.support`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import ServerThread


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
    # Every server is stopped before any is failed for a traceback in its log.
    failures: list[AssertionError] = []
    for server in reversed(started):
        try:
            server.stop()
        except AssertionError as exc:
            failures.append(exc)
    if failures:
        raise failures[0]
