"""``kcache cache info|stats|ls|rm|clear`` and ``kcache pin|unpin``: see and clear a cache, pin kernels.

``kcache cache`` works on a node tier (the user's cache directory, or ``--cache-dir``)
the way ``ccache -s``/``-z``/``-C`` and ``hf cache scan`` do (``cache stats``: its hits and
misses since ``cache stats --zero``, :mod:`kcache_client._tier_stats`), and with
``--server URL`` (an ``admin`` token) on a server's store through ``/v1/cache``. ``kcache pin`` and
``kcache unpin`` manage a server's pins (``/v1/pins``); a node tier has none.

Keys are taken as ``cache ls`` prints them: any unique start of a recipe key or digest
(at least four digits, as git takes a commit's), an ambiguous one refused with the keys
it begins. Removal follows what the user named, not what happens to share its bytes:
recipes that compile to the same code share one blob, so ``cache rm RECIPE_KEY`` on a
node tier removes that recipe's entry and the blob only when no other recipe key names
it (a server removes whole artifacts, so there a shared one is refused and its digest
asked for), while ``cache rm DIGEST`` removes the artifact for every recipe. ``cache
clear`` asks on the terminal first (``--yes`` does not ask; without a terminal it is
required), and ``pin --job`` with a job id the server never saw is an error that pins
nothing, not "pinned 0". ``rm --dry-run`` and ``clear --dry-run`` make the same decisions
and print what they would remove (count, bytes, keys and kernels), removing nothing and
asking nothing; on a server they are worked out from its listing, nothing is sent.

Strings that came from a server or from index files (kernel names) are printed with
control characters escaped, never sent raw to the terminal.

This module holds the commands' arguments and chooses the place each works on; the work
is :mod:`~kcache_client._tier_cache_cli`'s on a node tier and
:mod:`~kcache_client._server_cache_cli`'s on a server (pins included), keys are read by
:mod:`~kcache_client._key_prefixes` and output written by :mod:`~kcache_client._cache_cli_text`.
"""

from __future__ import annotations

import argparse
from contextlib import closing
from typing import Any

from kcache_client._cache_cli_text import emit, removal_text
from kcache_client._key_prefixes import MIN_PREFIX, check_keys
from kcache_client._server_cache_cli import (
    cmd_pin,
    cmd_unpin,
    open_server,
    server_clear,
    server_info,
    server_ls,
    server_remove,
)
from kcache_client._tier_cache_cli import (
    cmd_stats,
    layer_rows,
    open_tier,
    tier_clear,
    tier_info,
    tier_ls,
    tier_remove,
)

__all__ = ["register"]


def _cmd_info(args: argparse.Namespace) -> int:
    server = open_server(args, required=False)
    if server is not None:
        with closing(server):
            return server_info(server, args)
    return tier_info(open_tier(args), args, layer_rows(args))


def _cmd_tier_stats(args: argparse.Namespace) -> int:
    """``kcache stats`` of a client installed alone: the node tier's numbers."""
    return tier_info(open_tier(args), args)


def _cmd_ls(args: argparse.Namespace) -> int:
    server = open_server(args, required=False)
    if server is not None:
        with closing(server):
            return server_ls(server, args)
    return tier_ls(open_tier(args), args)


def _cmd_rm(args: argparse.Namespace) -> int:
    check_keys(args.keys, "KEY")
    server = open_server(args, required=False)
    if server is not None:
        with closing(server):
            body = server_remove(server, args.keys, dry_run=args.dry_run)
        emit(args, body, removal_text(body))
        return 0 if not body.get("unknown") and not body.get("pinned") else 1
    data = tier_remove(open_tier(args), args.keys, dry_run=args.dry_run)
    emit(args, data, removal_text(data))
    return 0 if not data["unknown"] else 1


def _cmd_clear(args: argparse.Namespace) -> int:
    server = open_server(args, required=False)
    if server is not None:
        with closing(server):
            return server_clear(server, args)
    return tier_clear(open_tier(args), args)


def _where(parser: argparse.ArgumentParser, *, server_default: str) -> None:
    parser.add_argument(
        "--cache-dir", help="the node tier (default $KCACHE_CACHE_DIR or ~/.cache/kcache/client)"
    )
    parser.add_argument("--server", help=server_default)
    parser.add_argument("--token", help="an admin token for --server (default $KCACHE_TOKEN)")
    parser.add_argument("--json", action="store_true", help="print JSON")


