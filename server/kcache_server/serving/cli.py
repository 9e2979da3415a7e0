"""``kcache serve``, ``kcache db upgrade|current|gc|verify|rekey`` and ``kcache token create|list|revoke``;
``kcache signing-key`` and ``kcache db signing-keys`` are :mod:`.signing_cli`'s.

Registered on the core's ``kcache`` command through the ``kcache.commands`` entry
point group (see :mod:`kcache.cli`). Flags override the ``KCACHE_*`` environment.
:func:`register` imports nothing beyond argparse (``kcache --help`` stays instant);
each command imports the server when it runs. Errors about settings and databases
are told in one or two lines naming the flag or variable (:mod:`._cli_support`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING, Any

from kcache_server.scopes import ALL_SCOPES

if TYPE_CHECKING:
    from kcache_server.settings import Settings

__all__ = ["register"]


def _settings(args: argparse.Namespace, **extra: Any) -> Settings:
    from kcache_server.serving._cli_support import load_settings

    return load_settings(args, **extra)


def _positive_int(text: str) -> int:
    """An argparse type: a whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not at least 1")
    return value


#: Fewer bytes free than this under the data directory (or than ``min_free_bytes``, if
#: lower, but never 0), and ``kcache serve`` does not start.
_START_MIN_FREE = 1 << 20


def _add_db_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data-dir", help="data directory (default $KCACHE_DATA_DIR or ./.kcache)")
    parser.add_argument(
        "--db-url", help="database URL (default $KCACHE_DB_URL or SQLite in the data dir)"
    )


#: The epilog ``kcache serve --help`` replaces with every setting (:class:`_SettingsHelp`).
_SETTINGS_EPILOG = "(the KCACHE_* settings)"


class _SettingsHelp(argparse.HelpFormatter):
    """``serve --help``'s formatter: its epilog lists every ``KCACHE_*`` setting.

    Made from ``kcache_server.settings`` when the help is shown (``register`` imports
    only argparse, so ``kcache --help`` stays instant), and laid out there.
    """

    def add_text(self, text: str | None) -> None:
        if text == _SETTINGS_EPILOG:
            from kcache_server.settings import settings_help

            text = settings_help(width=max(self._width, 60))
        super().add_text(text)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" in text:  # the settings, laid out already
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


def _dashboard_line(host: str, port: int) -> str:
    """Where a person points a browser: the dashboard's URL, said once the app is built.

    A wildcard bind is reachable by this machine's name; port 0 is chosen by uvicorn,
    whose own line (below this one) names it.
    """
    import socket

    shown = socket.gethostname() if host in ("", "0.0.0.0", "::") else host
    if ":" in shown:  # an IPv6 literal
        shown = f"[{shown}]"
    if port == 0:
        return "kcache: the dashboard is at /dashboard on the port uvicorn reports below"
    base = f"http://{shown}:{port}"
    return f"kcache: serving {base}; the dashboard is at {base}/dashboard (it asks for a read token if the server has tokens)"


