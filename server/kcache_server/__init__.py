"""kcache server: the HTTP API over the core engine, with SQL metadata, compile workers and tokens.

``create_app(settings)`` builds the FastAPI application; ``kcache serve`` runs it.
"""

from typing import TYPE_CHECKING

from kcache.lazy import lazy_exports

if TYPE_CHECKING:  # _LAZY's names, for type checkers (tests/test_lazy_exports.py)
    from kcache_server.compile_pool import ProcessPoolCompiler as ProcessPoolCompiler
    from kcache_server.index import SqlIndex as SqlIndex
    from kcache_server.locks import PgAdvisoryKeyLock as PgAdvisoryKeyLock
    from kcache_server.serving.app import create_app as create_app
    from kcache_server.settings import Settings as Settings

# Imported on first use: the `kcache` command loads this package's subcommands for every
# run (`kcache --help`, `kcache key`), and they must not pay for FastAPI and SQLAlchemy.
_LAZY = {
    "create_app": "kcache_server.serving.app",
    "ProcessPoolCompiler": "kcache_server.compile_pool",
    "SqlIndex": "kcache_server.index",
    "PgAdvisoryKeyLock": "kcache_server.locks",
    "Settings": "kcache_server.settings",
}

__all__ = [*_LAZY]


__getattr__, __dir__ = lazy_exports("kcache_server", _LAZY, globals(), __all__)
