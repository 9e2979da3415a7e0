"""The ``kcache`` command.

One story, told the same way by the README and ``--help``:

- Where a server is configured (``--server URL`` or ``$KCACHE_URL``), every command
  that can use it does: ``compile``, ``get``, ``key``, ``warmup``, ``stats``.
- Without one, client commands (``compile``, ``get``, ``key``, ``warmup``, ``gc``,
  ``verify``) work on the user's cache directory (``--cache-dir``,
  ``$KCACHE_CACHE_DIR``, else ``~/.cache/kcache/client``), which is also the client's
  node tier: what one command put there every other command finds.
- A server's data directory (``--data-dir``, ``$KCACHE_DATA_DIR``, else ``./.kcache``)
  is only ever touched by server commands (``serve``, ``db``, ``token``, ``stats``).
  ``gc`` and ``verify`` work on whichever kind of directory they are given: a server's
  is handed to the server's own maintenance (``kcache db gc|verify``).

The core provides ``key``, ``compile``, ``gc``, ``verify`` and ``doctor``. The client
and server distributions add their subcommands through the ``kcache.commands``
entry-point group, so the core never imports them: each entry point is a function
``register(subparsers)`` that adds parsers whose ``func`` default takes the parsed
arguments and returns an exit code. ``register`` imports only what argparse needs
(``kcache --help`` stays instant); commands import their heavy dependencies when
they run, and a command of the core's own (``kcache key``) does not even look for the
entry points. ``kcache key`` learns the local toolchain's id from what the last load
wrote down (:func:`kcache.toolchain.toolchain_id`) instead of loading NVRTC. The
client's ``kcache.remote`` entry point runs ``compile`` and ``key`` through a server.

Errors a user can cause end in one or two lines on stderr that name the flag, file or
variable and what to do (:class:`UsageError` and the other ``KCacheError``); a
traceback is shown only with ``--debug`` or ``KCACHE_DEBUG=1``. That includes
argparse's own: a value that begins with ``-`` (``--flag -O3``) is shown joined by
``=``, and a ``--spec`` value that starts as JSON must be JSON. A local compile runs
through :func:`kcache._waiting.run_long` (a status line while NVRTC works, Ctrl-C at
once); ``doctor``'s checks are :mod:`kcache._doctor`'s.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import sys
import textwrap
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from kcache._env import env_flag
from kcache._waiting import run_long
from kcache.dirs import (
    SERVER_DATABASE_FILE,
    cache_dir,
    cache_layout,
    directory_kind,
)
from kcache.errors import (
    CompileError,
    KCacheError,
    RecipeError,
    UnlistedIncludeError,
    UnresolvedRecipeError,
)

if TYPE_CHECKING:
    from kcache.recipe import Recipe

__all__ = [
    "UsageError",
    "add_cache_dir_argument",
    "add_recipe_arguments",
    "add_server_arguments",
    "build_parser",
    "include_set_dirs",
    "main",
    "print_result",
    "recipe_from_args",
    "recipe_title",
    "refuse_server_dir",
    "run_command",
    "server_url",
    "write_output",
]

_DESCRIPTION = """\
kcache: a content-addressed JIT CUDA kernel cache.

