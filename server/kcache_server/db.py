"""Opening the database, and noticing when its disk is full or its file vanishes.

SQLite (the embedded default) runs in WAL mode with a busy timeout, so many
threads and a CLI can share it; PostgreSQL gets a connection pool sized for
advisory-lock holders plus index queries. On both, a statement that fails because
the disk is full raises :class:`~kcache.errors.StoreFullError` (507) instead of the
driver's error, and a database that cannot be reached (connecting fails, or a connection
is lost: PostgreSQL restarted, the network cut, the database closed to connections)
raises :class:`~kcache_server.errors.DatabaseUnavailableError` (503 + Retry-After):
one translation at the boundary, for every caller. The pool reconnects by itself
(pre-ping), so the first statement after the database is back succeeds.
"""

from __future__ import annotations

import errno
import logging
import os
import sqlite3
import threading
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import make_url

from kcache.errors import StoreFullError
from kcache.fsutil import is_disk_full
from kcache_server.errors import DatabaseUnavailableError

__all__ = ["DatabaseFile", "is_postgres", "is_sqlite", "open_database", "sqlite_path"]

log = logging.getLogger(__name__)

#: PostgreSQL's SQLSTATE for "disk full".
_PG_DISK_FULL = "53100"


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


def _disk_full(exc: BaseException) -> bool:
    if isinstance(exc, sqlite3.Error):
        return getattr(
            exc, "sqlite_errorcode", None
        ) == sqlite3.SQLITE_FULL or "disk is full" in str(exc)
    return getattr(exc, "sqlstate", None) == _PG_DISK_FULL or is_disk_full(exc)


def _unreachable(context: Any) -> bool:
    """Whether the failure is the database being out of reach, not a statement being refused.

    A connect that failed (no connection yet) or a connection the dialect reports lost.
    A failed pre-ping is left alone: the pool reconnects after it, and only if that
    connect fails is the database unavailable.
    """
    if context.is_pre_ping:
        return False
    return bool(context.is_disconnect) or context.connection is None


def _translate(context: Any) -> None:
    """``handle_error`` hook: disk full -> StoreFullError, out of reach -> DatabaseUnavailableError.

    SQLAlchemy has cleaned up (and invalidated a lost connection) by the time this runs.
    """
    if not _disk_full(context.original_exception) and _unreachable(context):
        # Not logged here (a command reports it in its own words); the server logs the
        # driver's error with each 503 it answers (errors.error_body).
        exc = context.sqlalchemy_exception or context.original_exception
        raise DatabaseUnavailableError(
            "the database cannot be reached right now; kernels this server holds in memory are "
            "still served. Retry in a few seconds (the server log has the driver's error)",
            driver_error=exc,
        ) from exc
    _translate_disk_full(context)


def _translate_disk_full(context: Any) -> None:
    """A full disk becomes StoreFullError."""
    if _disk_full(context.original_exception):
        log.error(
            "a database statement failed because the disk is full: %s", context.original_exception
        )
        raise StoreFullError(
            errno.ENOSPC,
            "the database has no space left on its disk; nothing was written. Free some space "
            "(`kcache db gc` removes unreferenced blobs) and retry",
        )


def sqlite_path(url: str) -> Path | None:
    """The file a SQLite URL names (None for PostgreSQL or an in-memory database)."""
    parsed = make_url(url)
    if (
        parsed.get_backend_name() != "sqlite"
        or not parsed.database
        or parsed.database == ":memory:"
    ):
        return None
    return Path(parsed.database)


def open_database(url: str, *, pool_size: int = 16, max_overflow: int = 64) -> sa.Engine:
    """A SQLAlchemy engine for ``url`` (creating the SQLite file's directory)."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        path = sqlite_path(url)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
        engine = sa.create_engine(url, connect_args={"timeout": 30, "check_same_thread": False})
        event.listen(engine, "connect", _sqlite_pragmas)
    else:
        engine = sa.create_engine(
            url, pool_size=pool_size, max_overflow=max_overflow, pool_pre_ping=True
        )
    event.listen(engine, "handle_error", _translate)
    return engine


class DatabaseFile:
    """The SQLite file a server opened, watched for being deleted or replaced under it.

    Open connections keep working on a deleted file (the inode lives on), so nothing
    fails at once, but every row written from then on is lost at the next restart.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        st = path.stat()
        self._identity = (st.st_dev, st.st_ino)
        self._reported = False
        self._lock = threading.Lock()

    def problem(self) -> str | None:
        """None while the file is the one opened; else what happened and what to do (logged once)."""
        try:
            st = os.stat(self.path)
            problem = (
                None
                if (st.st_dev, st.st_ino) == self._identity
                else "the SQLite database file was replaced while the server runs"
            )
        except FileNotFoundError:
            problem = "the SQLite database file was deleted while the server runs"
        if problem is None:
            return None
        problem += (
            "; rows written from now on are lost at the next restart. Restore the file from a backup "
            "(or restart with --recreate-index to index the stored blobs again) and restart"
        )
        with self._lock:
            first, self._reported = not self._reported, True
        if first:
            log.error("%s (%s)", problem, self.path)
        return problem
