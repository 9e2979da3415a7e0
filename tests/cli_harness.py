"""Running the ``kcache`` command as a user would: a real process, a clean environment.

Shared by the tests of the command line, the README's examples and the deploy files.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from tests.support import KCACHE, answers_200, wait_until

__all__ = ["PROGRESS", "STILL", "Served", "assert_user_error", "error_lines", "kcache", "user_env"]

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
        try:
            wait_until(
                lambda: self.proc.poll() is not None or answers_200(url),
                f"{url} to answer 200",
                timeout,
                interval=0.1,
            )
        except AssertionError as exc:
            self.stop()
            raise AssertionError(f"{exc}: {self.log.read_text(errors='replace')[-3000:]}") from None
        if self.proc.poll() is not None:
            raise AssertionError(
                f"exited {self.proc.returncode}: {self.log.read_text(errors='replace')[-3000:]}"
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