With a server configured (--server URL or $KCACHE_URL), compile, get, key, warmup and
stats use it. Without one, compile, get, key, warmup, gc and verify work on your cache
directory (--cache-dir, $KCACHE_CACHE_DIR, default ~/.cache/kcache/client). A server's
data directory (--data-dir, $KCACHE_DATA_DIR, default ./.kcache) is used only by serve,
db and token (and by stats, gc and verify when you name it)."""

_EPILOG = "Run `kcache COMMAND --help` for a command's options. --debug (or KCACHE_DEBUG=1) shows tracebacks."

#: What to say when a header could not be found, on top of the compiler's own words.
HEADER_HINT = (
    "pass the header with --header NAME=FILE, or its directory with --include-set NAME=DIR"
)

#: Recipe fields and the options that set them, so errors name what the user typed.
_FIELD_FLAGS = {
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


# ---------------------------------------------------------------------------- argparse
class _HelpFormatter(argparse.HelpFormatter):
    """argparse's help with every option's default shown, unless its text already gives one.

    Descriptions are wrapped paragraph by paragraph (blank lines between them are kept).
    """

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "\n\n".join(
            textwrap.fill(
                " ".join(p.split()), width, initial_indent=indent, subsequent_indent=indent
            )
            for p in text.split("\n\n")
        )

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            "default" in text
            or default is None
            or default is False
            or default is argparse.SUPPRESS
            or default == []
            or (not action.option_strings and action.nargs not in ("?", "*"))
        ):
            return text
        return text + " (default: %(default)s)"


_EXPECTED_ONE = re.compile(r"argument (?P<option>-[^\s:/]+)(?:/\S+)?: expected one argument\Z")
#: The words of the command line being parsed (for errors that must show the next word).
_WORDS: list[str] = []

_INVALID_CHOICE = re.compile(
    r"argument (?P<arg>\S+): invalid choice: (?P<value>'.*?') \(choose from (?P<choices>.*)\)\Z"
)


def _quoted(text: str) -> list[str]:
    """The words of argparse's "choose from" list (quoted up to Python 3.11, bare later)."""
    quoted = [m.group(1) for m in re.finditer(r"'((?:[^'\\]|\\.)*)'", text)]
    return quoted or [word.strip() for word in text.split(",")]


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are two lines with a "did you mean" where one fits."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        """Say what was wrong and the closest valid word; no usage dump (``--help`` has it)."""
        expected = _EXPECTED_ONE.search(message)
        if expected:
            option = expected["option"]
            after = [w for i, w in enumerate(_WORDS[1:], 1) if _WORDS[i - 1] == option]
            if after and after[0].startswith("-"):
                message = (
                    f"{option} needs a value, and {after[0]!r} after it reads as an option: "
                    f"join them with '=': {option}={after[0]}"
                )
            else:
                message = f"{option} needs a value: {option} VALUE (or {option}=VALUE)"
        match = _INVALID_CHOICE.search(message)
        if match:
            value = match["value"][1:-1]
            close = difflib.get_close_matches(value, _quoted(match["choices"]), n=1, cutoff=0.5)
            what = match["arg"]
            if what == "COMMAND" or what.endswith("_command"):
                what = "command"
            if close:
                message = f"{what} {value!r} does not exist; did you mean {close[0]!r}?"
            else:
                message = f"{what} {value!r} is not one of {match['choices']}"
        self.exit(2, f"{self.prog}: {message}\n{self.prog}: see `{self.prog} --help`\n")

    def unrecognized(self, extras: Sequence[str]) -> NoReturn:
        """Refuse leftover arguments, suggesting the option each mistyped flag was probably meant as."""
        options = sorted(
            {s for action in self._actions for s in action.option_strings if s.startswith("--")}
        )
        hints = []
        for extra in extras:
            if extra.startswith("-"):
                close = difflib.get_close_matches(extra.split("=", 1)[0], options, n=1, cutoff=0.6)
                if close:
                    hints.append(f"{extra.split('=', 1)[0]} -> {close[0]}")
        text = f"unrecognized arguments: {' '.join(extras)}"
        if hints:
            text += f" (did you mean {', '.join(hints)}?)"
        self.error(text)


class _VersionAction(argparse.Action):
    """``--version``: this distribution and the client and server ones installed with it."""

    def __init__(
        self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kw: Any
    ) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kw)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        from importlib.metadata import PackageNotFoundError, version

        from kcache._version import CORE_DISTRIBUTION

        parts = []
        for dist in (CORE_DISTRIBUTION, "kcache-client", "kcache-server"):
            try:
                parts.append(f"{dist} {version(dist)}")
            except PackageNotFoundError:
                continue
        print(", ".join(parts))
        parser.exit(0)


def _subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction[Any] | None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action
    return None


def _chosen(parser: _Parser, args: argparse.Namespace) -> _Parser:
    """The (sub)parser that parsed the last command word, e.g. ``kcache db gc``'s."""
    while (action := _subparsers(parser)) is not None:
        nested = action.choices.get(getattr(args, action.dest, None) or "")
        if not isinstance(nested, _Parser):
            break
        parser = nested
    return parser


# ---------------------------------------------------------------------------- shared options
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


def add_recipe_arguments(parser: argparse.ArgumentParser) -> None:
    """The options that build a recipe from a .cu file (on a JSON recipe they add to its fields)."""
    parser.add_argument(
        "recipe", help="a recipe JSON file, or a .cu source file with the options below"
    )
    parser.add_argument("--target", help="sm_XX, sm_XXa, sm_XXf (cubin) or compute_XX (PTX)")
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
        help='an in-memory header: #include "NAME" reads FILE (repeatable)',
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


