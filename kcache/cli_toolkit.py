"""What the ``kcache`` commands of every distribution are built from.

The core's commands (:mod:`kcache._core_commands`) and those the client and the
server register (:mod:`kcache.cli` says how) share these, so a flag, a message and
an output line read the same whichever distribution's command shows it:

- :class:`UsageError`, for a wrong flag, file or environment variable (exit status 2);
- the shared options and what they name: ``--server``/``--token``
  (:func:`server_url`), ``--cache-dir`` (and :func:`refuse_server_dir`, which keeps a
  server's data directory out of client commands), a recipe's options
  (:func:`recipe_from_args`, :func:`include_set_dirs`);
- the one JSON result line (:func:`print_result`), ``-o`` (:func:`write_output`);
- :func:`run_command`, to run a command another distribution provides.

Only argparse and the core's light modules are imported here (the recipe itself when
one is read), so ``kcache --help`` stays instant.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from kcache._cli_parser import parser_providing
from kcache.dirs import CACHE_TAG_FILE, LAYOUT_FILE, directory_kind
from kcache.errors import KCacheError, RecipeError

if TYPE_CHECKING:
    from kcache.recipe import Recipe

T = TypeVar("T")

__all__ = [
    "UsageError",
    "add_cache_dir_argument",
    "add_recipe_arguments",
    "add_server_arguments",
    "include_set_dirs",
    "print_result",
    "recipe_from_args",
    "recipe_title",
    "refuse_server_dir",
    "run_command",
    "server_url",
    "write_output",
]

#: What to say when a header could not be found, on top of the compiler's own words.
HEADER_HINT = (
    "pass the header with --header NAME=FILE, or its directory with --include-set NAME=DIR"
)

#: Recipe fields and the options that set them, so errors name what the user typed.
FIELD_FLAGS = {
    "target": "--target",
    "flags": "--flag",
    "headers": "--header",
    "specialization": "--spec",
    "name_expressions": "--name-expression",
    "output": "--output",
    "name": "--name",
    "include_sets": "--include-set",
}


class UsageError(KCacheError):
    """The command line is wrong: a flag, a file it names, or an environment variable.

    The text names it and says what to do; the command exits with status 2.
    """


# ---------------------------------------------------------------------------- server, cache dir
def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """``--server`` and ``--token``: the server every command that can use one uses."""
    parser.add_argument(
        "--server",
        metavar="URL",
        help="the kcache server to use (default $KCACHE_URL; empty or unset: none, work on the cache directory)",
    )
    parser.add_argument("--token", help="bearer token for the server (default $KCACHE_TOKEN)")


def add_cache_dir_argument(parser: argparse.ArgumentParser) -> None:
    """``--cache-dir``: the user's cache directory (the client's node tier)."""
    parser.add_argument(
        "--cache-dir",
        metavar="DIR",
        help="your cache directory (default $KCACHE_CACHE_DIR, else ~/.cache/kcache/client)",
    )


def server_url(args: argparse.Namespace) -> str | None:
    """``--server``, else ``$KCACHE_URL``; None when neither names one (an empty value included)."""
    explicit = getattr(args, "server", None)
    url = explicit if explicit is not None else os.environ.get("KCACHE_URL", "")
    url = url.strip()
    if url and not re.fullmatch(r"https?://[^/\s]+(/\S*)?", url):
        where = "--server" if explicit is not None else "KCACHE_URL"
        raise UsageError(f"{where}={url!r} is not a server URL: write it as http://HOST:PORT")
    return url or None


def refuse_server_dir(root: Path, option: str) -> None:
    """Refuse to use a server's data directory as a cache directory (client commands never write one)."""
    if directory_kind(root) == "server":
        raise UsageError(
            f"{root} ({option}) is a kcache server's data directory, which only server commands write; "
            "use your cache directory (--cache-dir, $KCACHE_CACHE_DIR), or compile through the server (--server URL)"
        )


def readable_cache_dir(root: Path, option: str, named: bool) -> bool:
    """Whether ``root`` holds a cache for a command that reads or tidies one (verify, gc,
    cache info and ls, layers): a directory kcache marked (its tag, layout file, blobs or
    index), else nothing (an empty one, or a default one not made yet).

    Refused, by ``option``: a directory ``named`` (a flag, a variable) that is missing or a
    file (a typo must not make a new cache), and any with other things in it and no mark
    (a project's: those commands turned it into a cache directory, ``LAYOUT``, ``blobs/``,
    ``index/``, before).
    """
    if not root.is_dir():
        if named:
            what = "is a file, not a directory" if root.exists() else "does not exist"
            raise UsageError(f"{root} ({option}) {what}: name a cache directory")
        return False
    marks = (CACHE_TAG_FILE, LAYOUT_FILE, "blobs", "index")
    if any((root / mark).exists() for mark in marks):
        return True
    if any(root.iterdir()):
        raise UsageError(
            f"{root} ({option}) is not a kcache cache directory (it holds other files, and no "
            f"{CACHE_TAG_FILE}, blobs or index): name a cache directory, or a server's data "
            "directory with --data-dir"
        )
    return False