def _port_taken(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be listened on now (in use, or not allowed), or None.

    Bound as uvicorn binds it (``SO_REUSEADDR``: only a socket listening there refuses),
    then let go, before anything is announced or built. Other errors (an address this
    machine does not have) are left to uvicorn's own report.
    """
    import errno
    import socket

    if port == 0:
        return None
    try:
        found = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except OSError:
        return None
    for family, kind, proto, _, address in found:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    return "the port is in use (another kcache serve, or another program)"
                if exc.errno == errno.EACCES:
                    return "this user may not listen on it (ports below 1024 need privileges)"
    return None


def _disk_at_start(settings: Settings) -> int:
    """Refuse to start on a full disk; warn below ``min_free_bytes``; 0 or the exit status.

    Checked before the database is opened: with nothing free, SQLite says "disk I/O
    error" and the compile workers die starting (a segfault), neither naming the disk.
    """
    import logging

    from kcache.fsutil import free_bytes

    place = settings.data_dir.absolute()
    while not place.exists() and place != place.parent:  # not made yet: its filesystem
        place = place.parent
    try:
        free = free_bytes(place)
    except OSError:
        return 0  # not ours to judge: the database's own error will say
    shown = settings.data_dir.absolute()
    # An operator who lowered min_free_bytes below the floor is taken at their word, down to 1.
    if free < max(1, min(_START_MIN_FREE, settings.min_free_bytes)):
        print(
            f"kcache: not starting: the data directory {shown} has {free} bytes free (its "
            "database, blobs and compile scratch need space to start); free some space there "
            "(kcache db gc removes unreferenced blobs) or point --data-dir (KCACHE_DATA_DIR) at "
            "another disk",
            file=sys.stderr,
        )
        return 1
    if free < settings.min_free_bytes:
        logging.getLogger("kcache_server.serving").warning(
            "only %d bytes are free under the data directory %s, below min_free_bytes=%d "
            "(KCACHE_MIN_FREE_BYTES): compiles are refused with 507 and /readyz fails until "
            "space is freed (kcache db gc removes unreferenced blobs), or lower "
            "KCACHE_MIN_FREE_BYTES",
            free,
            shown,
            settings.min_free_bytes,
        )
    return 0


def _warn_unknown_variables() -> None:
    """One warning per ``KCACHE_*`` variable that is no one's setting (a misspelt one keeps its default)."""
    import logging

    from kcache_server.settings import unknown_variables

    log = logging.getLogger("kcache_server.serving")
    for name, close in unknown_variables(os.environ):
        hint = f"; did you mean {close}?" if close else ""
        log.warning(
            "%s is not a kcache setting and is ignored%s (kcache serve --help lists them)",
            name,
            hint,
        )


def _cmd_serve(args: argparse.Namespace) -> int:
    cap = {"max_store_bytes": args.max_store_bytes} if args.max_store_bytes is not None else {}
    settings = _settings(args, **cap)
    _warn_unknown_variables()
    taken = _port_taken(settings.host, settings.port)
    if taken is not None:
        print(
            f"kcache: cannot serve on {settings.host}:{settings.port}: {taken}; stop what "
            "listens there, or pick another port with --port N (or KCACHE_PORT)",
            file=sys.stderr,
        )
        return 1
    refused = _disk_at_start(settings)
    if refused:
        return refused

    import uvicorn

    from kcache_server.serving.app import SETTINGS_ENV, create_app, serving_app

    # Stock uvicorn through its public API; httptools (uvicorn[standard]) parses.
    http = "httptools"

    if settings.workers > 1:
        # Each uvicorn worker process builds its own app (and compile pool) from these settings.
        create_app(settings)  # fail here, once, with a clear message, rather than in every worker
        os.environ[SETTINGS_ENV] = settings.model_dump_json()
        print(_dashboard_line(settings.host, settings.port), file=sys.stderr, flush=True)
        uvicorn.run(
            "kcache_server.serving.app:create_app_from_env",
            factory=True,
            host=settings.host,
            port=settings.port,
            workers=settings.workers,
            access_log=settings.access_log,
            http=http,
        )
    else:
        app = serving_app(create_app(settings))
        print(_dashboard_line(settings.host, settings.port), file=sys.stderr, flush=True)
        uvicorn.run(
            app,
            host=settings.host,
            port=settings.port,
            access_log=settings.access_log,
            http=http,
        )
    return 0


def _upgrade(url: str, revision: str) -> None:
    """``migrate.upgrade``, a revision Alembic refuses told as the argument to fix."""
    from alembic.util.exc import CommandError

    from kcache.cli_toolkit import UsageError
    from kcache_server import migrate

    try:
        migrate.upgrade(url, revision)
    except CommandError as exc:
        known = migrate.known_revisions(url)
        if revision not in (*known, "head", "heads"):
            raise UsageError(
                f"db upgrade: this release has no revision {revision!r}: give head (the default) "
                f"or one of its revisions {known[0]} ... {known[-1]}"
            ) from None
        detail = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UsageError(
            f"db upgrade {revision}: {detail}; `kcache db current` shows where the database is "
            "(it is never downgraded)"
        ) from None


def _cmd_db_upgrade(args: argparse.Namespace) -> int:
    from kcache_server import migrate
    from kcache_server.backends import open_settings_database

    settings = _settings(args)
    db = open_settings_database(settings)  # creates the data directory for SQLite
    try:
        before = migrate.current_revisions(db)
        migrate.refuse_newer(db, settings.database_url)
        _upgrade(settings.database_url, args.revision)
        reached = migrate.current_revisions(db)
    finally:
        db.dispose()
    shown = ", ".join(sorted(reached)) or "(none)"
    if reached == before:
        print(f"database at {shown} (already there; `kcache db upgrade` never downgrades)")
    else:
        print(f"database at {shown} (was {', '.join(sorted(before)) or 'empty'})")
    return 0


def _cmd_db_current(args: argparse.Namespace) -> int:
    from kcache_server import migrate
    from kcache_server.backends import open_settings_database
    from kcache_server.serving._cli_support import require_database

    settings = _settings(args)
    require_database(settings, args, "kcache db current")
    db = open_settings_database(settings)
    have = migrate.current_revisions(db)
    need = migrate.head_revisions(settings.database_url)
    print(json.dumps({"current": sorted(have), "head": sorted(need), "up_to_date": have == need}))
    return 0 if have == need else 1


def _cmd_db_gc(args: argparse.Namespace) -> int:
    from kcache.maintenance import MIN_SAFE_GRACE_S, check_index_knows_store, collect_garbage
    from kcache_server import migrate
    from kcache_server.backends import maintained_store, open_settings_database
    from kcache_server.db import sqlite_path
    from kcache_server.index import SqlIndex

    if args.grace < MIN_SAFE_GRACE_S and not args.force:
        print(
            f"kcache: --grace {args.grace:g} is below {MIN_SAFE_GRACE_S:g}s: a compile publishes its blob "
            "before it commits the row that names it, and a shorter grace can delete a blob a row is about "
            "to name. Pass --force if no compile can be running",
            file=sys.stderr,
        )
        return 2
    settings = _settings(args)
    path = sqlite_path(settings.database_url)
    if path is not None and not path.exists():  # opening it would create an empty one
        print(
            f"kcache: no database at {path}: nothing says which blobs are in use, so nothing is collected. "
            "Restore the database, or start the server once with --recreate-index",
            file=sys.stderr,
        )
        return 2
    db = open_settings_database(settings)
    migrate.check_schema(db, settings.database_url)
    store = maintained_store(settings)
    index = SqlIndex(db)
    # Blobs are published before their row is committed: the grace period keeps a
    # blob whose compile is still recording it, and each deletion asks the index again.
    referenced = index.digests()
    if not args.force:
        check_index_knows_store(store, referenced)
    report = collect_garbage(
        store,
        referenced,
        grace_seconds=args.grace,
        still_referenced=index.names,
        dry_run=args.dry_run,
    )
    print(json.dumps(vars(report)))
    return 0


def _cmd_db_verify(args: argparse.Namespace) -> int:
    from kcache.maintenance import store_name, verify_blobs, verify_sample
    from kcache_server import migrate
    from kcache_server.backends import maintained_store, open_settings_database
    from kcache_server.index import SqlIndex
    from kcache_server.serving._cli_support import require_database

    settings = _settings(args)
    require_database(settings, args, "kcache db verify")
    db = open_settings_database(settings)
    migrate.check_schema(db, settings.database_url)
    if args.recompile:
        return _verify_by_recompiling(settings, db, args.sample)
    store = maintained_store(settings)
    indexed = SqlIndex(db).digests()
    if args.sample is None:
        report = verify_blobs(store, indexed)
    else:
        report = verify_sample(store, indexed, args.sample)
    print(
        json.dumps(
            {
                "store": store_name(store),
                "rows": len(indexed),
                "sampled": report.sampled,
                "checked": report.checked,
                "corrupt": report.corrupt,
                "missing": report.missing,
            }
        )
    )
    return 0 if report.ok else 1


def _verify_by_recompiling(settings: Any, db: Any, sample: int | None) -> int:
    """``kcache db verify --recompile``: compile recorded recipes again, compare, act, report."""
    from kcache_server.backends import open_backends
    from kcache_server.recipe_records import RecipeRecords
    from kcache_server.verification import verify_offline

    backends = open_backends(settings, db)
    verdicts = verify_offline(backends, RecipeRecords(db), sample)
    results: dict[str, int] = {}
    for verdict in verdicts:
        results[verdict.result] = results.get(verdict.result, 0) + 1
    diverged = [
        {
            "recipe_key": v.recipe_key,
            "stored_digest": v.stored_digest,
            "fresh_digest": v.fresh_digest,
            "differences": list(v.differences),
        }
        for v in verdicts
        if v.result == "diverged"
    ]
    print(json.dumps({"verified": len(verdicts), "results": results, "diverged": diverged}))
    return 1 if diverged else 0


def _positive_float(text: str) -> float:
    """An argparse type: a finite number above 0 (a setting's own upper bound is its own check)."""
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text} is not a finite number (inf and nan are refused)")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} is not a number above 0")
    return value


