"""Opening the database, and the schema check the server runs before it serves.

SQLite (the embedded default) runs in WAL mode with a busy timeout, so many
threads and a CLI can share it; PostgreSQL gets a connection pool sized for
advisory-lock holders plus index queries.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import make_url

__all__ = ["is_postgres", "is_sqlite", "open_database"]


def is_sqlite(engine: sa.Engine) -> bool:
    """True for SQLite."""
    return engine.dialect.name == "sqlite"


def is_postgres(engine: sa.Engine) -> bool:
    """True for PostgreSQL."""
    return engine.dialect.name == "postgresql"


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    try:
        # WAL lets readers run while one writer commits; the busy timeout makes
        # writers queue instead of failing with "database is locked".
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA busy_timeout=30000")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA synchronous=NORMAL")
    finally:
        cursor.close()


def open_database(url: str, *, pool_size: int = 16, max_overflow: int = 64) -> sa.Engine:
    """A SQLAlchemy engine for ``url`` (creating the SQLite file's directory)."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        engine = sa.create_engine(url, connect_args={"timeout": 30, "check_same_thread": False})
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    return sa.create_engine(url, pool_size=pool_size, max_overflow=max_overflow, pool_pre_ping=True)