def _split(option: str, text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise UsageError(f"{option} {text!r} must look like NAME=VALUE")
    return name, value


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
    try:
        return path.read_text()
    except OSError as exc:
        raise UsageError(f"{option}: cannot read {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise UsageError(f"{option}: {path} is not UTF-8 text: {exc.reason}") from exc


def recipe_from_args(args: argparse.Namespace) -> Recipe:
    """Build the recipe the command line describes; errors name the option or file."""
    from kcache.recipe import Recipe

    path = Path(args.recipe)
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
    headers = dict(data.get("headers") or {})
    for item in args.header:
        name, file = _split("--header", item)
        headers[name] = _read(f"--header {item}", Path(file).expanduser())
    spec = dict(data.get("specialization") or {})
    for item in args.spec:
        key, value = _split("--spec", item)
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
    flags = list(data.get("flags") or [])
    flags += [f"-D{d}" for d in args.define] + list(args.flag)
    data.update(headers=headers, specialization=spec, flags=flags)
    data["name_expressions"] = list(data.get("name_expressions") or []) + list(args.name_expression)
    names = [item.partition("=")[0] for item in args.include_set]
    data["include_sets"] = list(data.get("include_sets") or []) + [n for n in names if n]
    for option in ("target", "output", "name"):
        if getattr(args, option):
            data[option] = getattr(args, option)
    try:
        recipe = Recipe.from_dict(data)
    except RecipeError as exc:
        root = re.split(r"[.\[]", exc.field, maxsplit=1)[0]
        if from_json:
            raise UsageError(f"{path}: {exc.field}: {exc.detail}") from exc
        flag = _FIELD_FLAGS.get(root)
        where = f"{flag} ({exc.field})" if flag and flag != f"--{exc.field}" else flag
        raise UsageError(f"{where or path}: {exc.detail}") from exc
    if not recipe.source.strip() and not recipe.link:
        raise UsageError(f"{path} is empty: there is no kernel to compile")
    return recipe


def recipe_title(recipe: Recipe) -> str:
    """How status lines name a recipe: its program name and target (``add.cu for sm_90``)."""
    return f"{recipe.name} for {recipe.target}"


def print_result(status: str, recipe_key: str, digest: str, path: Path) -> None:
    """The one JSON line ``compile`` and ``get`` print (and ``warmup``, one per recipe)."""
    print(
        json.dumps(
            {"status": status, "recipe_key": recipe_key, "digest": digest, "path": str(path)}
        )
    )


def write_output(option: str, target: str, data: bytes) -> Path:
    """Write an artifact where ``-o`` asked; an unwritable path names the option."""
    path = Path(target).expanduser()
    try:
        path.write_bytes(data)
    except OSError as exc:
        raise UsageError(f"{option} {target}: cannot write: {exc.strerror or exc}") from exc
    return path


def _client_entry() -> Callable[[argparse.Namespace, Recipe], int]:
    from importlib.metadata import entry_points

    remotes = entry_points(group="kcache.remote")
    if not remotes:
        raise UsageError(
            "a server is configured (--server / $KCACHE_URL) but the client is not installed: "
            "pip install ./client (kcache-client), or unset KCACHE_URL to work locally"
        )
    entry: Callable[[argparse.Namespace, Recipe], int] = next(iter(remotes)).load()
    return entry


def refuse_server_dir(root: Path, option: str) -> None:
    """Refuse to use a server's data directory as a cache directory (client commands never write one)."""
    if directory_kind(root) == "server":
        raise UsageError(
            f"{root} ({option}) is a kcache server's data directory, which only server commands write; "
            "use your cache directory (--cache-dir, $KCACHE_CACHE_DIR), or compile through the server (--server URL)"
        )


# ---------------------------------------------------------------------------- commands
def _cmd_key(args: argparse.Namespace) -> int:
    recipe = recipe_from_args(args)
    if server_url(args):  # the server's default toolchain keys the recipe, as `get` would
        return int(_client_entry()(args, recipe))
    if recipe.toolchain is None:
        from kcache.toolchain import toolchain_id

        recipe = recipe.with_defaults(toolchain=toolchain_id())
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
    result = run_long(lambda: engine.resolve(recipe), f"compiling {recipe_title(recipe)}")
    path = engine.store.path(result.artifact.digest)
    if args.o:
        path = write_output("-o", args.o, engine.read(result.artifact))
    # A hit in the cache directory is what the client calls a node-tier hit.
    status = "local_hit" if result.status == "hit" else result.status
    print_result(status, result.recipe_key, result.artifact.digest, path)
    return 0


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
    parser = _build()
    sub = _subparsers(parser)
    db = sub.choices.get("db") if sub is not None else None
    db_sub = _subparsers(db) if db is not None else None
    if db_sub is None or command not in db_sub.choices:
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
    if kind == "absent":
        if named:
            raise UsageError(f"{root} ({option}) does not exist")
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
    if kind == "absent":
        if named:
            raise UsageError(f"{root} ({option}) does not exist")
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


def run_command(argv: Sequence[str], *, needs: str) -> int:
    """Run another ``kcache`` command (one a different distribution may provide) from this one.

    ``needs`` says what to install when no distribution provides it.
    """
    parser = _build()
    sub = _subparsers(parser)
    if sub is None or argv[0] not in sub.choices:
        raise UsageError(f"this needs `kcache {argv[0]}`, which comes with {needs}")
    delegated = parser.parse_args(list(argv))
    return int(delegated.func(delegated))


# ---------------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    """The full parser, core commands plus those the installed distributions register."""
    return _build()


def _build(command: str | None = None) -> _Parser:
    """The parser; for a ``command`` of the core's own, without the other distributions' commands.

    Those only add commands of their own, so a core command parses the same either
    way, and ``kcache key`` does not pay for finding and importing them.
    """
    parser = _Parser(prog="kcache", description=_DESCRIPTION, epilog=_EPILOG)
    parser.add_argument("--version", action=_VersionAction, help="print the versions and exit")
    parser.add_argument(
        "--debug", action="store_true", help="show tracebacks of errors (also KCACHE_DEBUG=1)"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

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

    if command in sub.choices:
        return parser
    from importlib.metadata import entry_points

    for ep in entry_points(group="kcache.commands"):
        ep.load()(sub)
    return parser


# ---------------------------------------------------------------------------- errors
def _flag_advice(exc: BaseException) -> str | None:
    """The CLI's way to fix errors whose text was written for the Python API."""
    if isinstance(exc, UnresolvedRecipeError) and exc.field == "target":
        return 'the recipe\'s target is "auto", which only a GPU can resolve: pass --target sm_XX'
    if isinstance(exc, UnlistedIncludeError):
        return f"#include {exc.include!r} is not one of the recipe's inputs: {HEADER_HINT}"
    if isinstance(exc, RecipeError) and exc.field.startswith("include_sets"):
        return f"{exc.detail}: pass --include-set NAME=DIR to compile with a local directory"
    if isinstance(exc, RecipeError) and not isinstance(exc, UsageError):
        flag = _FIELD_FLAGS.get(re.split(r"[.\[]", exc.field, maxsplit=1)[0])
        if flag:
            return (
                f"{flag} ({exc.field}): {exc.detail}"
                if flag != f"--{exc.field}"
                else f"{flag}: {exc.detail}"
            )
    return None


def _report(exc: BaseException) -> int:
    """One or two lines on stderr for an error; the exit status."""
    if isinstance(exc, CompileError):
        log = exc.log.rstrip()
        if log and log not in str(exc):
            print(log, file=sys.stderr)
        print(f"kcache: {exc}", file=sys.stderr)
        if "cannot open source file" in log or "unlisted_include" in log:
            print(f"kcache: hint: {HEADER_HINT}", file=sys.stderr)
        return 1
    if isinstance(exc, KCacheError):
        for line in str(_flag_advice(exc) or exc).splitlines():
            print(f"kcache: {line}", file=sys.stderr)
        if getattr(exc, "code", None) == "unlisted_include":
            print(f"kcache: hint: {HEADER_HINT}", file=sys.stderr)
        failed = isinstance(exc, ConnectionError | TimeoutError | FileNotFoundError)
        return 1 if failed else 2
    if isinstance(exc, OSError):
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"kcache: {where}{exc.strerror or exc}", file=sys.stderr)
        return 1
    first = (str(exc).strip().splitlines() or [""])[0]
    print(f"kcache: unexpected error: {type(exc).__name__}: {first}", file=sys.stderr)
    print(
        "kcache: run again with --debug (or KCACHE_DEBUG=1) for the traceback, and please report it",
        file=sys.stderr,
    )
    return 1


def _quiet_stdout() -> None:
    # The reader went away (`kcache stats | head`): nothing more can be shown, and the
    # interpreter's own flush at exit must not complain about it either.
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kcache`` command."""
    words = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in words  # accepted anywhere: it is about the run, not one command
    words = [w for w in words if w != "--debug"]
    _WORDS[:] = words
    try:
        debug = debug or bool(env_flag("KCACHE_DEBUG"))
        # Only a first word can be the command: after an option (`kcache -h key`) it is not.
        parser = _build(words[0] if words else None)
        args, extras = parser.parse_known_args(words)
        if extras:
            _chosen(parser, args).unrecognized(extras)
        code = int(args.func(args))
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        _quiet_stdout()
        return 141  # as if killed by SIGPIPE, what `head` expects of a writer
    except KeyboardInterrupt:
        print("kcache: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if debug:
            traceback.print_exc()
        return _report(exc)


if __name__ == "__main__":
    sys.exit(main())
