"""``kcache cache info|ls|rm|clear`` and ``kcache pin|unpin``: see and clear a cache, pin kernels.

``kcache cache`` works on a node tier (the user's cache directory, or ``--cache-dir``)
the way ``ccache -s``/``-C`` and ``hf cache scan`` do, and with ``--server URL`` (an
``admin`` token) on a server's store through ``/v1/cache``. ``kcache pin`` and
``kcache unpin`` manage a server's pins (``/v1/pins``); a node tier has none.

Strings that came from a server or from index files (kernel names) are printed with
control characters escaped, never sent raw to the terminal.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from contextlib import closing as _closing
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode

from kcache.eviction import format_size
from kcache.keys import is_hex_key
from kcache_client.errors import ClientError

if TYPE_CHECKING:  # imported when a command runs: `kcache --help` stays instant
    from kcache_client._http import Transport
    from kcache_client._tier import NodeTier

__all__ = ["register"]


def _show(text: object) -> str:
    """``text`` with control characters escaped (``\\x1b``), for a terminal."""
    value = "-" if text is None else str(text)
    if value.isprintable():
        return value
    return "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in value)


def _when(value: float | str | None) -> str:
    if value is None:
        return "-"
    epoch = datetime.fromisoformat(value).timestamp() if isinstance(value, str) else float(value)
    ago = max(0.0, time.time() - epoch)
    local = datetime.fromtimestamp(epoch, timezone.utc).astimezone()
    for unit, seconds in (("d", 86400), ("h", 3600), ("min", 60)):
        if ago >= seconds:
            return f"{local:%Y-%m-%d %H:%M:%S} ({ago / seconds:.0f} {unit} ago)"
    return f"{local:%Y-%m-%d %H:%M:%S} ({ago:.0f} s ago)"


def _table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[_show(h) for h in headers]] + [[_show(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _keys(values: Sequence[str], what: str = "KEY") -> list[str]:
    for value in values:
        if not is_hex_key(value):
            raise ClientError(
                f"{what} {_show(value[:80])!r} is not a recipe key or digest (64 lowercase hex digits; "
                "`kcache key RECIPE` prints a recipe's key)"
            )
    return list(values)


def _emit(args: argparse.Namespace, data: Any, text: str) -> int:
    if args.json:
        json.dump(data, sys.stdout, indent=2, default=str)
        print()
    else:
        print(text)
    return 0


# ---------------------------------------------------------------------- servers
def _server(args: argparse.Namespace, *, required: bool) -> Transport | None:
    url = args.server or (os.environ.get("KCACHE_URL") if required else None)
    if not url:
        if required:
            raise ClientError("pins live on a server: pass --server URL or set KCACHE_URL")
        return None
    import httpx

    from kcache_client._http import Transport
    from kcache_client._settings import RetryPolicy

    token = args.token or os.environ.get("KCACHE_TOKEN") or None
    # Run by a person: a few quick retries, not a training job's patience.
    retry = RetryPolicy(attempts=3, budget_s=10.0)
    timeout = httpx.Timeout(300.0, connect=5.0)
    return Transport(url, token, retry=retry, timeout=timeout, user_agent="kcache-cli")


def _server_info(server: Transport, args: argparse.Namespace) -> int:
    info = server.request("GET", "/v1/cache").json()
    cap = info.get("bytes_cap")
    used = int(info["bytes_used"])
    share = f" ({used / cap * 100:.1f}%)" if cap else ""
    text = "\n".join(
        [
            f"server         {server.url}",
            f"location       {_show(info['location'])}",
            f"size           {format_size(used)} of {format_size(cap) if cap else 'no cap'}{share}",
            f"entries        {info['artifacts']}",
            f"pinned         {info['pinned_artifacts']} artifacts, {format_size(info['pinned_bytes'])} "
            f"({info['pins']} pins)",
            f"oldest use     {_when(info.get('oldest_use'))}",
            f"newest use     {_when(info.get('newest_use'))}",
            f"evictions      {info['evictions']}, {format_size(info['bytes_freed'])} freed",
        ]
    )
    return _emit(args, info, text)


def _server_ls(server: Transport, args: argparse.Namespace) -> int:
    body = server.request("GET", f"/v1/cache/entries?limit={args.limit}").json()
    rows = [
        [
            (e["recipe_keys"][0] if e["recipe_keys"] else e["digest"])[:16],
            e["kernel"] or "-",
            e["target"],
            format_size(e["size"]),
            _when(e.get("last_used_at") or e.get("created_at")),
            "pinned" if e["pinned"] else "",
        ]
        for e in body["entries"]
    ]
    return _emit(args, body, _table(["key", "kernel", "target", "size", "last used", ""], rows))


def _removal_text(body: dict[str, Any]) -> str:
    lines = [f"removed {body['evicted']} artifacts, {format_size(body['bytes_freed'])} freed"]
    if body.get("pinned"):
        lines.append(
            f"kept {len(body['pinned'])} pinned (kcache unpin them first): {' '.join(body['pinned'])}"
        )
    if body.get("unknown"):
        lines.append(f"not stored: {' '.join(body['unknown'])}")
    return "\n".join(lines)


# ---------------------------------------------------------------------- node tiers
def _tier(args: argparse.Namespace) -> NodeTier:
    from kcache_client._settings import ClientSettings
    from kcache_client._tier import NodeTier

    settings = ClientSettings.from_env(cache_dir=args.cache_dir)
    return NodeTier(settings.cache_dir, max_bytes=settings.cache_max_bytes)


def _tier_info(tier: NodeTier, args: argparse.Namespace) -> int:
    usage = tier.usage()
    cap = usage.marks.cap
    share = f" ({usage.bytes_used / cap * 100:.1f}%)" if cap else ""
    data = {
        "location": str(usage.root),
        "bytes_used": usage.bytes_used,
        "bytes_cap": cap or None,
        "high_water_bytes": usage.marks.high_bytes if cap else None,
        "low_water_bytes": usage.marks.low_bytes if cap else None,
        "entries": usage.entries,
        "pinned": 0,
        "oldest_use": usage.oldest_use,
        "newest_use": usage.newest_use,
    }
    text = "\n".join(
        [
            f"location       {_show(usage.root)}",
            f"size           {format_size(usage.bytes_used)} of "
            f"{format_size(cap) if cap else 'no cap'}{share}",
            f"entries        {usage.entries}",
            "pinned         0 (pins are a server's: kcache pin --server)",
            f"oldest use     {_when(usage.oldest_use)}",
            f"newest use     {_when(usage.newest_use)}",
        ]
    )
    return _emit(args, data, text)


def _tier_ls(tier: NodeTier, args: argparse.Namespace) -> int:
    entries = tier.entries()[: args.limit]
    data = {
        "entries": [
            {
                "digest": e.digest,
                "recipe_keys": list(e.recipe_keys),
                "kernel": e.kernel,
                "target": e.target,
                "kind": e.kind,
                "size": e.size,
                "last_used": e.last_used,
            }
            for e in entries
        ]
    }
    rows = [
        [
            (e.recipe_keys[0] if e.recipe_keys else e.digest)[:16],
            e.kernel or "-",
            e.target or "-",
            format_size(e.size),
            _when(e.last_used),
        ]
        for e in entries
    ]
    return _emit(args, data, _table(["key", "kernel", "target", "size", "last used"], rows))


# ---------------------------------------------------------------------- commands
def _cmd_info(args: argparse.Namespace) -> int:
    server = _server(args, required=False)
    if server is not None:
        with _closing(server):
            return _server_info(server, args)
    return _tier_info(_tier(args), args)


def _cmd_ls(args: argparse.Namespace) -> int:
    server = _server(args, required=False)
    if server is not None:
        with _closing(server):
            return _server_ls(server, args)
    return _tier_ls(_tier(args), args)


def _cmd_rm(args: argparse.Namespace) -> int:
    keys = _keys(args.keys)
    server = _server(args, required=False)
    if server is not None:
        with _closing(server):
            body = server.request("POST", "/v1/cache/remove", json={"keys": keys}).json()
        _emit(args, body, _removal_text(body))
        return 0 if not body.get("unknown") and not body.get("pinned") else 1
    removal = _tier(args).remove(keys)
    data = {
        "evicted": removal.removed,
        "bytes_freed": removal.bytes_freed,
        "unknown": list(removal.unknown),
    }
    _emit(args, data, _removal_text(data))
    return 0 if not removal.unknown else 1


def _cmd_clear(args: argparse.Namespace) -> int:
    server = _server(args, required=False)
    if server is not None:
        with _closing(server):
            body = server.request("POST", "/v1/cache/clear").json()
        return _emit(args, body, _removal_text(body))
    removal = _tier(args).clear()
    data = {"evicted": removal.removed, "bytes_freed": removal.bytes_freed}
    return _emit(args, data, _removal_text(data))


def _cmd_pin(args: argparse.Namespace) -> int:
    server = _server(args, required=True)
    assert server is not None
    with _closing(server):
        if args.list:
            query = f"?{urlencode({'group': args.group})}" if args.group else ""
            body = server.request("GET", f"/v1/pins{query}").json()
            rows = [
                [
                    p["recipe_key"],
                    p["group"] or "-",
                    format_size(p["size"]) if p["size"] is not None else "(not compiled)",
                    p["created_by"] or "-",
                    _when(p["created_at"]),
                ]
                for p in body["pins"]
            ]
            return _emit(args, body, _table(["recipe key", "group", "size", "by", "pinned"], rows))
        keys = _keys(args.keys)
        if not keys and not args.job:
            raise ClientError(
                "name recipe keys to pin, or --job JOB to pin a job's recipes (or --list)"
            )
        request: dict[str, Any] = {"recipe_keys": keys, "group": args.group}
        if args.job:
            request["job_id"] = args.job
        body = server.request("POST", "/v1/pins", json=request).json()
        group = f" in group {_show(args.group)}" if args.group else ""
        return _emit(
            args, body, f"pinned {body['requested']} recipe keys{group} ({body['pinned']} new pins)"
        )


def _cmd_unpin(args: argparse.Namespace) -> int:
    keys = _keys(args.keys)
    if not keys and not args.group:
        raise ClientError("name recipe keys to unpin, or --group G to unpin a whole group")
    server = _server(args, required=True)
    assert server is not None
    params = [("recipe_key", k) for k in keys] + ([("group", args.group)] if args.group else [])
    with _closing(server):
        body = server.request("DELETE", f"/v1/pins?{urlencode(params)}").json()
    return _emit(args, body, f"unpinned {body['unpinned']}")


def _where(parser: argparse.ArgumentParser, *, server_default: str) -> None:
    parser.add_argument(
        "--cache-dir", help="the node tier (default $KCACHE_CACHE_DIR or ~/.cache/kcache/client)"
    )
    parser.add_argument("--server", help=server_default)
    parser.add_argument("--token", help="an admin token for --server (default $KCACHE_TOKEN)")
    parser.add_argument("--json", action="store_true", help="print JSON")


def register(subparsers: Any) -> None:
    """Add ``kcache cache`` (info, ls, rm, clear), ``kcache pin`` and ``kcache unpin``."""
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
    ls = sub.add_parser("ls", help="entries, most recently used first: key, kernel, target, size")
    _where(ls, server_default=on_server)
    ls.add_argument("--limit", type=int, default=100, help="show at most this many (default 100)")
    ls.set_defaults(func=_cmd_ls)
    rm = sub.add_parser("rm", help="remove the entries of these recipe keys (or digests)")
    rm.add_argument("keys", nargs="+", metavar="KEY")
    _where(rm, server_default=on_server)
    rm.set_defaults(func=_cmd_rm)
    clear = sub.add_parser("clear", help="remove every entry (on a server: every unpinned one)")
    _where(clear, server_default=on_server)
    clear.set_defaults(func=_cmd_clear)

    server_default = "the server (default $KCACHE_URL)"
    pin = subparsers.add_parser(
        "pin", help="keep recipe keys' artifacts on a server through any eviction (admin)"
    )
    pin.add_argument("keys", nargs="*", metavar="RECIPE_KEY")
    pin.add_argument("--group", help="label the pins (a release, a job) to list or unpin together")
    pin.add_argument("--job", help="also pin every recipe this job id was served (its warmup set)")
    pin.add_argument("--list", action="store_true", help="list pins (of --group if given)")
    pin.add_argument("--server", help=server_default)
    pin.add_argument("--token", help="an admin token (default $KCACHE_TOKEN)")
    pin.add_argument("--json", action="store_true", help="print JSON")
    pin.set_defaults(func=_cmd_pin)
    unpin = subparsers.add_parser("unpin", help="remove pins by recipe key, or a whole --group")
    unpin.add_argument("keys", nargs="*", metavar="RECIPE_KEY")
    unpin.add_argument("--group", help="unpin every pin of this group (or only KEYs within it)")
    unpin.add_argument("--server", help=server_default)
    unpin.add_argument("--token", help="an admin token (default $KCACHE_TOKEN)")
    unpin.add_argument("--json", action="store_true", help="print JSON")
    unpin.set_defaults(func=_cmd_unpin)
