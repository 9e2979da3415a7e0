"""The ``kcache`` parser: argparse, speaking the command's story in its help and its errors.

:func:`kcache_parser` is the top level (``--version``, ``--debug``, the COMMAND word);
:mod:`kcache._core_commands` adds the core's commands to it and
:func:`add_command_groups` those the other distributions register through the
``kcache.commands`` entry points (:mod:`kcache.cli` puts the two together).
:func:`parser_providing` is the top level with only the latter, for a command that
hands its work to another distribution's (``kcache gc`` on a server's directory runs
``kcache db gc``).

Every parser is a :class:`Parser`: its errors are two lines with a "did you mean"
where one fits and no usage dump (``--help`` has it), and a value that begins with
``-`` (``--flag -lineinfo``), which argparse takes for an option, is shown joined by ``=``.
Its help shows every option's default, unless the text already gives one.
"""

from __future__ import annotations

import argparse
import difflib
import re
import textwrap
from collections.abc import Sequence
from typing import Any, NoReturn

__all__ = [
    "COMMAND_LINE",
    "Parser",
    "add_command_groups",
    "chosen",
    "kcache_parser",
    "parser_providing",
    "subparsers_of",
]

_DESCRIPTION = """\
kcache: a content-addressed JIT CUDA kernel cache.

With a server configured (--server URL or $KCACHE_URL), compile, get, key, warmup and
stats use it. Without one, compile, get, key, warmup, gc and verify work on your cache
directory (--cache-dir, $KCACHE_CACHE_DIR, default ~/.cache/kcache/client). A server's
data directory (--data-dir, $KCACHE_DATA_DIR, default ./.kcache) is used only by serve,
db and token (and by stats, gc and verify when you name it)."""

_EPILOG = "Run `kcache COMMAND --help` for a command's options. --debug (or KCACHE_DEBUG=1) shows tracebacks."

#: The words of the command line being parsed (for errors that must show the next word);
#: :func:`kcache.cli.main` sets them.
COMMAND_LINE: list[str] = []

_EXPECTED_ONE = re.compile(r"argument (?P<option>-[^\s:/]+)(?:/\S+)?: expected one argument\Z")

_INVALID_CHOICE = re.compile(
    r"argument (?P<arg>\S+): invalid choice: (?P<value>'.*?') \(choose from (?P<choices>.*)\)\Z"
)


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


def _quoted(text: str) -> list[str]:
    """The words of argparse's "choose from" list (quoted up to Python 3.11, bare later)."""
    quoted = [m.group(1) for m in re.finditer(r"'((?:[^'\\]|\\.)*)'", text)]
    return quoted or [word.strip() for word in text.split(",")]


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are two lines with a "did you mean" where one fits."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        """Say what was wrong and the closest valid word; no usage dump (``--help`` has it)."""
        expected = _EXPECTED_ONE.search(message)
        if expected:
            option = expected["option"]
            words = COMMAND_LINE
            after = [w for i, w in enumerate(words[1:], 1) if words[i - 1] == option]
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


def subparsers_of(parser: argparse.ArgumentParser) -> argparse._SubParsersAction[Any] | None:
    """The action that holds ``parser``'s commands (None where it has none)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action
    return None


def chosen(parser: Parser, args: argparse.Namespace) -> Parser:
    """The (sub)parser that parsed the last command word, e.g. ``kcache db gc``'s."""
    while (action := subparsers_of(parser)) is not None:
        nested = action.choices.get(getattr(args, action.dest, None) or "")
        if not isinstance(nested, Parser):
            break
        parser = nested
    return parser


def kcache_parser() -> tuple[Parser, argparse._SubParsersAction[Any]]:
    """The top level of the ``kcache`` parser, and the action its commands are added to."""
    parser = Parser(prog="kcache", description=_DESCRIPTION, epilog=_EPILOG)
    parser.add_argument("--version", action=_VersionAction, help="print the versions and exit")
    parser.add_argument(
        "--debug", action="store_true", help="show tracebacks of errors (also KCACHE_DEBUG=1)"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    return parser, sub


def add_command_groups(sub: argparse._SubParsersAction[Any]) -> None:
    """Add the commands the installed distributions register (``kcache.commands`` entry points).

    Each entry point is a function ``register(subparsers)``; it imports only what
    argparse needs, so ``kcache --help`` stays instant.
    """
    from importlib.metadata import entry_points

    for ep in entry_points(group="kcache.commands"):
        ep.load()(sub)


def parser_providing(words: Sequence[str]) -> Parser | None:
    """The parser of the other distributions' commands, where one provides the command ``words`` name.

    ``["db", "gc"]`` names the ``db`` command's ``gc``; None where no installed
    distribution provides it. The parser has the top level's options but not the
    core's own commands: what runs through it is another distribution's command.
    """
    parser, sub = kcache_parser()
    add_command_groups(sub)
    level: argparse.ArgumentParser = parser
    for word in words:
        action = subparsers_of(level)
        if action is None or word not in action.choices:
            return None
        level = action.choices[word]
    return parser
