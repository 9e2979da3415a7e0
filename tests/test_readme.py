"""The README's examples, run as written against a real server (doctest-style).

The examples are the README's fenced ``sh`` and ``python`` blocks. The server is
started by the README's own ``scripts/serve`` line (plus ``--port`` of a free port;
the data directory in a temporary one through ``KCACHE_DATA_DIR``). The shell examples
then run as one terminal session would, in a scratch directory holding the
repository's ``.venv``, with the README's ``http://127.0.0.1:8470`` pointing at that
server; a line whose comment shows ``{"status": "X", ...}`` must print a JSON line with
that status, in that order. The Python example runs next, in the same directory,
without its one line marked "GPU only" (there is no GPU here). ``scripts/test`` is this
test suite: it is checked to be there, not run from inside itself.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.cli_harness import user_env
from tests.support import ROOT, ServerProcess

README = ROOT / "README.md"
URL_IN_README = "http://127.0.0.1:8470"


def _blocks(language: str) -> list[str]:
    text = README.read_text(encoding="utf-8")
    return [m.group(1) for m in re.finditer(rf"^```{language}\n(.*?)^```$", text, re.M | re.S)]


def _setup_is_current() -> bool:
    """Whether ``scripts/setup`` would return at once (it says so itself, installing nothing)."""
    check = subprocess.run([str(ROOT / "scripts" / "setup"), "--check"], check=False)
    return check.returncode == 0


@dataclass
class Session:
    """The scratch directory, the server the README started, and the shell examples' run."""

    workdir: Path
    url: str
    shell: subprocess.CompletedProcess[str]


def _without_venv_on_path(env: dict[str, str]) -> dict[str, str]:
    # The README's own `export PATH=...` must be what finds `kcache`.
    bin_dir = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p != bin_dir)
    return env


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Session]:
    workdir = tmp_path_factory.mktemp("readme")
    (workdir / ".venv").symlink_to(ROOT / ".venv")
    serve_line = _blocks("sh")[0].strip()
    assert serve_line == "scripts/serve", "the README's first command starts the service"
    data = workdir / "server-data"
    if _setup_is_current():  # as written; otherwise its set-up would reinstall first
        serve = [str(ROOT / serve_line)]
    else:
        serve = [str(ROOT / ".venv" / "bin" / "kcache"), "serve"]
    server = ServerProcess(
        data,
        env=user_env(workdir, KCACHE_DATA_DIR=str(data)),
        cwd=ROOT,
        log=workdir / "serve.log",
        command=lambda port: [*serve, "--port", str(port)],
    )
    url = server.url
    try:
        server.start(timeout=90, ready="/readyz")
        script = "\n".join(_blocks("sh")[2:]).replace(URL_IN_README, url)
        shell = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", script],
            cwd=workdir,
            env=_without_venv_on_path(user_env(workdir)),
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        yield Session(workdir, url, shell)
    finally:
        server.stop()


def test_the_two_commands_are_the_scripts() -> None:
    serve, test = (block.strip() for block in _blocks("sh")[:2])
    assert (serve, test) == ("scripts/serve", "scripts/test")
    assert os.access(ROOT / test, os.X_OK)  # run by CI; running it from here would recurse
    assert "8000" not in (ROOT / serve).read_text()  # its comment names the real port


def test_the_shell_examples_print_what_their_comments_say(session: Session) -> None:
    script = "\n".join(_blocks("sh")[2:])
    expected = re.findall(r'# \{"status": "(\w+)"', script)
    assert len(expected) >= 5
    assert session.shell.returncode == 0, session.shell.stderr
    printed = [
        json.loads(line)["status"]
        for line in session.shell.stdout.splitlines()
        if line.startswith("{") and '"status"' in line
    ]
    assert printed == expected, session.shell.stdout
    assert (session.workdir / "add.cubin").read_bytes()[:4] == b"\x7fELF"
    assert re.search(r"^[0-9a-f]{64}$", session.shell.stdout, re.M)  # `kcache key`
    assert "lookups" in session.shell.stdout  # `kcache stats`
    assert "Traceback" not in session.shell.stderr


def test_the_python_example_runs_as_written(session: Session) -> None:
    (block,) = _blocks("python")
    gpu_only = [line for line in block.splitlines() if "GPU only" in line]
    assert len(gpu_only) == 1 and ".load()" in gpu_only[0] and "[gpu]" in gpu_only[0]
    code = "\n".join(line for line in block.splitlines() if "GPU only" not in line)
    assert (session.workdir / "add.cu").exists(), session.shell.stderr  # the shell example made it
    env = user_env(session.workdir, KCACHE_URL=session.url)
    run = subprocess.run(
        [sys.executable, "-c", code],
        cwd=session.workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    digest, path = run.stdout.split()
    assert re.fullmatch(r"[0-9a-f]{64}", digest)
    assert hashlib.sha256(Path(path).read_bytes()).hexdigest() == digest
    assert Path(path).is_relative_to(session.workdir / "cache")  # the user's cache directory


def test_the_install_lines_need_no_release_on_pypi() -> None:
    """The distributions are not on PyPI: each install line builds from the clone or takes the
    wheels built from it (``tests/test_packaging.py`` runs them), and names the distributions
    by their own names (``kcache`` on PyPI is another project)."""
    text = README.read_text(encoding="utf-8")
    section = text.split("\n## Install\n", 1)[1].split("\n## ", 1)[0]
    lines = re.findall(r"^pip .*$", section, re.M)
    assert len(lines) >= 7, lines
    for line in lines:
        words = line.split("#", 1)[0].split()
        if words[1] == "wheel":
            assert words[-3:] == ["./", "./client", "./server"], line
        elif "--find-links" in words:
            assert words[2:4] == ["--find-links", "dist"], line
            assert words[4].strip('"').split("[")[0] in ("kcache-client", "kcache-server"), line
        else:
            assert all(w.startswith("./") for w in words[2:]), line
    for name in ("kcache-core", "kcache-client", "kcache-server"):
        assert f"`{name}`" in section, name


def test_nothing_in_the_repository_points_at_documents_it_does_not_hold() -> None:
    """A clone must stand on its own: no reference to the planning documents
    kept outside the repository (four such references were found, one of them in the
    published OpenAPI description)."""
    outside = ("ARCHI" + "TECTURE", "../" + "shared", "BENCH" + "MARKS.md", "STY" + "LE.md")
    tracked = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.split(b"\0")
    found = []
    for name in filter(None, tracked):
        path = ROOT / name.decode()
        if path.suffix not in {".py", ".md", ".yaml", ".yml", ".toml", ".html", ".js", ".json", ""}:
            continue
        try:
            text = path.read_text()
        except (UnicodeDecodeError, IsADirectoryError, FileNotFoundError):
            continue
        found += [f"{name.decode()}: {word}" for word in outside if word in text]
    assert found == []