def _days(text: str) -> float:
    """An argparse type: a number of days above 0, at most ``MAX_DAYS`` (100 years)."""
    from kcache_server.settings import MAX_DAYS

    value = _positive_float(text)
    if value > MAX_DAYS:
        raise argparse.ArgumentTypeError(f"{text} is more than 100 years: give at most {MAX_DAYS}")
    return value


def _cmd_db_rekey(args: argparse.Namespace) -> int:
    from kcache_server import migrate
    from kcache_server.backends import open_backends, open_settings_database
    from kcache_server.recipe_records import RecipeRecords
    from kcache_server.rekey import rekey
    from kcache_server.serving._cli_support import require_database

    settings = _settings(args)
    require_database(settings, args, "kcache db rekey")
    db = open_settings_database(settings)
    migrate.check_schema(db, settings.database_url)
    jobs = args.jobs or settings.compile_workers
    # This command is the pool's one caller: every worker compiles for it.
    settings = settings.model_copy(update={"compile_workers": jobs, "compile_caller_limit": jobs})
    try:
        report = rekey(
            open_backends(settings, db),
            RecipeRecords(db),
            since_days=args.since,
            jobs=jobs,
            dry_run=args.dry_run,
        )
    finally:
        db.dispose()
    if args.json:
        print(json.dumps(report.to_dict()))
    else:
        from kcache_server.terminal import printable

        for failure in report.failures:
            print(
                f"kcache: failed: {failure.recipe_key or failure.recorded_key}: "
                f"{printable(failure.error)}",
                file=sys.stderr,
            )
        print(report.summary())
    return 0 if report.ok else 1


