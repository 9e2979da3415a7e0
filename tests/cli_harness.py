"""Running the ``kcache`` command as a user would: a real process, a clean environment.

Shared by the tests of the command line, the README's examples and the deploy files.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: The console script a user runs (the venv's), not ``python -m``.
KCACHE = str(Path(sys.executable).with_name("kcache"))
#: Lines a command prints while it waits; they are progress, not the error's text.
PROGRESS = "kcache: waiting for the server"


def free_port() -> int:
    """A loopback port nobody listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


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
    """``kcache ARGS`` to completion, output captured."""
    return subprocess.run(
        [KCACHE, *args],
        env=dict(env),
        cwd=cwd,
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
        if line and not line.startswith(PROGRESS)
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


class Served:
    """A long-running command (a server) started from an argument list, stopped at the end."""

    def __init__(
        self, argv: Sequence[str], *, env: Mapping[str, str], cwd: Path, log: Path
    ) -> None:
        self.log = log
        self._log_file = log.open("ab")
        self.proc = subprocess.Popen(
            list(argv), env=dict(env), cwd=cwd, stdout=self._log_file, stderr=subprocess.STDOUT
        )

    def wait_ready(self, url: str, timeout: float = 90.0) -> None:
        """Until ``url`` answers 200 (a liveness bound, not a timing: it fails only if it never does)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"exited {self.proc.returncode}: {self.log.read_text(errors='replace')[-3000:]}"
                )
            try:
                with urllib.request.urlopen(url, timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.1)
        self.stop()
        raise AssertionError(
            f"{url} did not answer 200 within {timeout}s: {self.log.read_text()[-3000:]}"
        )

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it lingers."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(15)
        self._log_file.close()
