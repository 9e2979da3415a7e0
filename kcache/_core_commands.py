"""The core's own ``kcache`` commands: ``key``, ``compile``, ``verify``, ``gc`` and ``doctor``.

:func:`register` adds them to the parser, first (``kcache --help`` lists them before
the client's and the server's). With a server configured, ``key`` and ``compile`` run
through the client's ``kcache.remote`` entry point; without one they work on the
user's cache directory: ``kcache key`` learns the local toolchain's id from what the
last load wrote down (:func:`kcache.toolchain.toolchain_id`) instead of loading NVRTC,
and a local compile runs through :func:`kcache._waiting.run_long` (a status line while
NVRTC works, Ctrl-C at once). ``gc`` and ``verify`` work on a cache directory here
and hand a server's data directory to the server's ``kcache db gc|verify``;
``doctor``'s checks are :mod:`kcache._doctor`'s.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kcache._cli_parser import parser_providing
from kcache._waiting import run_long
from kcache.cli_toolkit import (
    UsageError,
    add_cache_dir_argument,
    add_recipe_arguments,
    add_server_arguments,
    include_set_dirs,
    print_result,
    readable_cache_dir,
    recipe_from_args,
    recipe_title,
    refuse_server_dir,
    server_url,
    write_output,
)
from kcache.dirs import (
    SERVER_DATABASE_FILE,
    cache_dir,
    cache_layout,
    directory_kind,
    full_cache_dir_message,
)
from kcache.errors import StoreFullError

if TYPE_CHECKING:
    from kcache.recipe import Recipe

__all__ = ["register"]


def register(sub: argparse._SubParsersAction[Any]) -> None:
    """Add the core's commands to the ``kcache`` parser's."""
    key = sub.add_parser(
        "key",
        help="print a recipe's key",
        description="Print the recipe key. A recipe that names no toolchain is keyed with the "
        "server's default toolchain where a server is configured, else with the local NVRTC's.",
    )
    add_recipe_arguments(key)
    add_server_arguments(key)
    key.set_defaults(func=_cmd_key)

    comp = sub.add_parser(
        "compile",
        help="compile a recipe (through the server where one is configured)",
        description="Compile a recipe and print one JSON line {status, recipe_key, digest, path}. "
        "With a server (--server / $KCACHE_URL) the server compiles (or has it: hit) and the "
        "artifact lands in your cache directory; without one it compiles here, into your cache "
        "directory. A compile error prints the compiler log and exits 1.",
    )
    add_recipe_arguments(comp)
    comp.add_argument("-o", metavar="FILE", help="also write the artifact to FILE")
    add_server_arguments(comp)
    add_cache_dir_argument(comp)
    comp.add_argument(
        "--local-compile",
        action="store_true",
        help="compile here if the server is unreachable (default $KCACHE_LOCAL_COMPILE)",
    )
    comp.set_defaults(func=_cmd_compile)

    for name, text in (
        ("verify", "re-hash every blob of a cache directory or a server data directory"),
        (
            "gc",
            "remove stale staging files and unreferenced blobs of a cache or server data directory",
        ),
    ):
        cmd = sub.add_parser(
            name,
            help=text,
            description=f"{text[0].upper()}{text[1:]}. Your cache directory by default; a "
            "server's data directory (one holding kcache.db, or --db-url) is handed to "
            f"`kcache db {name}`.",
        )
        where = cmd.add_mutually_exclusive_group()
        where.add_argument(
            "--cache-dir",
            metavar="DIR",
            help="a cache directory (default $KCACHE_CACHE_DIR, else ~/.cache/kcache/client)",
        )
        where.add_argument("--data-dir", metavar="DIR", help="a server's data directory")
        cmd.add_argument(
            "--db-url",
            metavar="URL",
            help="the server's database, where it is not kcache.db in the directory",
        )
        if name == "gc":
            cmd.add_argument(
                "--grace",
                type=float,
                default=3600.0,
                help="only touch files older than this (s, at least 600)",
            )
            cmd.add_argument(
                "--force",
                action="store_true",
                help="allow a grace under 600s (and, on a server directory, an index naming none of its blobs)",
            )
        cmd.set_defaults(func=_cmd_gc if name == "gc" else _cmd_verify)

    doctor = sub.add_parser(
        "doctor",
        help="check the toolchain, the sandbox, your cache directory, the server and its token",
        description="One line per check (ok, warn, FAIL and what to change), then a verdict; "
        "exit status 1 when a check failed. With a server (--server / $KCACHE_URL) it asks "
        "/healthz and then, with the token, GET /v1/toolchains: only that says the token works.",
    )
    add_cache_dir_argument(doctor)
    doctor.add_argument(
        "--data-dir",
        metavar="DIR",
        help="also check this server data directory (default $KCACHE_DATA_DIR)",
    )
    doctor.add_argument(
        "--server", metavar="URL", help="also check this server (default $KCACHE_URL)"
    )
    doctor.add_argument("--token", help="the token to check (default $KCACHE_TOKEN)")
    doctor.add_argument("--json", action="store_true", help="print the checks as JSON")
    doctor.set_defaults(func=_cmd_doctor)


# ---------------------------------------------------------------------------- key, compile
def _client_entry() -> Callable[[argparse.Namespace, Recipe], int]:
    """The client's ``kcache.remote`` entry point: ``key`` and ``compile`` through a server."""
    from importlib.metadata import entry_points

    remotes = entry_points(group="kcache.remote")
    if not remotes:
        raise UsageError(
            "a server is configured (--server / $KCACHE_URL) but the client is not installed: "
            "pip install ./client (kcache-client), or unset KCACHE_URL to work locally"
        )
    entry: Callable[[argparse.Namespace, Recipe], int] = next(iter(remotes)).load()
    return entry