def register(subparsers: Any) -> None:
    """Add ``kcache cache`` (info, stats, ls, rm, clear), ``kcache pin`` and ``kcache unpin``."""
    on_server = "work on this server's store instead (needs an admin token)"
    cache = subparsers.add_parser(
        "cache", help="see and clear a node tier (default) or, with --server, a server's store"
    )
    sub = cache.add_subparsers(dest="cache_command", required=True)
    info = sub.add_parser(
        "info", help="location, bytes used of the cap, entries, oldest/newest use"
    )
    _where(info, server_default=on_server)
    info.set_defaults(func=_cmd_info)
    stats = sub.add_parser(
        "stats",
        help="hits, misses, hit rate, size and entries of the node tier since the mark (ccache -s)",
        description="The node tier's statistics, like `ccache -s`: lookups it answered (hits) "
        "and those that needed the server or a compile here (misses), since the mark that "
        "--zero sets (like `ccache -z`), with its size and entries. Each process writes its "
        "counts when it ends: processes still running are not in them yet.",
    )
    stats.add_argument(
        "--cache-dir", help="the node tier (default $KCACHE_CACHE_DIR or ~/.cache/kcache/client)"
    )
    stats.add_argument("--zero", action="store_true", help="set the mark: count from now")
    stats.add_argument("--json", action="store_true", help="print JSON")
    stats.set_defaults(func=cmd_stats)
    ls = sub.add_parser("ls", help="entries, most recently used first: key, kernel, target, size")
    _where(ls, server_default=on_server)
    ls.add_argument("--limit", type=int, default=100, help="show at most this many (default 100)")
    ls.set_defaults(func=_cmd_ls)
    rm = sub.add_parser(
        "rm",
        help="remove the entries of these recipe keys, or the artifacts of these digests",
        description="Remove what each KEY names: a recipe key its entry (and its artifact when no "
        "other recipe key names it; a server removes whole artifacts, so there a shared one is "
        "refused: pass its digest), a digest its artifact and every entry naming it. A KEY may be "
        f"any unique start of at least {MIN_PREFIX} digits, as `kcache cache ls` prints them.",
    )
    rm.add_argument("keys", nargs="+", metavar="KEY")
    _where(rm, server_default=on_server)
    rm.add_argument(
        "--dry-run",
        action="store_true",
        help="print what would be removed (count, bytes, keys and kernels); remove nothing",
    )
    rm.set_defaults(func=_cmd_rm)
    clear = sub.add_parser(
        "clear",
        help="remove every entry (on a server: every unpinned one); asks first",
        description="Remove every entry of the cache directory (with --server: every unpinned "
        "artifact of the server's store). It asks on the terminal first; --yes does not ask, "
        "and without a terminal (a script) --yes is required.",
    )
    _where(clear, server_default=on_server)
    clear.add_argument("--yes", action="store_true", help="do not ask: remove them")
    clear.add_argument(
        "--dry-run",
        action="store_true",
        help="print what would be removed (count, bytes, keys and kernels); remove nothing, "
        "ask nothing",
    )
    clear.set_defaults(func=_cmd_clear)

    server_default = "the server (default $KCACHE_URL)"
    pin = subparsers.add_parser(
        "pin", help="keep recipe keys' artifacts on a server through any eviction (admin)"
    )
    pin.add_argument(
        "keys", nargs="*", metavar="RECIPE_KEY", help="recipe keys, or unique starts of them"
    )
    pin.add_argument("--group", help="label the pins (a release, a job) to list or unpin together")
    pin.add_argument("--job", help="also pin every recipe this job id was served (its warmup set)")
    pin.add_argument("--list", action="store_true", help="list pins (of --group if given)")
    pin.add_argument("--server", help=server_default)
    pin.add_argument("--token", help="an admin token (default $KCACHE_TOKEN)")
    pin.add_argument("--json", action="store_true", help="print JSON")
    pin.set_defaults(func=cmd_pin)
    unpin = subparsers.add_parser("unpin", help="remove pins by recipe key, or a whole --group")
    unpin.add_argument(
        "keys", nargs="*", metavar="RECIPE_KEY", help="pinned recipe keys, or unique starts of them"
    )
    unpin.add_argument("--group", help="unpin every pin of this group (or only KEYs within it)")
    unpin.add_argument("--server", help=server_default)
    unpin.add_argument("--token", help="an admin token (default $KCACHE_TOKEN)")
    unpin.add_argument("--json", action="store_true", help="print JSON")
    unpin.set_defaults(func=cmd_unpin)

    from importlib.metadata import entry_points

    # `kcache stats` is the server distribution's (it reads --cache-dir through `cache
    # info`); a client alone, as in a training image, still has the node tier's numbers.
    if not any(ep.name == "stats" for ep in entry_points(group="kcache.commands")):
        stats = subparsers.add_parser(
            "stats",
            help="your cache directory's numbers: entries, bytes of the cap, oldest/newest use",
            description="The node tier's own numbers, as `kcache cache info` prints them. A "
            "server's statistics need the server distribution (kcache-server) installed, or "
            "its dashboard.",
        )
        stats.add_argument(
            "--cache-dir",
            help="the node tier (default $KCACHE_CACHE_DIR or ~/.cache/kcache/client)",
        )
        stats.add_argument("--json", action="store_true", help="print JSON")
        stats.set_defaults(func=_cmd_tier_stats)
