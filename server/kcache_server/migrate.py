"""Alembic, driven from code: ``kcache db upgrade``, the start-up schema check, a lost index.

A data directory whose blobs outlived their database (the SQLite file deleted, a
new PostgreSQL database) is refused at start-up: creating an empty index silently
would make every blob look unreferenced to ``kcache db gc``. ``--recreate-index``
creates the schema and indexes the blobs again (:meth:`SqlIndex.recover`).

Alembic is imported only where it is needed: importing it (with the DDL of every
dialect it brings) was a tenth of ``kcache serve``'s start. The start-up check of a
database at the head revision needs none of it: :func:`script_head` reads the
revision ids the migration scripts assign (as literals, without running them) and
the ``alembic_version`` table is read with plain SQL. Where the scripts are not one
linear chain, or the database is anywhere but at its head, Alembic decides, and
words the error, as before.
"""

from __future__ import annotations

import ast
import logging
import os
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import sqlalchemy as sa
from sqlalchemy.engine import make_url

from kcache.store.local import LocalArtifactStore
from kcache_server.db import is_sqlite, sqlite_path
from kcache_server.errors import IndexMissingError, SchemaOutOfDateError
from kcache_server.index import SqlIndex
from kcache_server.settings import Settings

if TYPE_CHECKING:
    from alembic.config import Config

__all__ = [
    "alembic_config",
    "check_schema",
    "current_revisions",
    "has_tables",
    "head_revisions",
    "known_revisions",
    "migrations_dir",
    "prepare_database",
    "refuse_newer",
    "script_head",
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


#: The files of a versions directory Alembic reads as revision scripts (its own pattern, matched in full).
_SCRIPT_FILE = re.compile(r"(?!\.\#|__init__).*\.py")


def alembic_config(url: str) -> Config:
    """An Alembic config whose ``env.py`` will use ``url`` (not the ini file)."""
    from alembic.config import Config

    # Alembic's default stdout is whatever sys.stdout was when alembic was first imported
    # (it is imported lazily now): give it the current one.
    cfg = Config(stdout=sys.stdout)
    cfg.set_main_option("script_location", str(migrations_dir()))
    cfg.attributes["db_url"] = url
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    """Run the migrations up to ``revision``."""
    from alembic import command

    command.upgrade(alembic_config(url), revision)


def head_revisions(url: str) -> set[str]:
    """The revisions this code needs."""
    from alembic.script import ScriptDirectory

    return set(ScriptDirectory.from_config(alembic_config(url)).get_heads())


def known_revisions(url: str) -> list[str]:
    """Every revision of this release's migration scripts, oldest first."""
    from alembic.script import ScriptDirectory

    scripts = ScriptDirectory.from_config(alembic_config(url))
    return [script.revision for script in reversed(list(scripts.walk_revisions()))]


def _newer_release(have: set[str], url: str) -> str | None:
    """Why a database at ``have`` cannot be used by this release, if a newer one migrated it."""
    unknown = have - set(known_revisions(url))
    if not unknown:
        return None
    where = make_url(url).render_as_string(hide_password=True)
    return (
        f"the database {where} was migrated by a newer release of kcache (revision "
        f"{', '.join(sorted(unknown))} > {', '.join(sorted(head_revisions(url)))}, this "
        "release's newest): run that release (or a newer one) against it, or restore a backup "
        "taken before that upgrade; `kcache db upgrade` never downgrades"
    )


def refuse_newer(engine: sa.Engine, url: str) -> None:
    """Raise :class:`SchemaOutOfDateError` when a newer release migrated the database."""
    problem = _newer_release(current_revisions(engine), url)
    if problem is not None:
        raise SchemaOutOfDateError(problem)


def current_revisions(engine: sa.Engine) -> set[str]:
    """The revisions the database is at (empty for a fresh database)."""
    from alembic.runtime.migration import MigrationContext

    with engine.connect() as conn:
        return set(MigrationContext.configure(conn).get_current_heads())


def _assigned(tree: ast.Module, name: str) -> object:
    """The literal a script's last module-level assignment to ``name`` gives it; ``...`` if none does."""
    value: object = ...
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, expression = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            target, expression = node.target, node.value
        else:
            continue
        if isinstance(target, ast.Name) and target.id == name:
            try:
                value = ast.literal_eval(expression)
            except ValueError:  # computed, not a literal
                value = ...
    return value


def script_head() -> str | None:
    """The head revision of the migration scripts, read without importing Alembic.

    Only for scripts that form one linear chain, each assigning ``revision`` and
    ``down_revision`` as plain strings (``None`` for the first): then the head is the
    one revision no script names as its ``down_revision``, as Alembic has it. Anything
    else (a branch, a merge, a value computed in code, an unreadable file) is None,
    and Alembic is asked instead.
    """
    scripts = 0
    revisions: set[str] = set()
    downs: set[str] = set()
    try:
        for path in (migrations_dir() / "versions").iterdir():
            if not _SCRIPT_FILE.fullmatch(path.name):
                continue
            scripts += 1
            tree = ast.parse(path.read_bytes())
            revision, down = _assigned(tree, "revision"), _assigned(tree, "down_revision")
            if not isinstance(revision, str) or not (down is None or isinstance(down, str)):
                return None
            revisions.add(revision)
            if down is not None:
                downs.add(down)
    except (OSError, SyntaxError, ValueError):
        return None
    heads = revisions - downs
    linear = scripts == len(revisions) and len(downs) == scripts - 1 and downs <= revisions
    return heads.pop() if linear and len(heads) == 1 else None


def _at_script_head(engine: sa.Engine) -> bool:
    """True when the database is at :func:`script_head` (read with plain SQL, no Alembic)."""
    head = script_head()
    if head is None:
        return False
    with engine.connect() as conn:
        if not sa.inspect(conn).has_table("alembic_version"):
            return False
        rows = conn.execute(sa.text("SELECT version_num FROM alembic_version")).scalars().all()
    return list(rows) == [head]


def has_tables(engine: sa.Engine) -> bool:
    """True when the database holds any table at all."""
    return bool(sa.inspect(engine).get_table_names())


def check_schema(engine: sa.Engine, url: str) -> None:
    """Raise :class:`SchemaOutOfDateError` unless the database is at the head revision."""
    if _at_script_head(engine):
        return  # the usual case, told without importing Alembic
    need = head_revisions(url)
    have = current_revisions(engine)
    if have != need:
        newer = _newer_release(have, url)
        if newer is not None:
            raise SchemaOutOfDateError(newer)
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