def _cmd_key(args: argparse.Namespace) -> int:
    recipe = recipe_from_args(args)
    if server_url(args):  # the server's default toolchain keys the recipe, as `get` would
        return int(_client_entry()(args, recipe))
    if recipe.toolchain is None:
        from kcache.toolchain import toolchain_id

        recipe = recipe.with_defaults(toolchain=toolchain_id())
    unpinned = recipe.unpinned_include_sets()
    if unpinned:  # a key names a set by its contents: the directories --include-set gives
        from kcache.include_sets import IncludeSets

        dirs = include_set_dirs(args)
        missing = [name for name in unpinned if name not in dirs]
        if missing:
            raise UsageError(
                f"--include-set {missing[0]} names no directory here, so its contents (which "
                f"the key covers) are unknown: give --include-set {missing[0]}=DIR, or --server"
            )
        recipe = recipe.with_defaults(include_sets=IncludeSets(dirs).digests(max_age_s=0))
    print(recipe.key())
    return 0


def _cmd_compile(args: argparse.Namespace) -> int:
    recipe = recipe_from_args(args)
    if server_url(args):
        return int(_client_entry()(args, recipe))
    from kcache.local_engine import open_local_engine

    root = cache_dir(args.cache_dir)
    refuse_server_dir(root, "--cache-dir" if args.cache_dir else "$KCACHE_CACHE_DIR")
    engine = open_local_engine(root, include_sets=include_set_dirs(args))
    try:
        result = run_long(lambda: engine.resolve(recipe), f"compiling {recipe_title(recipe)}")
    except StoreFullError as exc:  # "no space left to publish <digest>": say where, and the fix
        code = exc.errno or errno.ENOSPC
        full = StoreFullError(full_cache_dir_message(root, code, "storing the kernel compiled"))
        full.errno = code  # one argument: the message alone, without "[Errno 28]"
        raise full from None
    path = engine.store.path(result.artifact.digest)
    if args.o:
        path = write_output("-o", args.o, engine.read(result.artifact))
    # A hit in the cache directory is what the client calls a node-tier hit.
    status = "local_hit" if result.status == "hit" else result.status
    print_result(status, result.recipe_key, result.artifact.digest, path)
    return 0


