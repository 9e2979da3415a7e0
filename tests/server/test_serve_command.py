"""``kcache serve`` says what it does and why it cannot (issue 45, messages).

- ``serve --help`` has the compile-worker and timeout options and lists every
  ``KCACHE_*`` setting with its default and description, made from ``Settings`` (the
  README pointed at settings.py); the two flags are honoured.
- A second ``kcache serve`` on a busy port used to print "serving ... the dashboard is
  at ..." and then fail with uvicorn's ``address already in use``: now one line naming
  the port, ``--port`` and ``KCACHE_PORT``, and nothing announced.

One real ``kcache serve`` for the module (started with the two flags), the port the
second one is refused.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support import KCACHE, ServerProcess, never_finishes, unique


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    data = tmp_path_factory.mktemp("serve-command") / "data"
    running = ServerProcess(data, args=["--compile-workers", "1", "--compile-timeout", "3"])
    with running:
        yield running


def _kcache(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [KCACHE, *args], capture_output=True, text=True, check=False, timeout=300, cwd=cwd
    )


def test_serve_help_has_the_compile_options_and_every_setting() -> None:
    from kcache_server.settings import settings_variables

    result = _kcache("serve", "--help")
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert "--compile-workers N" in text and "--compile-timeout SECONDS" in text
    flat = " ".join(text.split())  # descriptions are wrapped
    variables = settings_variables()
    assert len(variables) > 50
    for variable, default, description in variables:
        assert f"{variable} (default {default})" in text, variable
        assert " ".join(description.split()) in flat, variable
    for expected in ("KCACHE_COMPILE_WORKERS", "KCACHE_COMPILE_TIMEOUT_S", "KCACHE_AUDIT_FLUSH_S"):
        assert expected in text


def test_the_compile_flags_are_honoured(server: ServerProcess) -> None:
    with httpx.Client(base_url=server.url, timeout=120) as http:
        ready = http.get("/readyz").json()
        assert ready["checks"]["compile_workers"] == "ok (1 running)", ready
        stuck = http.post("/v1/resolve", json={"recipe": never_finishes(unique())})
    assert stuck.status_code == 422 and stuck.json()["error"] == "compile_timeout", stuck.text
    assert "limit of 3s" in stuck.json()["detail"]


def test_a_second_serve_on_a_busy_port_says_so_in_one_line(
    server: ServerProcess, tmp_path: Path
) -> None:
    result = _kcache(
        "serve", "--port", str(server.port), "--data-dir", str(tmp_path / "second"), cwd=tmp_path
    )
    assert result.returncode == 1, (result.stdout, result.stderr)
    lines = (result.stdout + result.stderr).strip().splitlines()
    assert len(lines) == 1, lines
    (line,) = lines
    assert f"127.0.0.1:{server.port}" in line and "in use" in line, line
    assert "--port" in line and "KCACHE_PORT" in line, line
    assert "serving" not in line and "dashboard" not in line
    assert not (tmp_path / "second").exists()  # nothing was built before the refusal
    with httpx.Client(base_url=server.url) as http:  # the first one is untouched
        assert http.get("/healthz").status_code == 200