def _tokens(args: argparse.Namespace) -> Any:
    from kcache_server import migrate
    from kcache_server.auth import TokenStore
    from kcache_server.backends import open_settings_database
    from kcache_server.serving._cli_support import require_database

    settings = _settings(args)
    require_database(settings, args, f"kcache token {args.token_command}")
    db = open_settings_database(settings)
    migrate.check_schema(db, settings.database_url)
    return TokenStore(db, cache_s=0)


def _cmd_token_create(args: argparse.Namespace) -> int:
    from pathlib import Path

    from kcache.cli_toolkit import UsageError

    given = None
    if args.token_file:
        try:
            given = Path(args.token_file).read_text().strip()
        except OSError as exc:
            raise UsageError(
                f"--token-file: cannot read {args.token_file}: {exc.strerror}"
            ) from exc
    elif args.exist_ok:
        raise UsageError("--exist-ok needs --token-file (a fresh random token never exists yet)")
    tokens = _tokens(args)
    try:
        token = tokens.create(
            args.name, args.scope or ["read"], token=given, exist_ok=args.exist_ok
        )
    except Exception as exc:
        import sqlalchemy as sa

        if given is None or not isinstance(exc, sa.exc.IntegrityError):
            raise
        raise UsageError(_token_in_use(tokens.engine, given, args.token_file)) from None
    if given is not None:  # the caller has the value already: never echo a secret
        print(f"kcache: token {args.name!r} is stored (from {args.token_file})", file=sys.stderr)
        return 0
    print(token)
    print(
        f"kcache: created token {args.name!r}; it is shown only now, store it (KCACHE_TOKEN)",
        file=sys.stderr,
    )
    return 0