# ---------------------------------------------------------------------------- verify, gc
def _maintained_dir(args: argparse.Namespace) -> tuple[Path, str, bool]:
    """(directory, how it was named, whether it was named at all) for gc and verify."""
    if args.data_dir:
        return Path(args.data_dir), "--data-dir", True
    if args.cache_dir:
        return Path(args.cache_dir), "--cache-dir", True
    named = bool(os.environ.get("KCACHE_CACHE_DIR"))
    return cache_dir(), "$KCACHE_CACHE_DIR" if named else "the default cache directory", named


def _server_maintenance(args: argparse.Namespace, root: Path, option: str, command: str) -> int:
    """Hand a server's data directory to the server's ``kcache db gc|verify``."""
    db_url = args.db_url or os.environ.get("KCACHE_DB_URL")
    if not (root / SERVER_DATABASE_FILE).exists() and not db_url:
        raise UsageError(
            f"{root} ({option}) is a kcache server's data directory whose index is in a database "
            "(no kcache.db here): pass --db-url (or set KCACHE_DB_URL) to name it"
        )
    parser = parser_providing(["db", command])
    if parser is None:
        raise UsageError(
            f"{root} ({option}) is a kcache server's data directory; `kcache {command}` on it needs "
            "the server installed: pip install ./server (kcache-server)"
        )
    argv = ["db", command, "--data-dir", str(root)]
    if args.db_url:
        argv += ["--db-url", args.db_url]
    if command == "gc":
        argv += ["--grace", repr(args.grace)] + (["--force"] if args.force else [])
    delegated = parser.parse_args(argv)
    return int(delegated.func(delegated))


def _cmd_verify(args: argparse.Namespace) -> int:
    from kcache.maintenance import VerifyReport

    root, option, named = _maintained_dir(args)
    kind = directory_kind(root)
    if kind == "server" or args.db_url:
        return _server_maintenance(args, root, option, "verify")
    if not readable_cache_dir(root, option, named):
        report = VerifyReport()  # nothing cached yet: nothing to check, nothing created
    else:
        from kcache.index.file import FileIndex
        from kcache.maintenance import verify_store
        from kcache.store.local import LocalArtifactStore

        flat = cache_layout(root) == "flat"
        report = verify_store(LocalArtifactStore(root, flat=flat), FileIndex(root, flat=flat))
    print(
        json.dumps(
            {"checked": report.checked, "corrupt": report.corrupt, "missing": report.missing}
        )
    )
    return 0 if report.ok else 1


def _cmd_gc(args: argparse.Namespace) -> int:
    from kcache.maintenance import MIN_SAFE_GRACE_S, GcReport

    root, option, named = _maintained_dir(args)
    kind = directory_kind(root)
    if kind == "server" or args.db_url:
        return _server_maintenance(args, root, option, "gc")
    if args.grace < MIN_SAFE_GRACE_S and not args.force:
        raise UsageError(
            f"--grace {args.grace:g} is below {MIN_SAFE_GRACE_S:g}s: a compile publishes its blob before "
            "it records it, and a shorter grace can delete a blob about to be named; pass --force if no "
            "compile can be running"
        )
    if not readable_cache_dir(root, option, named):
        report = GcReport()
    else:
        from kcache.index.file import FileIndex
        from kcache.maintenance import collect_garbage, file_index_references
        from kcache.store.local import LocalArtifactStore

        flat = cache_layout(root) == "flat"
        referenced = file_index_references(FileIndex(root, flat=flat))
        report = collect_garbage(
            LocalArtifactStore(root, flat=flat), referenced, grace_seconds=args.grace
        )
    print(json.dumps(vars(report)))
    return 0


# ---------------------------------------------------------------------------- doctor
def _cmd_doctor(args: argparse.Namespace) -> int:
    from kcache._doctor import as_json, run_checks, summary

    token = args.token if args.token is not None else os.environ.get("KCACHE_TOKEN") or None
    token_from = "--token" if args.token is not None else "KCACHE_TOKEN"
    checks = run_checks(
        cache=args.cache_dir,
        data=args.data_dir,
        url=server_url(args),
        token=token or None,
        token_from=token_from,
    )
    print(as_json(checks) if args.json else summary(checks))
    return 1 if any(c.status == "fail" for c in checks) else 0
