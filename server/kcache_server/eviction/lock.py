"""One evictor at a time across replicas: a PostgreSQL advisory lock, or on SQLite a file lock."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.exc import DBAPIError

from kcache.locks import try_file_lock
from kcache_server.db import is_postgres

__all__ = ["EvictorLock"]

# pg_advisory_lock(int, int): a key space apart from the per-recipe compile locks (one bigint).
_PG_LOCK = (0x6B63, 0x45564943)  # "kc", "EVIC"


class EvictorLock:
    """The lock that lets one process at a time evict: PostgreSQL advisory lock, else a file lock.

    Unlike the compile locks it guards more than duplicate work: eviction log rows are
    inserted only under it, so they commit in ``id`` order and every replica reading
    the log by ``id`` sees each of them.
    """

    def __init__(self, db: sa.Engine, data_dir: Path) -> None:
        self.db = db
        self.path = data_dir / "locks" / "evictor.lock"
        self._local = threading.Lock()

    @contextlib.contextmanager
    def hold(self, wait_s: float) -> Iterator[bool]:
        """Yields True while this process holds the lock; False when it was not had within ``wait_s``."""
        got = self._local.acquire(timeout=wait_s) if wait_s > 0 else self._local.acquire(False)
        if not got:
            yield False
            return
        try:
            if is_postgres(self.db):
                with self._advisory(wait_s) as held:
                    yield held
            else:
                with try_file_lock(self.path, wait_s) as held:
                    yield held
        finally:
            self._local.release()

    @contextlib.contextmanager
    def _advisory(self, wait_s: float) -> Iterator[bool]:
        conn = self.db.connect().execution_options(isolation_level="AUTOCOMMIT")
        held = False
        try:
            args = {"a": _PG_LOCK[0], "b": _PG_LOCK[1]}
            held = bool(conn.execute(sa.text("SELECT pg_try_advisory_lock(:a, :b)"), args).scalar())
            if not held and wait_s > 0:
                conn.execute(sa.text(f"SET lock_timeout = {max(1, int(wait_s * 1000))}"))
                try:
                    conn.execute(sa.text("SELECT pg_advisory_lock(:a, :b)"), args)
                    held = True
                except DBAPIError:
                    held = False
                finally:
                    with contextlib.suppress(DBAPIError):
                        conn.execute(sa.text("SET lock_timeout = 0"))
            yield held
        finally:
            try:
                if held:
                    conn.execute(sa.text("SELECT pg_advisory_unlock(:a, :b)"), args)
            except DBAPIError:
                conn.invalidate()  # closing a broken connection releases the lock server-side
            finally:
                conn.close()