# ---------------------------------------------------------------------------- a recipe
def add_recipe_arguments(parser: argparse.ArgumentParser) -> None:
    """The options that build a recipe from a .cu file (on a JSON recipe they add to its fields)."""
    parser.add_argument(
        "recipe", help="a recipe JSON file, or a .cu source file with the options below"
    )
    parser.add_argument(
        "--target",
        help="sm_XX, sm_XXa (from sm_90a), sm_XXf (from sm_100f) (cubin) or compute_XX (PTX)",
    )
    parser.add_argument(
        "--flag",
        action="append",
        default=[],
        metavar="OPTION",
        help="an NVRTC option, e.g. --flag=--use_fast_math (repeatable, order kept; join a value that starts with - by =)",
    )
    parser.add_argument(
        "--header",
        action="append",
        default=[],
        metavar="NAME=FILE",
        help='an in-memory header: #include "NAME" reads FILE; FILE alone names it by its '
        "file name (repeatable)",
    )
    parser.add_argument(
        "--define", action="append", default=[], metavar="NAME[=VALUE]", help="adds -DNAME=VALUE"
    )
    parser.add_argument(
        "--spec",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="a specialization value, e.g. shape=[4,4] or dtype=float16",
    )
    parser.add_argument(
        "--name-expression", action="append", default=[], help="e.g. 'add<float, 256>'"
    )
    parser.add_argument(
        "--output", choices=["cubin", "ptx", "ltoir"], help="what to produce (default cubin)"
    )
    parser.add_argument("--name", help="program name given to NVRTC (default: the file's name)")
    parser.add_argument(
        "--include-set",
        action="append",
        default=[],
        metavar="NAME[=DIR]",
        help="an include set the recipe uses: a server's registered NAME, and for local "
        "compiles the directory DIR it stands for (repeatable)",
    )


