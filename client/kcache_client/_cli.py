"""The client's part of the ``kcache`` command: ``get``, ``warmup``, and ``compile``/``key`` through a server.

Registered through entry points (see ``client/pyproject.toml``), so the core CLI
never imports the client. :func:`register` needs argparse only: ``KernelCache`` (and
with it httpx) is imported when a command runs, so ``kcache --help`` stays instant.

Every command builds its ``KernelCache`` the same way (:func:`_open_cache`): the
server of ``--server``/``$KCACHE_URL`` if any, the cache directory of
``--cache-dir``/``$KCACHE_CACHE_DIR``, local compiles on without a server (or with
``--local-compile``), and retries kept to a few seconds with a status line on stderr,
so a dead server is reported quickly rather than after a silent minute
(:mod:`kcache_client._command_settings`). A lookup that takes longer (a compile on
the server, or here) prints a status line while it waits and stops at Ctrl-C
(:func:`kcache._waiting.run_long`). An ``https://`` URL whose server speaks plain
HTTP is told as that, not as a server to start.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kcache._waiting import run_long
from kcache.cli_toolkit import (
    UsageError,
    add_cache_dir_argument,
    add_recipe_arguments,
    add_server_arguments,
    print_result,
    recipe_from_args,
    recipe_title,
    refuse_server_dir,
    server_url,
    write_output,
)
from kcache.dirs import cache_dir
from kcache.errors import ArtifactNotFoundError, KCacheError, RecipeError

if TYPE_CHECKING:
    from kcache.recipe import Recipe
    from kcache_client._cache import KernelCache

__all__ = ["compile_remote", "load_recipes", "register"]

#: How long a command waits, at its end, to deliver its audit events.
_EVENTS_CLOSE_S = 2.0


def load_recipes(path: str | os.PathLike[str]) -> list[Recipe]:
    """Recipes from a file: a JSON list, ``{"recipes": [...]}``, or JSON lines."""
    from kcache.recipe import Recipe

    file = Path(path)
    try:
        text = file.read_text()
    except OSError as exc:
        raise RecipeError("recipes", f"cannot read {file}: {exc.strerror}") from exc
    try:
        data: Any = json.loads(text)
    except ValueError:
        try:
            data = [json.loads(line) for line in text.splitlines() if line.strip()]
        except ValueError as exc:
            raise RecipeError("recipes", f"{file} is neither JSON nor JSON lines: {exc}") from exc
    if isinstance(data, dict) and "recipes" in data:
        data = data["recipes"]
    if isinstance(data, dict):
        data = [data]
    if not isinstance(data, list) or not data:
        raise RecipeError("recipes", f"{file} must hold a non-empty list of recipes")
    recipes = []
    for i, item in enumerate(data):
        try:
            recipes.append(Recipe.from_dict(item))
        except RecipeError as exc:
            raise RecipeError(f"recipes[{i}].{exc.field}", f"{exc.detail} (in {file})") from exc
    return recipes


def _open_cache(args: argparse.Namespace, url: str | None) -> KernelCache:
    import logging

    from kcache_client._cache import OFFLINE_LOGGER
    from kcache_client._command_settings import command_cache

    # The commands say in their own words that the server did not answer (_note_offline).
    quiet = logging.getLogger(OFFLINE_LOGGER)
    quiet.propagate = False
    if not quiet.handlers:
        quiet.addHandler(logging.NullHandler())
    explicit = getattr(args, "cache_dir", None)
    refuse_server_dir(cache_dir(explicit), "--cache-dir" if explicit else "$KCACHE_CACHE_DIR")
    return command_cache(args, url)


@contextmanager
def _session(args: argparse.Namespace, url: str | None, what: str) -> Iterator[KernelCache]:
    """A KernelCache for one command; its errors told with flags, not Python arguments."""
    from kcache_client.errors import (
        AuthenticationError,
        NoDeviceError,
        RemoteNotFoundError,
        ServerUnavailableError,
    )

    cache = _open_cache(args, url)
    try:
        yield cache
    except NoDeviceError as exc:
        raise UsageError(
            'the recipe\'s target is "auto", and this machine has no usable GPU to resolve it: '
            "pass --target sm_XX (or --auto-target sm_XX where the command has it)"
        ) from exc
    except AuthenticationError as exc:
        raise UsageError(
            f"{exc}\npass a token with --token or $KCACHE_TOKEN "
            "(the server's operator creates one: kcache token create NAME --scope compile)"
        ) from exc
    except RemoteNotFoundError as exc:
        if getattr(args, "compile", True):
            raise
        raise ArtifactNotFoundError(
            f"{exc}\nthe server has no artifact for it and --no-compile was given: drop --no-compile to compile it"
        ) from exc
    except ServerUnavailableError as exc:
        raise _offline_error(exc, cache, url, what) from exc
    finally:
        if cache.events is not None:
            cache.events.close(_EVENTS_CLOSE_S)
        cache.close()


def _offline_error(
    exc: BaseException, cache: KernelCache, url: str | None, what: str
) -> KCacheError:
    from kcache_client._http import tls_advice
    from kcache_client.errors import ServerUnavailableError

    tier = cache.tier.root
    if url is None:  # nothing configured: only --no-compile leads here
        return ArtifactNotFoundError(
            f"the cache directory {tier} has no artifact for this recipe and --no-compile was given: "
            "drop --no-compile to compile it here, or pass --server URL"
        )
    root = exc
    while isinstance(root.__cause__, ServerUnavailableError):
        root = root.__cause__
    cause = root.cause if isinstance(root, ServerUnavailableError) else str(exc)
    if isinstance(exc, ServerUnavailableError) and "overloaded" in cause:
        first = f"the server at {url} stayed busy ({cause})"
    else:
        first = f"server unreachable at {url} ({cause})"
    if tls_advice(url, cause):  # the cause says what to change; starting a server is not it
        return KCacheError(first)
    if what == "key":
        advice = (
            "a recipe that names no toolchain is keyed with the server's default toolchain: start the "
            "server, or key with the local NVRTC by leaving the server out (--server '' or unset KCACHE_URL)"
        )
    else:
        advice = (
            f"the cache directory {tier} does not hold {what} either: start the server (or check "
            "--server / $KCACHE_URL), or pass --local-compile to compile here"
        )
    return KCacheError(f"{first}\n{advice}")


def _note_offline(cache: KernelCache, url: str | None, status: str, *, asked_server: bool) -> None:
    """Say on stderr that an answer came without the configured server.

    ``asked_server``: the command asks the server first (``compile``), so a
    ``local_hit`` means the server did not answer; ``get`` asks the tier first.
    """
    if url is None:
        return
    if cache.stats.local_compiles:
        print(
            f"kcache: server unreachable at {url}; compiled here (--local-compile)", file=sys.stderr
        )
    elif asked_server and status == "local_hit":
        print(
            f"kcache: server unreachable at {url}; answered from the cache directory {cache.tier.root}",
            file=sys.stderr,
        )


def _prepare(cache: KernelCache, recipe: Recipe, url: str | None) -> Recipe:
    """The concrete recipe; a server that cannot say its default toolchain is told as such."""
    from kcache_client._http import tls_advice
    from kcache_client.errors import ServerUnavailableError

    try:
        return cache.prepare(recipe)
    except ServerUnavailableError as exc:
        if url is None:
            raise
        root: BaseException = exc
        while isinstance(root.__cause__, ServerUnavailableError):
            root = root.__cause__
        cause = root.cause if isinstance(root, ServerUnavailableError) else str(exc)
        if tls_advice(url, cause):
            raise KCacheError(f"server unreachable at {url} ({cause})") from exc
        raise KCacheError(
            f"server unreachable at {url} ({cause})\nthe recipe names no toolchain and this "
            "server's default was never seen here, so its key is unknown: start the server, or "
            "pass --local-compile to key and compile with the local NVRTC"
        ) from exc


def _resolving(recipe: Recipe, url: str | None, cache: KernelCache) -> str:
    """What a status line says a command is waiting for."""
    if url is None:
        return f"compiling {recipe_title(recipe)}"
    here = ", or compiling it here" if cache.settings.compiles_locally else ""
    return (
        f"resolving {recipe_title(recipe)} with the server at {url} (a compile there may take "
        f"up to its KCACHE_COMPILE_TIMEOUT_S){here}"
    )


def compile_remote(args: argparse.Namespace, recipe: Recipe) -> int:
    """``kcache compile`` and ``kcache key`` where a server is configured.

    Entry point of the ``kcache.remote`` group. ``compile`` asks the server to resolve
    the recipe (hit, or compile) even when the cache directory has it, then fills the
    directory; with the server down it answers from the directory (``local_hit``, as
    ``kcache get`` would), or compiles here with ``--local-compile``. ``key`` keys with
    the server's default toolchain. A compile error propagates as a CompileError, which
    the core CLI prints with its log and exit status 1.
    """
    url = server_url(args)
    if args.command == "key":
        with _session(args, url, "key") as cache:
            print(cache.key(recipe))
        return 0
    with _session(args, url, "this recipe") as cache:
        concrete = _prepare(cache, recipe, url)
        art = run_long(lambda: cache.get(concrete, refresh=True), _resolving(concrete, url, cache))
        path = write_output("-o", args.o, art.data) if args.o else art.path
        _note_offline(cache, url, art.outcome, asked_server=True)
        print_result(art.outcome, art.recipe_key, art.digest, path)
    return 0


def _cmd_get(args: argparse.Namespace) -> int:
    recipe = recipe_from_args(args)
    url = server_url(args)
    with _session(args, url, "this recipe") as cache:
        concrete = _prepare(cache, recipe, url)
        art = run_long(
            lambda: cache.get(concrete, compile=args.compile), _resolving(concrete, url, cache)
        )
        path = write_output("-o", args.o, art.data) if args.o else art.path
        _note_offline(cache, url, art.outcome, asked_server=False)
        print_result(art.outcome, art.recipe_key, art.digest, path)
    return 0


def _cmd_warmup(args: argparse.Namespace) -> int:
    from kcache_client._artifact import Artifact
    from kcache_client._job_cli import load_manifest, prefetch_summary
    from kcache_client._warmup import recipe_outcome

    if args.file is None and args.manifest is None:
        raise UsageError("give a recipes FILE, a --manifest FILE, or both")
    manifest = load_manifest(args.manifest, "--manifest") if args.manifest else None
    try:
        recipes = load_recipes(args.file) if args.file else []
    except RecipeError as exc:
        raise UsageError(f"{args.file}: {exc}") from exc
    url = server_url(args)
    complete = True
    with _session(args, url, "the recipes missing from it") as cache:
        if manifest is not None:  # the same prefetch as `kcache prefetch --manifest`
            done = run_long(
                lambda: cache.prefetch(manifest),
                f"prefetching the {len(manifest)} kernels of manifest {manifest.digest[:16]}",
            )
            print(json.dumps(prefetch_summary(done), sort_keys=True))
            complete = done.complete
        if not recipes:
            return 0 if complete else 1
        # One process is its own leader: each recipe's result, a failure beside the others.
        results = run_long(
            lambda: cache.get_many(recipes, compile=args.compile, progress=not args.quiet),
            f"warming up {len(recipes)} recipes",
            status=False,  # its progress bar says how far it is
        )
        for i, result in enumerate(results):
            if isinstance(result, Artifact):
                print_result(result.outcome, result.recipe_key, result.digest, result.path)
                continue
            complete = False
            outcome = recipe_outcome(getattr(result, "recipe_key", None) or "", result)
            log = outcome.pop("log", "")
            if log:
                print(log.rstrip(), file=sys.stderr)
            print(f"kcache: recipes[{i}]: {outcome['detail']}", file=sys.stderr)
            print(json.dumps({**outcome, "recipe_key": outcome["recipe_key"] or None}))
        if url and cache.stats.local_compiles:
            print(
                f"kcache: server unreachable at {url}; {cache.stats.local_compiles} recipes compiled here",
                file=sys.stderr,
            )
    return 0 if complete else 1


def _add_client_arguments(parser: argparse.ArgumentParser) -> None:
    add_server_arguments(parser)
    add_cache_dir_argument(parser)
    parser.add_argument(
        "--auto-target", metavar="SM", help='what target "auto" means (default: this GPU)'
    )
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="compile what nobody compiled yet (the server, or here without one); --no-compile only fetches",
    )
    parser.add_argument(
        "--local-compile",
        action="store_true",
        help="compile here if the server is unreachable (default $KCACHE_LOCAL_COMPILE; always on without a server)",
    )


def register(subparsers: Any) -> None:
    """Entry point of the ``kcache.commands`` group: adds ``kcache get`` and ``kcache warmup``."""
    get = subparsers.add_parser(
        "get",
        help="fetch a recipe's artifact: cache directory, then the server (compiling on a miss)",
        description="Print one JSON line {status, recipe_key, digest, path}: local_hit from your "
        "cache directory, hit from the server, compiled/waited where it had to be compiled (by "
        "the server, or here without one).",
    )
    add_recipe_arguments(get)
    get.add_argument("-o", metavar="FILE", help="also write the artifact to FILE")
    _add_client_arguments(get)
    get.set_defaults(func=_cmd_get)

    warm = subparsers.add_parser(
        "warmup",
        help="resolve a list of recipes into the server and your cache directory",
        description="Resolve every recipe once (through /v1/resolve/batch where a server is "
        "configured) and fill your cache directory; prints one JSON line per recipe, a failed "
        'one as {"status": "error", ...} (its log on stderr; exit 1). With '
        "--manifest, first fetches what the directory lacks of a job's manifest in one request "
        "(as kcache prefetch does) and prints its line; exit 1 when the server lacked some.",
    )
    warm.add_argument(
        "file", nargs="?", help='a JSON list of recipes, {"recipes": [...]}, or JSON lines'
    )
    warm.add_argument(
        "--manifest",
        metavar="FILE",
        help="a job's manifest (kcache manifest save) to prefetch first, in one request per node",
    )
    _add_client_arguments(warm)
    warm.add_argument(
        "--include-set",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="the directory an include set stands for in local compiles (repeatable)",
    )
    warm.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    warm.set_defaults(func=_cmd_warmup)

    from kcache_client._cache_cli import register as register_cache_commands
    from kcache_client._config_cli import register as register_config
    from kcache_client._explain_cli import register as register_explain
    from kcache_client._job_cli import register as register_jobs
    from kcache_client._trust_cli import register as register_trust

    register_cache_commands(subparsers)  # kcache cache info|ls|rm|clear, kcache pin|unpin
    register_explain(subparsers)  # kcache explain RECIPE|KEY
    register_config(subparsers)  # kcache config
    register_jobs(subparsers)  # kcache manifest|prefetch|bundle|layers
    register_trust(subparsers)  # kcache trust list|forget|pin
