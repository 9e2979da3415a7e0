"""``PgAdvisoryKeyLock``: cooperating writers across processes and replicas sharing PostgreSQL.

Like every kcache lock it only avoids duplicate compiles; correctness rests on the
atomic, content-addressed publish. The lock is a session-level advisory lock held
on a dedicated connection, so PostgreSQL drops it if the holder dies.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import sqlalchemy as sa
from sqlalchemy.exc import DBAPIError, OperationalError

from kcache.errors import LockTimeoutError
from kcache.keys import require_hex_key

__all__ = ["PgAdvisoryKeyLock", "advisory_id"]


def advisory_id(key: str) -> int:
    """The signed 64-bit advisory lock id for a sha256 key (its first 8 bytes)."""
    require_hex_key(key, "key")
    return int.from_bytes(bytes.fromhex(key[:16]), "big", signed=True)


class PgAdvisoryKeyLock:
    """``pg_advisory_lock`` per key; ``waited`` is True when ``pg_try_advisory_lock`` failed first."""

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine

    @contextlib.contextmanager
    def hold(self, key: str, timeout: float) -> Iterator[bool]:
        """Hold the advisory lock for ``key`` on a connection of its own."""
        lock_id = advisory_id(key)
        conn = self.engine.connect().execution_options(isolation_level="AUTOCOMMIT")
        held = False
        try:
            waited = not conn.execute(
                sa.text("SELECT pg_try_advisory_lock(:k)"), {"k": lock_id}
            ).scalar()
            if waited:
                # lock_timeout bounds the wait for any heavyweight lock, advisory ones included.
                conn.execute(sa.text(f"SET lock_timeout = {max(1, int(timeout * 1000))}"))
                try:
                    conn.execute(sa.text("SELECT pg_advisory_lock(:k)"), {"k": lock_id})
                except (OperationalError, DBAPIError) as exc:
                    raise LockTimeoutError(
                        f"waited {timeout:.0f}s for another replica's compile of {key}"
                    ) from exc
                finally:
                    with contextlib.suppress(DBAPIError):
                        conn.execute(sa.text("SET lock_timeout = 0"))
            held = True
            yield waited
        finally:
            try:
                if held:
                    conn.execute(sa.text("SELECT pg_advisory_unlock(:k)"), {"k": lock_id})
            except DBAPIError:
                conn.invalidate()  # a broken connection: closing it releases the lock server-side
            finally:
                conn.close()
