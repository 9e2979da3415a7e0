"""The client's part of the ``kcache`` command: ``warmup``, ``get``, and ``compile --server``.

Registered through entry points (see ``client/pyproject.toml``), so the core CLI
never imports the client.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from kcache.cli import add_recipe_arguments, recipe_from_args
from kcache.errors import RecipeError
from kcache.recipe import Recipe
from kcache_client._cache import KernelCache
from kcache_client.errors import WarmupError

__all__ = ["compile_remote", "load_recipes", "register"]


def load_recipes(path: str | os.PathLike[str]) -> list[Recipe]:
    """Recipes from a file: a JSON list, ``{"recipes": [...]}``, or JSON lines."""
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
    if not isinstance(data, list):
        raise RecipeError("recipes", f"{file} must hold a list of recipes")
    recipes = []
    for i, item in enumerate(data):
        try:
            recipes.append(Recipe.from_dict(item))
        except RecipeError as exc:
            raise RecipeError(f"recipes[{i}].{exc.field}", exc.detail) from exc
    return recipes


def _cache_from_args(args: argparse.Namespace, *, server: str | None) -> KernelCache:
    return KernelCache(
        url=server,
        token=getattr(args, "token", None),
        cache_dir=getattr(args, "cache_dir", None),
        auto_target=getattr(args, "auto_target", None),
        local_compile=True if getattr(args, "local_compile", False) else None,
    )


def _line(status: str, key: str, digest: str, path: Path) -> str:
    return json.dumps({"status": status, "recipe_key": key, "digest": digest, "path": str(path)})


def _cmd_warmup(args: argparse.Namespace) -> int:
    recipes = load_recipes(args.file)
    with _cache_from_args(args, server=args.server) as cache:
        try:
            result = cache.warmup(recipes, compile=not args.no_compile, progress=not args.quiet)
        except WarmupError as exc:
            if exc.log:
                print(exc.log, file=sys.stderr)
            print(f"kcache: {exc}", file=sys.stderr)
            return 1
        for art, status in zip(result.artifacts, result.statuses, strict=True):
            print(_line(status, art.recipe_key, art.digest, art.path))
    return 0


def compile_remote(args: argparse.Namespace, recipe: Recipe) -> int:
    """``kcache compile --server URL``: resolve through the server, print the JSON line.

    Entry point of the ``kcache.remote`` group; a compile error propagates as a
    CompileError, which the core CLI prints with its log and exit status 1.
    """
    with _cache_from_args(args, server=args.server) as cache:
        resolved = cache.resolve(recipe)
        art = resolved.artifact
        path = art.path
        if getattr(args, "o", None):
            path = Path(args.o)
            path.write_bytes(art.data)
        print(_line(resolved.status, art.recipe_key, art.digest, path))
    return 0


def _cmd_get(args: argparse.Namespace) -> int:
    recipe = recipe_from_args(args)
    with _cache_from_args(args, server=args.server) as cache:
        resolved = cache.obtain(recipe, compile=args.compile)
        art = resolved.artifact
        path = art.path
        if args.o:
            path = Path(args.o)
            path.write_bytes(art.data)
        print(_line(resolved.status, art.recipe_key, art.digest, path))
    return 0


def register(subparsers: Any) -> None:
    """Entry point of the ``kcache.commands`` group: adds ``kcache warmup`` and ``kcache get``."""
    get = subparsers.add_parser(
        "get", help="fetch a recipe's artifact (node tier, then the server; no compile by default)"
    )
    add_recipe_arguments(get)
    get.add_argument("-o", metavar="FILE", help="also write the artifact to FILE")
    get.add_argument("--server", help="server URL (default $KCACHE_URL)")
    get.add_argument("--token", help="bearer token (default $KCACHE_TOKEN)")
    get.add_argument("--cache-dir", help="node-local tier (default $KCACHE_CACHE_DIR)")
    get.add_argument("--auto-target", help='what target "auto" means (default: this GPU)')
    get.add_argument("--compile", action="store_true", help="let the server compile it if absent")
    get.set_defaults(func=_cmd_get)

    warm = subparsers.add_parser(
        "warmup", help="resolve a list of recipes into the server and the node tier"
    )
    warm.add_argument("file", help='a JSON list of recipes, {"recipes": [...]}, or JSON lines')
    warm.add_argument("--server", help="server URL (default $KCACHE_URL)")
    warm.add_argument("--token", help="bearer token (default $KCACHE_TOKEN)")
    warm.add_argument("--cache-dir", help="node-local tier (default $KCACHE_CACHE_DIR)")
    warm.add_argument("--auto-target", help='what target "auto" means (default: this GPU)')
    warm.add_argument(
        "--no-compile", action="store_true", help="fetch only; fail on recipes nobody compiled"
    )
    warm.add_argument(
        "--local-compile", action="store_true", help="compile locally if the server is down"
    )
    warm.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    warm.set_defaults(func=_cmd_warmup)