def _token_in_use(engine: Any, token: str, file: str) -> str:
    """Why a token from ``--token-file`` cannot be stored: another token (named) holds that value."""
    import sqlalchemy as sa

    from kcache_server.auth import hash_token
    from kcache_server.models import tokens_table
    from kcache_server.terminal import printable

    with engine.connect() as conn:
        row = conn.execute(
            sa.select(tokens_table.c.name, tokens_table.c.revoked_at).where(
                tokens_table.c.token_hash == hash_token(token)
            )
        ).first()
    holder = f"token {printable(row.name)!r}" if row is not None else "another token"
    revoked = " (revoked)" if row is not None and row.revoked_at is not None else ""
    return (
        f"--token-file: {file} holds the value of {holder}{revoked}, and each token needs its own: "
        "write a new secret to a file for this one (e.g. `openssl rand -hex 32 > FILE`)"
    )


def _cmd_token_list(args: argparse.Namespace) -> int:
    from kcache_server.terminal import printable

    for info in _tokens(args).list():
        state = f"revoked {info.revoked_at:%Y-%m-%d %H:%M}" if info.revoked_at else "active"
        used = f"{info.last_used_at:%Y-%m-%d %H:%M}" if info.last_used_at else "never"
        # A name is whatever was given to `kcache token create` (or is in an old row): escaped.
        name = printable(info.name)
        print(
            f"{name}\t{','.join(info.scopes)}\tcreated {info.created_at:%Y-%m-%d %H:%M}\tused {used}\t{state}"
        )
    return 0


def _cmd_token_revoke(args: argparse.Namespace) -> int:
    tokens = _tokens(args)
    if tokens.revoke(args.name):
        print(f"revoked {args.name}")
        if tokens.active_count() == 0:
            print(
                "kcache: no active token is left. Servers running on this database keep "
                "refusing every request until one is created (`kcache token create NAME "
                "--scope compile`); a server started now is open on a loopback address and "
                "refuses to start on any other",
                file=sys.stderr,
            )
        return 0
    print(f"kcache: no active token named {args.name!r}", file=sys.stderr)
    return 1


