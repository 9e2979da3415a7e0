"""``kcache stats`` explains itself (issue 45, leftovers): ``--help`` has a description and
``--group-by`` a help line, and the window's open end reads "now", not "any".

No server: ``kcache stats --data-dir`` reads a database made by ``kcache db upgrade``.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.support import KCACHE


def _kcache(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([KCACHE, *args], capture_output=True, text=True, check=False, timeout=300)


def test_stats_help_describes_the_command_and_group_by() -> None:
    result = _kcache("stats", "--help")
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    assert "What a kcache server saw in a window (default the last 24 hours)" in text
    group_by = text.split("--group-by {kernel,target,client,job,rank}")[-1]
    assert group_by.lstrip().startswith("one row per job (default), kernel, target"), group_by


def test_the_window_ends_now_not_any(tmp_path: Path) -> None:
    data = tmp_path / "data"
    made = _kcache("db", "upgrade", "--data-dir", str(data))
    assert made.returncode == 0, made.stderr
    result = _kcache("stats", "--data-dir", str(data), "--since", "1h")
    assert result.returncode == 0, result.stderr
    (window,) = [line for line in result.stdout.splitlines() if line.startswith("window")]
    assert window.endswith(" .. now"), window
    assert "any" not in window
    everything = _kcache("stats", "--data-dir", str(data), "--since", "0")
    (window,) = [line for line in everything.stdout.splitlines() if line.startswith("window")]
    assert window.split(maxsplit=1)[1] == "the first record kept .. now", window
