"""The start-up schema check tells a database at the head revision without importing Alembic.

:func:`kcache_server.migrate.script_head` reads the revision ids the migration scripts
assign; it must agree with Alembic on the shipped scripts, give up (None, so Alembic
decides) on anything but one linear chain, and a database anywhere but at the head
must still be refused with Alembic's answer.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from kcache_server import migrate
from kcache_server.db import open_database
from kcache_server.errors import SchemaOutOfDateError

from tests.support import ROOT


def test_the_scripts_head_is_alembics(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'kcache.db'}"
    heads = migrate.head_revisions(url)
    assert len(heads) == 1
    assert migrate.script_head() == heads.pop()


def test_a_database_at_the_head_is_checked_without_importing_alembic(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'kcache.db'}"
    migrate.upgrade(url)
    probe = (
        "import sys; from kcache_server import migrate; from kcache_server.db import open_database; "
        f"migrate.check_schema(open_database({url!r}), {url!r}); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'alembic'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert out.stdout.strip() == "[]"

    from alembic import command

    engine = open_database(url)
    command.downgrade(migrate.alembic_config(url), "-1")  # one revision behind the head
    assert migrate.current_revisions(engine) - migrate.head_revisions(url)
    with pytest.raises(SchemaOutOfDateError, match="run `kcache db upgrade`"):
        migrate.check_schema(engine, url)
    engine.dispose()


@pytest.fixture
def scripts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of the shipped migrations, used through ``$KCACHE_MIGRATIONS_DIR``; its versions dir."""
    copy = tmp_path / "migrations"
    shutil.copytree(migrate.migrations_dir(), copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setenv("KCACHE_MIGRATIONS_DIR", str(copy))
    assert migrate.script_head() is not None
    return copy / "versions"


def _script(versions: Path, name: str, body: str) -> None:
    (versions / name).write_text(f'"""A test script."""\n\n{body}\n')


def test_a_branch_is_left_to_alembic(scripts: Path) -> None:
    head = migrate.script_head()
    assert head is not None
    below = sorted(p.name.split("_")[0] for p in scripts.glob("*.py"))[-2]
    _script(scripts, "9000_branch.py", f'revision = "9000"\ndown_revision = "{below}"')
    assert migrate.script_head() is None  # two heads


def test_a_computed_revision_is_left_to_alembic(scripts: Path) -> None:
    head = migrate.script_head()
    _script(scripts, "9001_computed.py", f'revision = "90" + "01"\ndown_revision = "{head}"')
    assert migrate.script_head() is None


def test_a_repeated_revision_is_left_to_alembic(scripts: Path) -> None:
    head = migrate.script_head()
    assert head is not None
    first = sorted(scripts.glob(f"{head}_*.py"))[0]
    shutil.copy(first, scripts / f"{head}_again.py")
    assert migrate.script_head() is None


def test_a_script_alembic_would_skip_is_skipped_here_too(scripts: Path) -> None:
    head = migrate.script_head()
    _script(scripts, "__init__.py", 'revision = "ignored"')
    _script(scripts, "notes.txt", 'revision = "ignored"')
    assert migrate.script_head() == head
