"""Models and migrations agree, on SQLite and PostgreSQL; an old schema is refused at start-up."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from tests.support import KCACHE, ROOT, upgrade


def _agree(url: str) -> None:
    from kcache_server.migrate import alembic_config
    from kcache_server.models import metadata

    upgrade(url)
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            diff = compare_metadata(
                MigrationContext.configure(conn, opts={"compare_type": True}), metadata
            )
    finally:
        engine.dispose()
    assert diff == [], diff
    command.check(alembic_config(url))  # raises when autogenerate would write a migration
    # `alembic check` from the repository root, as CI runs it (URL from KCACHE_DB_URL).
    result = subprocess.run(
        [str(Path(KCACHE).with_name("alembic")), "-c", str(ROOT / "alembic.ini"), "check"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={"KCACHE_DB_URL": url, "PATH": "/usr/bin:/bin"},
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "No new upgrade operations detected" in result.stdout + result.stderr


def test_models_and_migrations_agree_on_sqlite(tmp_path: Path) -> None:
    _agree(f"sqlite:///{tmp_path / 'kcache.db'}")


@pytest.mark.postgres
def test_models_and_migrations_agree_on_postgres(pg_url: str) -> None:
    _agree(pg_url)


def _refused(settings: Any) -> None:
    from kcache_server import create_app
    from kcache_server.errors import SchemaOutOfDateError

    with pytest.raises(SchemaOutOfDateError, match="run `kcache db upgrade`"):
        create_app(settings)


def test_out_of_date_sqlite_is_refused_until_upgraded(make_settings: Any) -> None:
    settings = make_settings()
    upgrade(settings.database_url)
    from kcache_server.migrate import alembic_config

    command.downgrade(alembic_config(settings.database_url), "base")
    _refused(settings)
    current = subprocess.run(
        [KCACHE, "db", "current", "--data-dir", str(settings.data_dir)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert current.returncode == 1 and '"up_to_date": false' in current.stdout
    upgrade(settings.database_url)
    from kcache_server import create_app

    create_app(settings)


@pytest.mark.postgres
def test_empty_postgres_is_refused_until_upgraded(make_settings: Any, pg_url: str) -> None:
    settings = make_settings(db_url=pg_url)
    _refused(settings)  # never created implicitly: replicas must not race to migrate
    upgrade(pg_url)
    from kcache_server import create_app

    create_app(settings)
