"""``scripts/ensure-services``' PostgreSQL step, on this machine and on two it simulates.

The script runs from a copy of the repository whose ``.venv`` already has the S3 server
and promtool (so only the PostgreSQL step can act), with stand-ins that record what it
asks of ``apt-get``:

- here, where PostgreSQL runs with a password-less ``postgres`` user and a database
  ``test``, it installs nothing and says nothing about PostgreSQL;
- on a machine without PostgreSQL where it is not root, it installs nothing and says in
  one line what the tests need;
- as root with apt but nothing listening on the port, it asks apt for Debian's
  ``postgresql`` (a stand-in that installs nothing, so the line follows too).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support import ROOT, free_port

NEEDS = (
    "ensure-services: the PostgreSQL tests skip: they need a PostgreSQL on 127.0.0.1:{port} "
    "whose postgres user connects from 127.0.0.1 without a password (trust) and a database "
    "test, or KCACHE_TEST_PG_URL"
)
# Enough of a system for the script to run, without any PostgreSQL program.
TOOLS = ("bash", "env", "awk", "sed", "cat", "dirname", "mktemp", "rm", "mkdir", "ls", "head")


def _repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy2(ROOT / "scripts" / "ensure-services", repo / "scripts" / "ensure-services")
    for tool in (".venv/s3-server/bin/moto_server", ".venv/prometheus/usr/bin/promtool"):
        (repo / tool).parent.mkdir(parents=True)
        (repo / tool).write_text("#!/bin/sh\n")
        (repo / tool).chmod(0o755)
    return repo


def _stand_ins(where: Path, uid: int, log: Path) -> Path:
    where.mkdir()
    (where / "id").write_text(f'#!/bin/sh\n[ "$1" = -u ] && echo {uid}\n')
    (where / "apt-get").write_text(f'#!/bin/sh\necho "$@" >>{log}\n')
    for name in ("id", "apt-get"):
        (where / name).chmod(0o755)
    return where


def _run(repo: Path, path: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k != "KCACHE_TEST_PG_URL"}
    return subprocess.run(
        [str(repo / "scripts" / "ensure-services")],
        env={**clean, "PATH": path, **env},
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )


def _bare_system(tmp_path: Path, uid: int, log: Path) -> str:
    """A PATH of the stand-ins and a few real tools: no psql, pg_ctlcluster, chromium, python3."""
    stand_ins = _stand_ins(tmp_path / "bin", uid, log)
    for tool in TOOLS:
        found = shutil.which(tool)
        assert found, tool
        (stand_ins / tool).symlink_to(found)
    return str(stand_ins)


def test_here_it_changes_nothing_for_postgresql(tmp_path: Path) -> None:
    psql = shutil.which("psql")
    ready = psql is not None and (
        subprocess.run(
            [psql, "-h", "127.0.0.1", "-U", "postgres", "-w", "-Atqc", "select 1", "test"],
            capture_output=True,
            check=False,
        ).returncode
        == 0
    )
    if not ready:
        pytest.skip("this machine's PostgreSQL is not the one the tests expect")
    log = tmp_path / "apt.log"
    stand_ins = _stand_ins(tmp_path / "bin", os.getuid(), log)
    done = _run(_repo(tmp_path), f"{stand_ins}{os.pathsep}{os.environ['PATH']}")
    assert done.returncode == 0, done.stderr
    assert "PostgreSQL" not in done.stderr, done.stderr
    assert "postgresql" not in (log.read_text() if log.exists() else "")


def test_without_postgresql_and_root_it_says_what_the_tests_need(tmp_path: Path) -> None:
    log = tmp_path / "apt.log"
    port = free_port()  # nothing listens there
    done = _run(
        _repo(tmp_path), _bare_system(tmp_path, 1000, log), ENSURE_SERVICES_PG_PORT=str(port)
    )
    assert done.returncode == 0, done.stderr
    assert NEEDS.format(port=port) in done.stderr.splitlines(), done.stderr
    assert not log.exists()  # not root: nothing was installed


def test_as_root_with_apt_it_installs_debians_postgresql(tmp_path: Path) -> None:
    log = tmp_path / "apt.log"
    port = free_port()
    done = _run(_repo(tmp_path), _bare_system(tmp_path, 0, log), ENSURE_SERVICES_PG_PORT=str(port))
    assert done.returncode == 0, done.stderr
    asked = log.read_text().splitlines()
    assert "install -y -qq --no-install-recommends postgresql" in asked, asked
    # The stand-in installed nothing: the tests' need is still said, in one line.
    assert NEEDS.format(port=port) in done.stderr.splitlines(), done.stderr
