"""Running the ``kcache`` command as a user would: a real process, a clean environment.

Shared by the tests of the command line, the README's examples and the deploy files;
the servers they talk to are :class:`tests.support.ServerProcess`.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping
from pathlib import Path

from tests.support import KCACHE

__all__ = ["PROGRESS", "STILL", "assert_user_error", "error_lines", "kcache", "user_env"]

#: Lines a command prints while it waits; they are progress, not the error's text.
PROGRESS = "kcache: waiting for the server"
#: ... and the status lines of a long compile (kcache._waiting.STATUS_PREFIX).
STILL = "kcache: still "


def user_env(home: Path, **extra: str) -> dict[str, str]:
    """The environment of a user with no kcache settings, whose cache directory is under ``home``.

    The shared NVRTC header tree (``KCACHE_TOOLCHAIN_DIR``) is kept: extracting it
    again for every command would only cost time.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("KCACHE_")}
    if os.environ.get("KCACHE_TOOLCHAIN_DIR"):
        env["KCACHE_TOOLCHAIN_DIR"] = os.environ["KCACHE_TOOLCHAIN_DIR"]
    env["KCACHE_CACHE_DIR"] = str(home / "cache")
    env.update(extra)
    return env


def kcache(
    *args: str,
    env: Mapping[str, str],
    cwd: Path | None = None,
    timeout: float = 120,
) -> subprocess.CompletedProcess[str]:
    """``kcache ARGS`` to completion, output captured, stdin empty (no terminal to ask on)."""
    return subprocess.run(
        [KCACHE, *args],
        env=dict(env),
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def error_lines(result: subprocess.CompletedProcess[str]) -> list[str]:
    """The lines of stderr that tell the error (progress lines left out)."""
    return [
        line
        for line in result.stderr.strip().splitlines()
        if line and not line.startswith((PROGRESS, STILL))
    ]


def assert_user_error(result: subprocess.CompletedProcess[str], *names: str) -> list[str]:
    """A user's mistake: non-zero exit, one or two lines, no traceback, naming each of ``names``."""
    lines = error_lines(result)
    assert result.returncode != 0, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    assert 1 <= len(lines) <= 2, result.stderr
    text = "\n".join(lines)
    for name in names:
        assert name in text, f"{name!r} not named in: {text}"
    return lines
