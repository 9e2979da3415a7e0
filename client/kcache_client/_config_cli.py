"""``kcache config``: the settings a client command would run with, and where each came from.

``ccache --show-config`` for kcache. A client reads its settings from its flags, then
the ``KCACHE_*`` environment (:data:`~kcache_client._settings.ENVIRONMENT` names every
variable), then its defaults; a command's own defaults differ from a library's where
a person is waiting (a retry budget of seconds, not a minute). A wrong value is hard
to find when nothing says which of those three it came from, so every line does:
``flag (--server)``, ``environment (KCACHE_RETRY_BUDGET_S)``, ``default``, or
``command default`` (with what ``KernelCache`` uses instead).

The token is never printed: only whether one is set, and from where.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from typing import TYPE_CHECKING, Any

from kcache.cli_toolkit import add_cache_dir_argument, add_server_arguments, server_url

if TYPE_CHECKING:
    from kcache_client._settings import ClientSettings

__all__ = ["effective_settings", "register"]

# The settings a flag of `kcache config` (and of the client commands) sets.
_FLAGS = {
    "url": "server",
    "token": "token",
    "cache_dir": "cache_dir",
    "local_compile": "local_compile",
    "auto_target": "auto_target",
}
# Launchers' job ids, read when KCACHE_JOB_ID is not set (kcache_client._settings).
_JOB_VARIABLES = ("KCACHE_JOB_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID")


def _value(settings: ClientSettings, name: str) -> Any:
    head, _, part = name.partition(".")
    value = getattr(settings, head)
    return getattr(value, part) if part else value


def _shown(settings: ClientSettings, name: str, value: Any) -> str:
    """A value as a person reads it; the token as whether it is set."""
    from kcache.eviction import default_tier_cap, format_size

    if name == "token":
        return "(set)" if value else "(none)"
    if value is None:
        return {
            "url": "(none: commands work on the cache directory)",
            "cache_max_bytes": f"(default: {format_size(default_tier_cap(settings.cache_dir))})",
            "local_compile": f"(auto: {'on' if settings.compiles_locally else 'off'})",
            "host": f"(this machine: {socket.gethostname()})",
            "client_id": "(one per process: host-pid-random)",
            "auto_target": "(this process's GPU)",
            "device": "(the current CUDA device)",
            "job_id": "(none)",
        }.get(name, "(none)")
    if name in ("cache_max_bytes", "max_artifact_bytes"):
        return format_size(value) if value else "0 (no cap)"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return f"{value:g} s"
    if isinstance(value, dict) or hasattr(value, "items"):
        return json.dumps({k: str(v) for k, v in value.items()}) if value else "{}"
    return str(value)


def effective_settings(args: argparse.Namespace) -> list[dict[str, str]]:
    """Each setting: its name, shown value, source and environment variable."""
    from kcache_client._command_settings import (
        COMMAND_CONNECT_TIMEOUT_S,
        COMMAND_RETRY,
        command_settings,
    )
    from kcache_client._settings import DEFAULT_TIMEOUT, ENVIRONMENT, RetryPolicy

    url = server_url(args)
    settings = command_settings(args, url)
    library = RetryPolicy()
    command_defaults: dict[str, tuple[object, object]] = {
        "timeout.connect": (COMMAND_CONNECT_TIMEOUT_S, DEFAULT_TIMEOUT.connect)
    }
    if url:  # without a server no request is made, and the library's retry policy is used
        command_defaults.update(
            {f"retry.{k}": (v, getattr(library, k)) for k, v in COMMAND_RETRY.items()}
        )
    rows = []
    for name, variable in ENVIRONMENT.items():
        if not hasattr(settings, name.partition(".")[0]):
            continue  # a setting this release does not have
        flag = _FLAGS.get(name)
        given = getattr(args, flag, None) if flag else None
        if given not in (None, False, ""):
            source = f"flag (--{flag.replace('_', '-')})" if flag else "flag"
        elif name == "job_id" and any(os.environ.get(v) for v in _JOB_VARIABLES):
            source = f"environment ({next(v for v in _JOB_VARIABLES if os.environ.get(v))})"
        elif os.environ.get(variable, "").strip():
            source = f"environment ({variable})"
        elif name in command_defaults:
            _, theirs = command_defaults[name]
            source = (
                f"command default (KernelCache: {theirs:g} s)"
                if isinstance(theirs, float)
                else f"command default (KernelCache: {theirs})"
            )
        else:
            source = "default"
        value = _value(settings, name)
        rows.append(
            {
                "setting": name,
                "value": _shown(settings, name, value),
                "source": source,
                "variable": variable,
            }
        )
    from kcache._waiting import PROGRESS_ENV, progress_after_s

    after = progress_after_s()
    rows.append(
        {
            "setting": "progress_after_s",
            "value": "never" if after == float("inf") else f"{after:g} s",
            "source": f"environment ({PROGRESS_ENV})"
            if os.environ.get(PROGRESS_ENV, "").strip()
            else "default",
            "variable": PROGRESS_ENV,
        }
    )
    return rows


def _cmd_config(args: argparse.Namespace) -> int:
    rows = effective_settings(args)
    if args.json:
        json.dump(rows, sys.stdout, indent=2)
        print()
        return 0
    # The variable that sets each one, whatever set it this time: what to export to change it.
    columns = ("setting", "variable", "value", "source")
    table = [{c: c.upper() for c in columns}, *rows]
    widths = [max(len(r[c]) for r in table) for c in columns[:-1]]
    for r in table:
        cells = [f"{r[c]:<{w}}" for c, w in zip(columns, widths, strict=False)]
        print("  ".join([*cells, r["source"]]).rstrip())
    return 0


def register(subparsers: Any) -> None:
    """Add ``kcache config``."""
    config = subparsers.add_parser(
        "config",
        help="show the client settings a command would use, and where each came from",
        description="Every client setting with its value and its source: a flag, the "
        "environment (the variable named), a command's default or the library's default. "
        "The token is shown only as set or not.",
    )
    add_server_arguments(config)
    add_cache_dir_argument(config)
    config.add_argument(
        "--local-compile", action="store_true", help="as the client commands take it"
    )
    config.add_argument("--auto-target", metavar="SM", help="as the client commands take it")
    config.add_argument("--json", action="store_true", help="print JSON")
    config.set_defaults(func=_cmd_config)
