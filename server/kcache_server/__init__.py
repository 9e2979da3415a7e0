"""kcache server: the HTTP API over the core engine, with SQL metadata, compile workers and tokens.

``create_app(settings)`` builds the FastAPI application; ``kcache serve`` runs it.
"""

from kcache_server.app import create_app
from kcache_server.compile_pool import ProcessPoolCompiler
from kcache_server.index import SqlIndex
from kcache_server.locks import PgAdvisoryKeyLock
from kcache_server.settings import Settings

__all__ = ["PgAdvisoryKeyLock", "ProcessPoolCompiler", "Settings", "SqlIndex", "create_app"]
