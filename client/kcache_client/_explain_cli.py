"""``kcache explain RECIPE_FILE|KEY``: is a recipe held, and if not, why it misses, as the server sees it.

The server says first whether it holds the recipe now (a resolve is a hit) and how:
this prints that one line (``held by its exact key: artifact 3f2a1b2c9d0e4f51``,
``held through a dependency-aware match: ...``), or the failed compile the server
remembers. Otherwise the server names the nearest recipe of the same kernel it
recorded (same program name and source, or same base key) and what differs; this
prints one line per difference on stdout (``header add.cuh changed (3f2a1b2c.. ->
9c01d4e5..)``, ``flag -lineinfo added``) or ``never seen``, after ``seen before: ...``
for a recipe whose artifact went away, and the nearest recipe's key on stderr.
A recipe file (JSON, or a ``.cu`` source with the recipe options) is sent whole
(``POST /v1/explain``); a recipe key, or the start of one as ``kcache cache ls`` and
the dashboard print it (4 to 64 hex digits), is asked by key
(``GET /v1/recipes/{key}/explain``), the server finding the one key it begins.

Strings from the server are printed with control characters escaped.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from contextlib import closing
from pathlib import Path
from typing import Any

from kcache.cli_toolkit import (
    UsageError,
    add_recipe_arguments,
    add_server_arguments,
    recipe_from_args,
    server_url,
)
from kcache.keys import is_key_prefix
from kcache_client._cache_cli_text import show

__all__ = ["explanation_lines", "register"]


#: The first line for a recipe the server recorded whose artifact went away.
SEEN_BEFORE = "seen before: its artifact was evicted, collected or set aside since"


def explanation_lines(body: dict[str, Any]) -> list[str]:
    """What ``kcache explain`` prints on stdout for an explanation body.

    A held recipe or a remembered failure: the server's one line. Else one line per
    difference from the nearest recorded recipe (after :data:`SEEN_BEFORE` where it
    applies), or ``never seen``.
    """
    if body.get("held") or body.get("failure"):
        return [show(body.get("text") or f"held ({body.get('held') or body.get('failure')})")]
    lines = [SEEN_BEFORE] if body.get("seen_before") else []
    if body.get("nearest_key") is None:
        return [*lines, "never seen"]
    said = [show(line) for line in body.get("differences") or []]
    return lines + (said or ["no difference in what the server recorded"])


def _body(args: argparse.Namespace) -> tuple[str, str, dict[str, Any] | None]:
    """The method, path and body of the request ``args`` ask for."""
    if is_key_prefix(args.recipe) and not Path(args.recipe).exists():
        return "GET", f"/v1/recipes/{args.recipe}/explain", None
    recipe = recipe_from_args(args)
    if recipe.target == "auto":
        from kcache_client._device import auto_target
        from kcache_client.errors import NoDeviceError

        try:
            target = args.auto_target or auto_target()
        except NoDeviceError as exc:
            raise UsageError(
                'the recipe\'s target is "auto", and this machine has no usable GPU to resolve '
                "it: pass --target sm_XX (or --auto-target sm_XX)"
            ) from exc
        recipe = recipe.with_defaults(target=target)
    return "POST", "/v1/explain", {"recipe": recipe.to_dict()}


def _cmd_explain(args: argparse.Namespace) -> int:
    url = server_url(args)
    if url is None:
        raise UsageError(
            "misses are explained by the server that recorded the recipes: pass --server URL "
            "or set KCACHE_URL"
        )
    method, path, body = _body(args)
    from kcache_client._http import Transport
    from kcache_client._settings import RetryPolicy
    from kcache_client._waits import Waits

    token = args.token or os.environ.get("KCACHE_TOKEN") or None
    transport = Transport(
        url,
        token,
        retry=RetryPolicy(attempts=3, budget_s=10.0),
        timeout=Waits(connect=5.0, read=60.0, write=60.0),
        user_agent="kcache-cli",
    )
    with closing(transport):
        answer: dict[str, Any] = transport.request(method, path, json=body).json()
    if args.json:
        json.dump(answer, sys.stdout, indent=2)
        print()
        return 0
    key = answer.get("recipe_key")
    if key is not None and key != args.recipe:  # the whole key a prefix or a file stood for
        print(f"recipe {show(key)}", file=sys.stderr)
    if answer.get("nearest_key") is not None and not answer.get("held"):
        print(f"nearest {show(answer['nearest_key'])}", file=sys.stderr)
    for line in explanation_lines(answer):
        print(line)
    return 0


def register(subparsers: Any) -> None:
    """Add ``kcache explain``."""
    explain = subparsers.add_parser(
        "explain",
        help="is a recipe held by the server, and if not, why it misses",
        description="Ask the server whether it holds the recipe (a resolve is a hit) and how: "
        '"held by its exact key", "held through a dependency-aware match" (an artifact of the '
        "same kernel whose recorded headers are this recipe's), or a failed compile it "
        "remembers. Otherwise print what this recipe differs in from the nearest recipe of the "
        "same kernel the server recorded (same program name and source, or same base key), one "
        'line per difference (e.g. "header add.cuh changed (3f2a1b2c.. -> 9c01d4e5..)", "flag '
        '-lineinfo added"), or "never seen". RECIPE is a recipe JSON file, a .cu source with the '
        "options below, or the key of a recipe the server recorded or holds, or the start of "
        "one (4 to 64 hex digits, as `kcache cache ls` and the dashboard print them).",
    )
    add_recipe_arguments(explain)
    add_server_arguments(explain)
    explain.add_argument(
        "--auto-target", metavar="SM", help='what target "auto" means (default: this GPU)'
    )
    explain.add_argument("--json", action="store_true", help="print the server's answer as JSON")
    explain.set_defaults(func=_cmd_explain)
