"""What the server's commands share, so their errors are one or two lines that say what to do.

- :func:`settings_error`: a bad value in ``Settings`` named by the flag that gave it or
  its ``KCACHE_*`` variable, never pydantic's raw report.
- :func:`database_errors`: a database that cannot be reached or a URL SQLAlchemy
  cannot open, told with the option that named it (the password hidden).
- :func:`require_database`: read-only commands refuse a missing SQLite file instead
  of creating an empty database in the place they were asked to read.

Imported by the commands when they run (never by ``register``), so it may import
pydantic and SQLAlchemy lazily itself.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from kcache.cli_toolkit import UsageError
from kcache.dirs import data_dir
from kcache.errors import KCacheError
from kcache_server.errors import DatabaseUnavailableError

if TYPE_CHECKING:
    from kcache_server.settings import Settings

__all__ = [
    "database_errors",
    "guard_commands",
    "load_settings",
    "require_database",
    "settings_error",
]

#: Settings fields some commands take from flags, and those flags.
_FLAGS = {
    "host": "--host",
    "port": "--port",
    "data_dir": "--data-dir",
    "db_url": "--db-url",
    "workers": "--workers",
    "compile_workers": "--compile-workers",
    "compile_timeout_s": "--compile-timeout",
    "force_insecure": "--force-insecure",
    "recreate_index": "--recreate-index",
    "max_store_bytes": "--max-store-bytes",
}
#: Fields whose values are not echoed (a database URL may carry a password).
_SECRET = ("db_url", "token", "password")
_URL_HELP = (
    "write sqlite:////ABSOLUTE/PATH/kcache.db, or postgresql+psycopg://USER:PASSWORD@HOST:5432/DB"
)


def _variable(loc: Iterable[object], prefix: str = "KCACHE_") -> str:
    return prefix + "_".join(str(part) for part in loc).upper()


def _prefix(model: str) -> str:
    """The variables' prefix of the settings model named ``model`` (a section's own: ``KCACHE_AUDIT_``).

    A section built from the environment by itself (``Settings``' default for it) reports
    its errors under its own name, its fields' names without the section's.
    """
    from kcache_server.settings import AuditSettings, Settings, VerificationSettings

    for section in (AuditSettings, VerificationSettings, Settings):
        if section.__name__ == model:
            return str(section.model_config.get("env_prefix") or "KCACHE_")
    return "KCACHE_"


def settings_error(exc: Exception, flags: Mapping[str, object]) -> UsageError:
    """A pydantic(-settings) error about ``Settings`` as at most two lines naming flags or variables."""
    from pydantic import ValidationError

    lines: list[str] = []
    if isinstance(exc, ValidationError):
        prefix = _prefix(exc.title)
        for err in exc.errors():
            loc = [str(part) for part in err["loc"]]
            name = loc[0] if loc else "?"
            flagged = name in flags and len(loc) == 1 and prefix == "KCACHE_"
            where = _FLAGS.get(name, name) if flagged else _variable(loc, prefix)
            shown = "" if any(s in name for s in _SECRET) else f"={str(err.get('input'))[:80]!r}"
            message = str(err["msg"]).removeprefix("Value error, ")
            lines.append(f"{where}{shown}: {message}")
    else:  # pydantic-settings could not even parse a variable (JSON for a dict field)
        match = re.search(r'field "([^"]+)"', str(exc))
        name = match.group(1) if match else "?"
        lines.append(f"{_variable([name])} is not valid JSON: {exc.__cause__ or exc}")
    if len(lines) > 2:
        lines = [lines[0], f"... and {len(lines) - 1} more settings are wrong"]
    if len(lines) == 1:
        lines[0] += "; fix the flag" if lines[0].startswith("--") else "; fix or unset the variable"
    return UsageError("\n".join(lines))


def load_settings(args: argparse.Namespace, **extra: Any) -> Settings:
    """``Settings`` from the environment with the command's flags over it; errors name either."""
    from pydantic import ValidationError
    from pydantic_settings import SettingsError

    from kcache_server.settings import Settings

    overrides: dict[str, Any] = {
        name: getattr(args, name)
        for name in (
            "host",
            "port",
            "data_dir",
            "db_url",
            "workers",
            "compile_workers",
            "compile_timeout_s",
        )
        if getattr(args, name, None) is not None
    }
    for flag in ("force_insecure", "recreate_index"):
        if getattr(args, flag, False):
            overrides[flag] = True
    try:
        return Settings(**overrides, **extra)
    except (ValidationError, SettingsError) as exc:
        raise settings_error(exc, {**overrides, **extra}) from None


def _database_named(args: argparse.Namespace) -> tuple[str, str]:
    """(the database shown, with its password hidden; the option or variable that named it)."""
    url = getattr(args, "db_url", None)
    option = "--db-url"
    if not url and os.environ.get("KCACHE_DB_URL"):
        url, option = os.environ["KCACHE_DB_URL"], "KCACHE_DB_URL"
    if not url:
        return f"SQLite in {data_dir(getattr(args, 'data_dir', None))}", "--data-dir"
    try:
        from sqlalchemy.engine import make_url

        return make_url(url).render_as_string(hide_password=True), option
    except Exception:  # not even a URL: show its scheme only
        return url.split("://", 1)[0] + "://...", option


def _database_problem(exc: BaseException, args: argparse.Namespace) -> KCacheError | None:
    import sqlalchemy.exc as sa_exc

    shown, option = _database_named(args)
    if isinstance(exc, sa_exc.NoSuchModuleError | sa_exc.ArgumentError):
        return UsageError(f"{option}: {shown} is not a database URL kcache can open: {_URL_HELP}")
    if isinstance(exc, ModuleNotFoundError) and exc.name in ("psycopg2", "pg8000", "asyncpg"):
        return UsageError(
            f"{option}: {shown} asks for the {exc.name} driver, which kcache does not use: {_URL_HELP}"
        )
    if isinstance(exc, sa_exc.OperationalError | sa_exc.InterfaceError):
        detail = (str(exc.orig).strip().splitlines() or [type(exc.orig).__name__])[0]
        return KCacheError(
            f"cannot use the database {shown} ({option}): {detail}\n"
            f"check that it is running and reachable, and that {option} names it"
        )
    return None


def database_errors(
    func: Callable[[argparse.Namespace], int],
) -> Callable[[argparse.Namespace], int]:
    """Wrap a command so database failures read as one or two lines naming ``--db-url``."""

    @functools.wraps(func)
    def run(args: argparse.Namespace) -> int:
        try:
            return func(args)
        except DatabaseUnavailableError as exc:
            # The engine's outage error says what a server's caller needs; a command names --db-url.
            problem = _database_problem(exc.driver_error, args) if exc.driver_error else None
            if problem is None:
                raise
            raise problem from exc
        except KCacheError:
            raise
        except Exception as exc:
            problem = _database_problem(exc, args)
            if problem is None:
                raise
            raise problem from exc

    return run


def guard_commands(parsers: Iterable[argparse.ArgumentParser]) -> None:
    """Wrap the ``func`` of every parser in :func:`database_errors` (once)."""
    for parser in parsers:
        func: Any = parser.get_default("func")
        if func is not None and not getattr(func, "_kcache_guarded", False):
            guarded = database_errors(func)
            guarded._kcache_guarded = True  # type: ignore[attr-defined]
            parser.set_defaults(func=guarded)


def require_database(settings: Settings, args: argparse.Namespace, what: str) -> None:
    """Refuse to read a SQLite database that does not exist (opening it would create it)."""
    from kcache_server.db import sqlite_path

    path = sqlite_path(settings.database_url)
    if path is not None and not path.exists():
        _, option = _database_named(args)
        raise UsageError(
            f"no kcache database at {path} ({option}): {what} reads a server's database and creates "
            "none; name the server's data directory with --data-dir (or KCACHE_DATA_DIR), "
            "or create it with `kcache db upgrade`"
        )
