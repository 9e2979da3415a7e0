"""Alembic environment: the URL comes from the caller or from kcache server Settings, never the ini."""

from __future__ import annotations

from alembic import context
from kcache_server.db import open_database
from kcache_server.models import metadata
from kcache_server.settings import Settings

config = context.config


def _url() -> str:
    url = config.attributes.get("db_url")
    return str(url) if url else Settings().database_url


def run_migrations_offline() -> None:
    """Emit SQL for ``alembic upgrade --sql``."""
    context.configure(url=_url(), target_metadata=metadata, literal_binds=True, compare_type=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    """Run against the database (an open connection may be handed in by tests)."""
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    engine = open_database(_url())
    try:
        with engine.connect() as conn:
            _run(conn)
    finally:
        engine.dispose()


def _run(connection: object) -> None:
    context.configure(
        connection=connection,  # type: ignore[arg-type]
        target_metadata=metadata,
        compare_type=True,
        render_as_batch=True,  # SQLite can only alter tables by copying them
    )
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
