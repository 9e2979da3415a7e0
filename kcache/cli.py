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

The core provides ``key``, ``compile``, ``gc``, ``verify`` and ``doctor``
(:mod:`kcache._core_commands`). The client and server distributions add their
subcommands through the ``kcache.commands`` entry-point group, so the core never
imports them: each entry point is a function ``register(subparsers)`` that adds
parsers whose ``func`` default takes the parsed arguments and returns an exit code,
built from :mod:`kcache.cli_toolkit` (the shared options, :class:`UsageError`, the
result line). ``register`` imports only what argparse needs (``kcache --help`` stays
instant); commands import their heavy dependencies when they run, and a command of
the core's own (``kcache key``) does not even look for the entry points. The client's
``kcache.remote`` entry point runs ``compile`` and ``key`` through a server. The
parser itself, its help and its errors are :mod:`kcache._cli_parser`'s.

Errors a user can cause end in one or two lines on stderr that name the flag, file or
variable and what to do (:class:`UsageError` and the other ``KCacheError``); a
traceback is shown only with ``--debug`` or ``KCACHE_DEBUG=1``. That includes
argparse's own: a value that begins with ``-`` (``--flag -lineinfo``) is shown joined by
``=``, and a ``--spec`` value that starts as JSON must be JSON. This module runs the
command and turns what it raised into those lines and the exit status.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import traceback
from collections.abc import Sequence

from kcache import _core_commands
from kcache._cli_parser import COMMAND_LINE, Parser, add_command_groups, chosen, kcache_parser
from kcache._env import env_flag
from kcache.cli_toolkit import FIELD_FLAGS, HEADER_HINT, UsageError
from kcache.errors import (
    CompileError,
    KCacheError,
    RecipeError,
    StoreFullError,
    UnlistedIncludeError,
    UnresolvedRecipeError,
)

__all__ = ["build_parser", "main"]


# ---------------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    """The full parser, core commands plus those the installed distributions register."""
    return _build()


def _build(command: str | None = None) -> Parser:
    """The parser; for a ``command`` of the core's own, without the other distributions' commands.

    Those only add commands of their own, so a core command parses the same either
    way, and ``kcache key`` does not pay for finding and importing them.
    """
    parser, sub = kcache_parser()
    _core_commands.register(sub)
    if command in sub.choices:
        return parser
    add_command_groups(sub)
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
        flag = FIELD_FLAGS.get(re.split(r"[.\[]", exc.field, maxsplit=1)[0])
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
        # 1: it could not be done (a server or store out of reach, nothing found), also
        # when a command's own message wraps that cause; 2: what was asked is wrong.
        unavailable = ConnectionError | TimeoutError | FileNotFoundError | StoreFullError
        failed = isinstance(exc, unavailable) or isinstance(exc.__cause__, unavailable)
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
    COMMAND_LINE[:] = words
    try:
        debug = debug or bool(env_flag("KCACHE_DEBUG"))
        # Only a first word can be the command: after an option (`kcache -h key`) it is not.
        parser = _build(words[0] if words else None)
        args, extras = parser.parse_known_args(words)
        if extras:
            chosen(parser, args).unrecognized(extras)
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
