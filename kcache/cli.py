"""The ``kcache`` command.

The core provides ``key`` and ``compile``. The server and client distributions add
their own subcommands (``serve``, ``db``, ``token``, ``warmup``, ``stats`` ...) through
the ``kcache.commands`` entry-point group, so the core never imports them: each entry
point is a function ``register(subparsers)`` that adds parsers whose ``func`` default
takes the parsed arguments and returns an exit code.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from kcache.dirs import data_dir, toolchain_dir
from kcache.errors import CompileError, KCacheError, RecipeError
from kcache.recipe import Recipe

__all__ = ["add_recipe_arguments", "main", "recipe_from_args"]


def add_recipe_arguments(parser: argparse.ArgumentParser) -> None:
    """The options that build a recipe from a .cu file (ignored with a JSON recipe)."""
    parser.add_argument(
        "recipe", help="a recipe JSON file, or a .cu source file with the options below"
    )
    parser.add_argument("--target", help="sm_XX, sm_XXa, sm_XXf or compute_XX")
    parser.add_argument(
        "--flag", action="append", default=[], help="an NVRTC option (repeatable, order kept)"
    )
    parser.add_argument(
        "--header", action="append", default=[], metavar="NAME=FILE", help="an in-memory header"
    )
    parser.add_argument(
        "--define", action="append", default=[], metavar="NAME[=VALUE]", help="adds -DNAME=VALUE"
    )
    parser.add_argument(
        "--spec",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="a specialization value, e.g. shape=[4,4]",
    )
    parser.add_argument(
        "--name-expression", action="append", default=[], help="e.g. 'add<float, 256>'"
    )
    parser.add_argument(
        "--output", choices=["cubin", "ptx", "ltoir"], help="what to produce (default cubin)"
    )
    parser.add_argument("--name", help="program name given to NVRTC (default kernel.cu)")
    parser.add_argument(
        "--include-set", action="append", default=[], help="a registered include set to use"
    )


def _split(option: str, text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise RecipeError(option, f"{text!r} must look like NAME=VALUE")
    return name, value


def recipe_from_args(args: argparse.Namespace) -> Recipe:
    """Build the recipe the command line describes."""
    path = Path(args.recipe)
    try:
        text = path.read_text()
    except OSError as exc:
        raise RecipeError("recipe", f"cannot read {path}: {exc.strerror}") from exc
    data: dict[str, Any]
    if path.suffix == ".json":
        data = json.loads(text) if text.strip() else {}
        recipe = Recipe.from_json(text)
        data = recipe.to_dict()
    else:
        data = {"source": text, "name": path.name}
    headers = dict(data.get("headers", {}))
    for item in args.header:
        name, file = _split("--header", item)
        headers[name] = Path(file).read_text()
    spec = dict(data.get("specialization", {}))
    for item in args.spec:
        key, value = _split("--spec", item)
        try:
            spec[key] = json.loads(value)
        except ValueError:
            spec[key] = value
    flags = list(data.get("flags", []))
    flags += [f"-D{d}" for d in args.define] + list(args.flag)
    data.update(headers=headers, specialization=spec, flags=flags)
    data["name_expressions"] = list(data.get("name_expressions", [])) + list(args.name_expression)
    data["include_sets"] = list(data.get("include_sets", [])) + list(args.include_set)
    for option in ("target", "output", "name"):
        if getattr(args, option):
            data[option] = getattr(args, option)
    return Recipe.from_dict(data)


def _cmd_key(args: argparse.Namespace) -> int:
    from kcache.toolchain import load_toolchain

    recipe = recipe_from_args(args)
    if recipe.toolchain is None:
        recipe = recipe.with_defaults(toolchain=load_toolchain().id)
    print(recipe.key())
    return 0


def _cmd_compile(args: argparse.Namespace) -> int:
    recipe = recipe_from_args(args)
    if args.server:
        return _remote_compile(args, recipe)
    from kcache.local import open_local_engine

    engine = open_local_engine(args.data_dir)
    result = engine.resolve(recipe)
    path = engine.store.path(result.artifact.digest)
    if args.o:
        Path(args.o).write_bytes(engine.read(result.artifact))
        path = Path(args.o)
    print(
        json.dumps(
            {
                "status": result.status,
                "recipe_key": result.recipe_key,
                "digest": result.artifact.digest,
                "path": str(path),
            }
        )
    )
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    from kcache.index.file import FileIndex
    from kcache.maintenance import check_file_indexed, verify_store
    from kcache.store.local import LocalArtifactStore

    root = data_dir(args.data_dir)
    check_file_indexed(root)
    report = verify_store(LocalArtifactStore(root), FileIndex(root))
    print(
        json.dumps(
            {"checked": report.checked, "corrupt": report.corrupt, "missing": report.missing}
        )
    )
    return 0 if report.ok else 1


def _cmd_gc(args: argparse.Namespace) -> int:
    from kcache.index.file import FileIndex
    from kcache.maintenance import check_file_indexed, collect_garbage, file_index_references
    from kcache.store.local import LocalArtifactStore

    root = data_dir(args.data_dir)
    check_file_indexed(root)
    referenced = file_index_references(FileIndex(root))
    report = collect_garbage(LocalArtifactStore(root), referenced, grace_seconds=args.grace)
    print(json.dumps(vars(report)))
    return 0


def _sandbox_check() -> str:
    """Whether `kcache serve` could confine its compile workers with Landlock here."""
    import os

    from kcache.sandbox import probe

    if os.environ.get("KCACHE_COMPILE_SANDBOX", "").strip().lower() == "off":
        return "off: KCACHE_COMPILE_SANDBOX=off, server compile workers are not confined"
    status = probe()
    if status.abi > 0:
        return f"ok: {status.detail}; server compile workers will be confined"
    return (
        f"UNAVAILABLE: {status.detail}. `kcache serve` refuses to start on a non-loopback address "
        "(unless compile_sandbox=best-effort) and runs its compile workers unconfined on loopback"
    )


def _cmd_doctor(args: argparse.Namespace) -> int:
    from kcache.toolchain import load_toolchain

    root = data_dir(args.data_dir)
    checks: dict[str, object] = {"data_dir": str(root.resolve())}
    status = 0
    try:
        toolchain = load_toolchain()
        checks["toolchain"] = toolchain.describe()
        checks["bundled_headers"] = str(toolchain.include_dir)
        checks["cuda_fp16.h"] = (toolchain.include_dir / "cuda_fp16.h").is_file()
    except KCacheError as exc:
        checks["toolchain"] = f"unusable: {exc}"
        status = 1
    checks["toolchain_dir"] = str(toolchain_dir())
    checks["compile_sandbox"] = _sandbox_check()
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / ".doctor-probe"
        probe.write_bytes(b"ok")
        probe.unlink()
        checks["data_dir_writable"] = True
    except OSError as exc:
        checks["data_dir_writable"] = f"no: {exc.strerror}"
        status = 1
    print(json.dumps(checks, indent=2))
    return status


def _remote_compile(args: argparse.Namespace, recipe: Recipe) -> int:
    remotes = entry_points(group="kcache.remote")
    if not remotes:
        print(
            "kcache: --server needs the client: pip install ./client (kcache-client)",
            file=sys.stderr,
        )
        return 2
    compile_remote = next(iter(remotes)).load()
    return int(compile_remote(args, recipe))


def build_parser() -> argparse.ArgumentParser:
    """The full parser, core commands plus those the installed distributions register."""
    parser = argparse.ArgumentParser(
        prog="kcache", description="content-addressed JIT kernel cache"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    key = sub.add_parser("key", help="print a recipe's key")
    add_recipe_arguments(key)
    key.set_defaults(func=_cmd_key)

    comp = sub.add_parser("compile", help="compile a recipe into the cache (or fetch it)")
    add_recipe_arguments(comp)
    comp.add_argument("-o", metavar="FILE", help="also write the artifact to FILE")
    where = comp.add_mutually_exclusive_group()
    where.add_argument(
        "--data-dir", help="local data directory (default $KCACHE_DATA_DIR or ./.kcache)"
    )
    where.add_argument("--server", help="compile through a kcache server at this URL")
    comp.add_argument("--token", help="bearer token for --server (default $KCACHE_TOKEN)")
    comp.set_defaults(func=_cmd_compile)

    verify = sub.add_parser("verify", help="re-hash every blob of a local data directory")
    verify.add_argument("--data-dir", help="default $KCACHE_DATA_DIR or ./.kcache")
    verify.set_defaults(func=_cmd_verify)

    gc = sub.add_parser("gc", help="remove stale staging files and unreferenced blobs")
    gc.add_argument("--data-dir", help="default $KCACHE_DATA_DIR or ./.kcache")
    gc.add_argument(
        "--grace", type=float, default=3600.0, help="only touch files older than this (s)"
    )
    gc.set_defaults(func=_cmd_gc)

    doctor = sub.add_parser("doctor", help="check the toolchain and the data directory")
    doctor.add_argument("--data-dir", help="default $KCACHE_DATA_DIR or ./.kcache")
    doctor.set_defaults(func=_cmd_doctor)

    for ep in entry_points(group="kcache.commands"):
        ep.load()(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kcache`` command."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except CompileError as exc:
        print(exc.log, file=sys.stderr)
        print(f"kcache: {exc}", file=sys.stderr)
        return 1
    except KCacheError as exc:
        print(f"kcache: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:  # bad JSON on the command line
        print(f"kcache: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
