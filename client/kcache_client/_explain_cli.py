"""``kcache explain RECIPE_FILE|KEY``: why a recipe misses, as the server sees it.

The server names the nearest recipe of the same kernel it recorded (same program
name and source, or same base key) and what differs; this prints one line per
difference on stdout (``header add.cuh changed (3f2a1b2c.. -> 9c01d4e5..)``,
``flag -lineinfo added``) or ``never seen``, and the nearest recipe's key on stderr.
A recipe file (JSON, or a ``.cu`` source with the recipe options) is sent whole
(``POST /v1/explain``); a recipe key the server recorded is asked by key
(``GET /v1/recipes/{key}/explain``).

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
from kcache.keys import is_hex_key

__all__ = ["explanation_lines", "register"]


def _show(text: object) -> str:
    value = str(text)
    if value.isprintable():
        return value
    return "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in value)


def explanation_lines(body: dict[str, Any]) -> list[str]:
    """What ``kcache explain`` prints on stdout for an explanation body: one line per difference."""
    if body.get("nearest_key") is None:
        return ["never seen"]
    lines = [_show(line) for line in body.get("differences") or []]
    return lines or ["no difference in what the server recorded"]


def _body(args: argparse.Namespace) -> tuple[str, str, dict[str, Any] | None]:
    """The method, path and body of the request ``args`` ask for."""
    if is_hex_key(args.recipe) and not Path(args.recipe).exists():
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
    import httpx

    from kcache_client._http import Transport
    from kcache_client._settings import RetryPolicy

    token = args.token or os.environ.get("KCACHE_TOKEN") or None
    transport = Transport(
        url,
        token,
        retry=RetryPolicy(attempts=3, budget_s=10.0),
        timeout=httpx.Timeout(60.0, connect=5.0),
        user_agent="kcache-cli",
    )
    with closing(transport):
        answer: dict[str, Any] = transport.request(method, path, json=body).json()
    if args.json:
        json.dump(answer, sys.stdout, indent=2)
        print()
        return 0
    if answer.get("nearest_key") is not None:
        print(f"nearest {_show(answer['nearest_key'])}", file=sys.stderr)
    for line in explanation_lines(answer):
        print(line)
    return 0


def register(subparsers: Any) -> None:
    """Add ``kcache explain``."""
    explain = subparsers.add_parser(
        "explain",
        help="why a recipe misses: the nearest recipe the server recorded and what differs",
        description="Ask the server for the nearest recipe of the same kernel it recorded (same "
        "program name and source, or same base key) and print what this recipe differs in, one "
        'line per difference (e.g. "header add.cuh changed (3f2a1b2c.. -> 9c01d4e5..)", "flag '
        '-lineinfo added"), or "never seen". RECIPE is a recipe JSON file, a .cu source with the '
        "options below, or the key of a recipe the server recorded.",
    )
    add_recipe_arguments(explain)
    add_server_arguments(explain)
    explain.add_argument(
        "--auto-target", metavar="SM", help='what target "auto" means (default: this GPU)'
    )
    explain.add_argument("--json", action="store_true", help="print the server's answer as JSON")
    explain.set_defaults(func=_cmd_explain)