def _split(option: str, text: str, form: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise UsageError(f"{option} {text!r} must look like {form}")
    return name, value


def _header_item(item: str) -> tuple[str, str]:
    """``--header NAME=FILE``, or ``--header FILE``: the header named by its file name."""
    if "=" not in item:
        name = Path(item).name
        if not name:
            raise UsageError(f"--header {item!r} must look like NAME=FILE or FILE")
        return name, item
    return _split("--header", item, "NAME=FILE or FILE")


def include_set_dirs(args: argparse.Namespace) -> dict[str, Path]:
    """The directories ``--include-set NAME=DIR`` registers for local compiles."""
    dirs: dict[str, Path] = {}
    for item in getattr(args, "include_set", []):
        name, sep, folder = item.partition("=")
        if not sep:
            continue
        if not name or not folder:
            raise UsageError(f"--include-set {item!r} must look like NAME or NAME=DIR")
        path = Path(folder).expanduser()
        if not path.is_dir():
            raise UsageError(f"--include-set {item}: {path} is not a directory")
        dirs[name] = path
    return dirs


def _read(option: str, path: Path) -> str:
    """A source, header or recipe file's text: UTF-8, a byte-order mark some editors write
    at its start left out (NVRTC reads it as stray tokens; nvcc skips it)."""
    try:
        return path.read_text(encoding="utf-8-sig")
    except OSError as exc:
        raise UsageError(f"{option}: cannot read {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise UsageError(f"{option}: {path} is not UTF-8 text: {exc.reason}") from exc


def recipe_from_args(args: argparse.Namespace) -> Recipe:
    """Build the recipe the command line describes; errors name the option or file."""
    from kcache.recipe import Recipe

    path = Path(args.recipe)
    _check_output(args, [path, *(Path(_header_item(h)[1]).expanduser() for h in args.header)])
    text = _read("recipe", path)
    data: dict[str, Any]
    from_json = path.suffix == ".json"
    if from_json:
        try:
            loaded = json.loads(text)
        except ValueError as exc:
            raise UsageError(f"{path} is not valid JSON: {exc}") from exc
        if not isinstance(loaded, dict):
            raise UsageError(
                f"{path} must hold one recipe object (a list is `kcache warmup`'s input)"
            )
        data = dict(loaded)
    else:
        data = {"source": text, "name": path.name}
    headers = _from_file(path, data, "headers", dict)
    for item in args.header:
        name, file = _header_item(item)
        headers[name] = _read(f"--header {item}", Path(file).expanduser())
    spec = _from_file(path, data, "specialization", dict)
    for item in args.spec:
        key, value = _split("--spec", item, "KEY=JSON")
        try:
            spec[key] = json.loads(value)
        except ValueError as exc:
            # A bare word (dtype=float16) is a string; what starts as JSON must be JSON.
            if value.lstrip()[:1] in ("[", "{", '"'):
                raise UsageError(
                    f"--spec {item}: the value is not valid JSON ({exc}); fix it, or pass a "
                    f"string as JSON: {key}='{json.dumps(value)}'"
                ) from exc
            spec[key] = value
    flags = _from_file(path, data, "flags", list)
    flags += [_define(d) for d in args.define] + list(args.flag)
    data.update(headers=headers, specialization=spec, flags=flags)
    expressions = _from_file(path, data, "name_expressions", list)
    data["name_expressions"] = expressions + list(args.name_expression)
    names = [item.partition("=")[0] for item in args.include_set]
    data["include_sets"] = _from_file(path, data, "include_sets", list) + [n for n in names if n]
    for option in ("target", "output", "name"):
        if getattr(args, option):
            data[option] = getattr(args, option)
    try:
        recipe = Recipe.from_dict(data)
    except RecipeError as exc:
        root = re.split(r"[.\[]", exc.field, maxsplit=1)[0]
        if from_json:
            raise UsageError(f"{path}: {exc.field}: {exc.detail}") from exc
        flag = FIELD_FLAGS.get(root)
        where = f"{flag} ({exc.field})" if flag and flag != f"--{exc.field}" else flag
        raise UsageError(f"{where or path}: {exc.detail}") from exc
    if not recipe.source.strip() and not recipe.link:
        raise UsageError(f"{path} is empty: there is no kernel to compile")
    return recipe


def _define(item: str) -> str:
    """``--define NAME[=VALUE]`` as its ``-D`` flag; a NAME that is no macro is named here."""
    from kcache.options import ALLOWED_FLAGS, recipe_flag_refusal

    flag = f"-D{item}"
    if not ALLOWED_FLAGS.fullmatch(flag):
        raise UsageError(
            f"--define {item!r}: {recipe_flag_refusal(flag).removeprefix(repr(flag) + ' ')}"
        )
    return flag


def _check_output(args: argparse.Namespace, inputs: Sequence[Path]) -> None:
    """Refuse an ``-o`` that names no file, or one of the recipe's own inputs (the artifact
    would replace the source it was compiled from), before anything is compiled."""
    output = getattr(args, "o", None)
    if output is None:
        return
    if not output:
        raise UsageError("-o needs a file name to write the artifact to")
    target = Path(output).expanduser()
    for given in inputs:
        with contextlib.suppress(OSError):
            if target.samefile(given):
                raise UsageError(
                    f"-o {output} is the recipe's own input {given}: the artifact would replace "
                    "it; name another file (add.cubin, say)"
                )


def _from_file(path: Path, data: dict[str, Any], field: str, kind: type[Any]) -> Any:
    """A copy of the recipe file's ``field`` that the command line adds to, checked to be a
    ``kind`` first (a string is not taken apart into characters, nor a list into pairs)."""
    value = data.get(field)
    if value is None:
        return kind()
    if not isinstance(value, kind):
        what = "an object" if kind is dict else "a list"
        raise UsageError(f"{path}: {field}: must be {what}, not {json.dumps(value)[:80]}")
    return kind(value)


def recipe_title(recipe: Recipe) -> str:
    """How status lines name a recipe: its program name and target (``add.cu for sm_90``)."""
    return f"{recipe.name} for {recipe.target}"


# ---------------------------------------------------------------------------- output
def print_result(status: str, recipe_key: str, digest: str, path: Path) -> None:
    """The one JSON line ``compile`` and ``get`` print (and ``warmup``, one per recipe)."""
    print(
        json.dumps(
            {"status": status, "recipe_key": recipe_key, "digest": digest, "path": str(path)}
        )
    )


def write_output(option: str, target: str, data: bytes) -> Path:
    """Write an artifact where ``-o`` asked (:func:`writing_output`)."""
    path = Path(target).expanduser()
    writing_output(option, target, lambda: path.write_bytes(data))
    return path


def writing_output(option: str, target: str, write: Callable[[], T]) -> T:
    """``write()`` the file ``option target`` names (``-o FILE``): a directory there, or a
    failure to write, is told by that path and the option, never by a temporary file the
    writer used first (``.m.json.1234.partial: Is a directory``)."""
    if os.path.isdir(os.path.expanduser(target)):
        raise UsageError(f"{option} {target} is a directory: name a file (in it, say)")
    try:
        return write()
    except OSError as exc:
        raise UsageError(f"{option} {target}: cannot write it: {exc.strerror or exc}") from exc


# ---------------------------------------------------------------------------- another command
def run_command(argv: Sequence[str], *, needs: str) -> int:
    """Run another ``kcache`` command (one a different distribution provides) from this one.

    ``needs`` says what to install when no distribution provides it.
    """
    parser = parser_providing(argv[:1])
    if parser is None:
        raise UsageError(f"this needs `kcache {argv[0]}`, which comes with {needs}")
    delegated = parser.parse_args(list(argv))
    return int(delegated.func(delegated))
