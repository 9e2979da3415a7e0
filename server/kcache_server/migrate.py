"""Alembic, driven from code: ``kcache db upgrade`` and the start-up schema check."""

from __future__ import annotations

import os
from pathlib import Path

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.engine import make_url

from kcache_server.errors import SchemaOutOfDateError

__all__ = [
    "alembic_config",
    "check_schema",
    "current_revisions",
    "has_tables",
    "head_revisions",
    "migrations_dir",
    "upgrade",
]


def migrations_dir() -> Path:
    """``$KCACHE_MIGRATIONS_DIR``, else ``migrations/`` at the repository root."""
    explicit = os.environ.get("KCACHE_MIGRATIONS_DIR")
    if explicit:
        return Path(explicit)
    return Path(__file__).resolve().parents[2] / "migrations"


def alembic_config(url: str) -> Config:
    """An Alembic config whose ``env.py`` will use ``url`` (not the ini file)."""
    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    cfg.attributes["db_url"] = url
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    """Run the migrations up to ``revision``."""
    command.upgrade(alembic_config(url), revision)


def head_revisions(url: str) -> set[str]:
    """The revisions this code needs."""
    return set(ScriptDirectory.from_config(alembic_config(url)).get_heads())


def current_revisions(engine: sa.Engine) -> set[str]:
    """The revisions the database is at (empty for a fresh database)."""
    with engine.connect() as conn:
        return set(MigrationContext.configure(conn).get_current_heads())


def has_tables(engine: sa.Engine) -> bool:
    """True when the database holds any table at all."""
    return bool(sa.inspect(engine).get_table_names())


def check_schema(engine: sa.Engine, url: str) -> None:
    """Raise :class:`SchemaOutOfDateError` unless the database is at the head revision."""
    need = head_revisions(url)
    have = current_revisions(engine)
    if have != need:
        where = make_url(url).render_as_string(hide_password=True)
        raise SchemaOutOfDateError(
            f"the database {where} is at revision {', '.join(sorted(have)) or '(none)'} but this "
            f"server needs {', '.join(sorted(need))}; run `kcache db upgrade` "
            "(with the same --db-url / KCACHE_DB_URL) and start the server again"
        )
