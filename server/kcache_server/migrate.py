"""Alembic, driven from code: ``kcache db upgrade``, the start-up schema check, a lost index.

A data directory whose blobs outlived their database (the SQLite file deleted, a
new PostgreSQL database) is refused at start-up: creating an empty index silently
would make every blob look unreferenced to ``kcache db gc``. ``--recreate-index``
creates the schema and indexes the blobs again (:meth:`SqlIndex.recover`).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.engine import make_url

from kcache.store.local import LocalArtifactStore
from kcache_server.db import is_sqlite, sqlite_path
from kcache_server.errors import IndexMissingError, SchemaOutOfDateError
from kcache_server.index import SqlIndex
from kcache_server.settings import Settings

__all__ = [
    "alembic_config",
    "check_schema",
    "current_revisions",
    "has_tables",
    "head_revisions",
    "migrations_dir",
    "prepare_database",
    "upgrade",
]

log = logging.getLogger(__name__)


def migrations_dir() -> Path:
    """``$KCACHE_MIGRATIONS_DIR`` when set (an override), else the ``migrations/`` shipped in this package."""
    explicit = os.environ.get("KCACHE_MIGRATIONS_DIR")
    if explicit:
        return Path(explicit)
    # Package data beside this module, so an installed (non-editable) server finds them too.
    return Path(__file__).resolve().parent / "migrations"


def alembic_config(url: str) -> Config:
    """An Alembic config whose ``env.py`` will use ``url`` (not the ini file)."""
    # Alembic's default stdout is whatever sys.stdout was when alembic was first imported
    # (it is imported lazily now): give it the current one.
    cfg = Config(stdout=sys.stdout)
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


def prepare_database(settings: Settings, engine: sa.Engine) -> None:
    """Make the database ready to serve, or refuse with what to do.

    A database without tables is created at the head revision when it is SQLite and
    the store is empty (a first start); with blobs in the store it is refused
    (:class:`IndexMissingError`) unless ``settings.recreate_index``, which creates it
    and adds a recovered row for every blob that verifies. Then the schema must be
    at the head revision (:class:`SchemaOutOfDateError` otherwise).
    """
    url = settings.database_url
    path = sqlite_path(url)
    # Looking at a missing SQLite file through the engine would create it: check first.
    empty = (path is not None and not path.exists()) or not has_tables(engine)
    if empty:
        store = LocalArtifactStore(settings.data_dir)
        blobs = sum(1 for _ in store.digests())
        if settings.recreate_index:
            upgrade(url)
            added, corrupt = SqlIndex(engine).recover(store)
            log.warning(
                "recreated the index of %s: %d blobs indexed again (%d corrupt ones quarantined); their "
                "recipes are not known, so each recipe compiles once more",
                settings.data_dir,
                added,
                corrupt,
            )
        elif blobs:
            where = (
                f"the SQLite file {path} is missing or empty"
                if path
                else "the database has no tables"
            )
            raise IndexMissingError(
                f"the data directory {settings.data_dir} holds {blobs} blobs but {where}: the index of this "
                "store was lost (or --db-url / KCACHE_DB_URL names another database). Restore the database "
                "from a backup and start again, or start once with `kcache serve --recreate-index` "
                "(KCACHE_RECREATE_INDEX=1) to create an empty index that keeps and indexes the blobs; recipes "
                "cannot be recovered from blobs, so each compiles once more. Run no `kcache db gc` before that"
            )
        elif is_sqlite(engine):
            upgrade(url)  # the embedded default starts from nothing: create it
    elif settings.recreate_index:
        log.info("--recreate-index ignored: the database already has its tables")
    check_schema(engine, url)