def register(subparsers: Any) -> None:
    """Add ``serve``, ``db``, ``token`` and ``signing-key`` to the ``kcache`` command."""
    serve = subparsers.add_parser(
        "serve",
        help="run the kcache server",
        description="Run the kcache server. Every setting is a KCACHE_* environment variable "
        "(listed below, with its default); the flags here override theirs.",
        epilog=_SETTINGS_EPILOG,
        formatter_class=_SettingsHelp,
    )
    serve.add_argument("--host", help="address to bind (default $KCACHE_HOST or 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default $KCACHE_PORT or 8470)")
    _add_db_options(serve)
    serve.add_argument("--workers", type=int, help="uvicorn worker processes (default 1)")
    serve.add_argument(
        "--compile-workers",
        type=_positive_int,
        metavar="N",
        help="NVRTC worker processes per server process (default $KCACHE_COMPILE_WORKERS or 2)",
    )
    serve.add_argument(
        "--compile-timeout",
        dest="compile_timeout_s",
        type=_positive_float,
        metavar="SECONDS",
        help="a compile running longer is killed and answered compile_timeout (default "
        "$KCACHE_COMPILE_TIMEOUT_S or 120)",
    )
    serve.add_argument(
        "--force-insecure",
        action="store_true",
        help="allow a non-loopback bind with no tokens configured",
    )
    serve.add_argument(
        "--recreate-index",
        action="store_true",
        help="the database was lost: create it afresh and index the stored blobs again (recipes compile once more)",
    )
    serve.add_argument(
        "--max-store-bytes",
        metavar="SIZE",
        help="cap the store, e.g. 500GiB: least recently used unpinned artifacts are evicted past "
        "it (default $KCACHE_MAX_STORE_BYTES; unbounded)",
    )
    serve.set_defaults(func=_cmd_serve)

    db = subparsers.add_parser("db", help="manage the server database")
    db_sub = db.add_subparsers(dest="db_command", required=True)
    upgrade = db_sub.add_parser("upgrade", help="run the database migrations")
    _add_db_options(upgrade)
    upgrade.add_argument(
        "revision", nargs="?", default="head", help="target revision (default head)"
    )
    upgrade.set_defaults(func=_cmd_db_upgrade)
    current = db_sub.add_parser("current", help="show the schema revision; exit 1 if out of date")
    _add_db_options(current)
    current.set_defaults(func=_cmd_db_current)
    gc = db_sub.add_parser(
        "gc",
        help="remove store blobs no artifact row names (the bucket's, with a store URL), and "
        "stale staging files",
    )
    _add_db_options(gc)
    gc.add_argument(
        "--grace",
        type=float,
        default=3600.0,
        help="only touch files older than this (s, at least 600)",
    )
    gc.add_argument(
        "--force",
        action="store_true",
        help="allow a grace under 600s, and collecting when the index names none of the blobs",
    )
    gc.add_argument(
        "--dry-run",
        action="store_true",
        help="count what would be removed and remove nothing",
    )
    gc.set_defaults(func=_cmd_db_gc)
    verify = db_sub.add_parser(
        "verify",
        help="re-hash every store blob (the bucket's, with a store URL); list artifact rows "
        "whose blob is missing",
    )
    _add_db_options(verify)
    verify.add_argument(
        "--sample",
        type=_positive_int,
        metavar="N",
        help="fetch and hash N artifact rows' blobs drawn at random instead of every blob "
        "(with --recompile: compile N recorded recipes drawn at random)",
    )
    verify.add_argument(
        "--recompile",
        action="store_true",
        help="compile the recipes the server recorded again, here, and compare with what their "
        "keys serve; a divergence is withdrawn, replaced by the fresh compile and recorded",
    )
    verify.set_defaults(func=_cmd_db_verify)
    rekey = db_sub.add_parser(
        "rekey",
        help="after an upgrade that changed the key schema, before the clients upgrade: resolve "
        "every recipe the server recorded whole and used lately under its new key (compiled "
        "here unless the index has it), so clients find their kernels",
        description="Resolve, under the current key schema, every recipe the server recorded "
        "whole and used within --since days: each is prepared as a request would be (its "
        "toolchain kept, include sets pinned to their contents now), counted current when "
        "the index has its key, else compiled (once across processes: a running server and "
        "this command share the key lock), or failed (no longer compiles, toolchain gone). "
        "Run it after `kcache db upgrade`, on one replica, with the server running or not, "
        "before the clients upgrade. Exit 1 if any recipe failed.",
    )
    _add_db_options(rekey)
    rekey.add_argument(
        "--since",
        type=_days,
        default=30.0,
        metavar="DAYS",
        help="recipes used within this many days (default 30)",
    )
    rekey.add_argument(
        "--jobs",
        type=_positive_int,
        metavar="N",
        help="compiles at once (default: the server's compile workers)",
    )
    rekey.add_argument(
        "--dry-run",
        action="store_true",
        help="look every recipe up and count what would be compiled; compile and write nothing",
    )
    rekey.add_argument("--json", action="store_true", help="print a JSON object, not a line")
    rekey.set_defaults(func=_cmd_db_rekey)

    token = subparsers.add_parser("token", help="manage bearer tokens")
    token_sub = token.add_subparsers(dest="token_command", required=True)
    create = token_sub.add_parser("create", help="create a token and print it (once)")
    create.add_argument("name")
    create.add_argument(
        "--scope",
        action="append",
        choices=list(ALL_SCOPES),
        help="repeatable (default read); each includes the ones before it: "
        "read < report (post client audit events) < compile < admin; publish (foreign "
        "artifacts from library cache hooks) reads and reports, and admin includes it",
    )
    create.add_argument(
        "--token-file",
        metavar="FILE",
        help="store the token read from FILE (a deployment's secret) instead of a new random "
        "one; not printed",
    )
    create.add_argument(
        "--exist-ok",
        action="store_true",
        help="with --token-file: succeed when this name already holds that token and scopes "
        "(an init step that runs on every start)",
    )
    _add_db_options(create)
    create.set_defaults(func=_cmd_token_create)
    listing = token_sub.add_parser("list", help="list tokens (never their values)")
    _add_db_options(listing)
    listing.set_defaults(func=_cmd_token_list)
    revoke = token_sub.add_parser("revoke", help="revoke a token by name")
    revoke.add_argument("name")
    _add_db_options(revoke)
    revoke.set_defaults(func=_cmd_token_revoke)

    from kcache_server.serving import signing_cli

    signing = signing_cli.register(subparsers, db_sub)

    from kcache_server.serving._cli_support import guard_commands

    guard_commands([serve, *db_sub.choices.values(), *token_sub.choices.values(), *signing])
