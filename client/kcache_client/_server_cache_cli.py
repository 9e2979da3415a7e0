"""``kcache cache --server URL`` and ``kcache pin|unpin``: a server's store and its pins.

With ``--server`` (an ``admin`` token), ``kcache cache`` works on a server's store through
``/v1/cache`` (:mod:`~kcache_client._cache_cli` chooses the place); ``kcache pin`` and
``kcache unpin`` manage its pins (``/v1/pins``), which a node tier has none of.

The server removes whole artifacts (every recipe key naming one goes with it), so a
recipe key whose artifact other recipe keys name too is refused, and its digest asked
for (:func:`refuse_shared`). A dry run (``rm``, ``clear``) is worked out from the
server's listing and sends nothing; ``pin --job`` with a job id the server never saw is an
error that pins nothing, not "pinned 0". Run by a person, a command retries a few times
quickly, not with a training job's patience (:func:`open_server`).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from contextlib import closing
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode

from kcache.eviction import format_size
from kcache_client._cache_cli_text import (
    confirm,
    emit,
    listed,
    removal_text,
    show,
    text_table,
    when,
)
from kcache_client._key_prefixes import Known, check_keys, resolve_keys
from kcache_client.errors import ClientError

if TYPE_CHECKING:  # imported when a command runs: `kcache --help` stays instant
    from kcache_client._http import Transport

__all__ = [
    "cmd_pin",
    "cmd_unpin",
    "open_server",
    "server_clear",
    "server_info",
    "server_ls",
    "server_remove",
]

#: The most entries one listing asks a server for (its own limit).
_LISTING = 10_000


def open_server(args: argparse.Namespace, *, required: bool) -> Transport | None:
    """The server the command names (``--server``, or ``$KCACHE_URL`` where one is
    ``required``), or None to work on the node tier."""
    url = args.server or (os.environ.get("KCACHE_URL") if required else None)
    if not url:
        if required:
            raise ClientError("pins live on a server: pass --server URL or set KCACHE_URL")
        return None
    from kcache_client._http import Transport
    from kcache_client._settings import RetryPolicy, timeout_from_env
    from kcache_client._waits import Waits

    token = args.token or os.environ.get("KCACHE_TOKEN") or None
    # Run by a person: a few quick retries, not a training job's patience (unless the
    # environment's KCACHE_RETRY_* and KCACHE_*_TIMEOUT_S say otherwise).
    retry = RetryPolicy.from_env(attempts=3, budget_s=10.0)
    timeout = timeout_from_env(Waits(connect=5.0, read=300.0, write=300.0))
    return Transport(url, token, retry=retry, timeout=timeout, user_agent="kcache-cli")


def server_info(server: Transport, args: argparse.Namespace) -> int:
    """``kcache cache info --server``."""
    info = server.request("GET", "/v1/cache").json()
    cap = info.get("bytes_cap")
    used = int(info["bytes_used"])
    share = f" ({used / cap * 100:.1f}%)" if cap else ""
    text = "\n".join(
        [
            f"server         {server.url}",
            f"location       {show(info['location'])}",
            f"size           {format_size(used)} of {format_size(cap) if cap else 'no cap'}{share}",
            f"entries        {info['artifacts']}",
            f"pinned         {info['pinned_artifacts']} artifacts, {format_size(info['pinned_bytes'])} "
            f"({info['pins']} pins)",
            f"oldest use     {when(info.get('oldest_use'))}",
            f"newest use     {when(info.get('newest_use'))}",
            f"evictions      {info['evictions']}, {format_size(info['bytes_freed'])} freed",
        ]
    )
    return emit(args, info, text)


def server_ls(server: Transport, args: argparse.Namespace) -> int:
    """``kcache cache ls --server``."""
    body = server.request("GET", f"/v1/cache/entries?limit={args.limit}").json()
    rows = [
        [
            (e["recipe_keys"][0] if e["recipe_keys"] else e["digest"])[:16],
            e["kernel"] or "-",
            e["target"],
            format_size(e["size"]),
            when(e.get("last_used_at") or e.get("created_at")),
            "pinned" if e["pinned"] else "",
        ]
        for e in body["entries"]
    ]
    return emit(args, body, text_table(["key", "kernel", "target", "size", "last used", ""], rows))


def _entries(server: Transport) -> list[dict[str, Any]]:
    """The server's stored artifacts, as many as one listing gives (the most recently used)."""
    entries: list[dict[str, Any]] = server.request(
        "GET", f"/v1/cache/entries?limit={_LISTING}"
    ).json()["entries"]
    return entries


def _known_of_entries(entries: Sequence[dict[str, Any]]) -> list[Known]:
    known = [Known(k, "recipe key", e["kernel"]) for e in entries for k in e["recipe_keys"]]
    return known + [Known(e["digest"], "digest", e["kernel"]) for e in entries]


def refuse_shared(keys: Sequence[str], entries: Sequence[dict[str, Any]]) -> None:
    """A recipe key whose artifact other recipe keys name too cannot go alone from a server.

    The server removes whole artifacts (every recipe key naming one goes with it); a
    recipe key standing for all of them would remove other recipes' entries unasked.
    Its digest says so explicitly.
    """
    asked = set(keys)
    for entry in entries:
        named = [k for k in entry["recipe_keys"] if k in asked]
        others = [k for k in entry["recipe_keys"] if k not in asked]
        if named and others and entry["digest"] not in asked:
            raise ClientError(
                f"KEY {named[0][:16]}: its artifact {entry['digest'][:16]} is also the artifact of "
                f"{len(others)} other recipe key(s) ({', '.join(k[:16] for k in others[:3])}), "
                "and a server removes whole artifacts: to remove it for all of them, pass its "
                f"digest {entry['digest']}"
            )


def server_remove(
    server: Transport, values: Sequence[str], *, dry_run: bool = False
) -> dict[str, Any]:
    """``kcache cache rm --server``: what each value names removed from the server's store
    (``POST /v1/cache/remove``), or with ``dry_run`` what would be (:func:`_would_remove`)."""
    entries = _entries(server)
    keys = resolve_keys(values, lambda: _known_of_entries(entries), f"the server {server.url}")
    refuse_shared(keys, entries)
    if dry_run:
        return _would_remove(keys, entries)
    answer: dict[str, Any] = server.request("POST", "/v1/cache/remove", json={"keys": keys}).json()
    return answer


def _would_remove(keys: Sequence[str], entries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """What ``POST /v1/cache/remove`` of ``keys`` would answer, from the server's listing,
    and the artifacts it would remove: whole artifacts (a recipe key stands for its
    artifact once :func:`refuse_shared` let it), pinned ones kept. Nothing is sent."""
    by_key = {k: e for e in entries for k in (e["digest"], *e["recipe_keys"])}
    chosen: dict[str, dict[str, Any]] = {}
    pinned: list[str] = []
    unknown: list[str] = []
    for key in keys:
        entry = by_key.get(key)
        if entry is None:
            unknown.append(key)
        elif entry["pinned"]:
            pinned.append(key)
        else:
            chosen[entry["digest"]] = entry
    artifacts = [listed(e) for e in chosen.values()]
    return {
        "dry_run": True,
        "evicted": len(artifacts),
        "bytes_freed": sum(e["size"] for e in artifacts),
        "artifacts": artifacts,
        "pinned": pinned,
        "unknown": unknown,
    }


def server_clear(server: Transport, args: argparse.Namespace) -> int:
    """``kcache cache clear --server``: every unpinned artifact of the server's store."""
    info = server.request("GET", "/v1/cache").json()
    unpinned = int(info["artifacts"]) - int(info["pinned_artifacts"])
    unpinned_bytes = int(info["bytes_used"]) - int(info["pinned_bytes"])
    what = (
        f"every unpinned artifact of the server {server.url} ({unpinned} artifacts, "
        f"{format_size(unpinned_bytes)})"
    )
    if args.dry_run:
        body = {
            "dry_run": True,
            "evicted": unpinned,
            "bytes_freed": unpinned_bytes,
            "artifacts": [listed(e) for e in _entries(server) if not e["pinned"]],
        }
        return emit(args, body, removal_text(body))
    if not confirm(args, what):
        print("kcache: nothing removed", file=sys.stderr)
        return 1
    body = server.request("POST", "/v1/cache/clear").json()
    return emit(args, body, removal_text(body))


# ---------------------------------------------------------------------- pins
def _pinnable(server: Transport) -> list[Known]:
    """What a pin's prefix may stand for: stored artifacts' recipe keys and pinned keys."""
    known = [k for k in _known_of_entries(_entries(server)) if k.kind == "recipe key"]
    pins = server.request("GET", "/v1/pins").json()["pins"]
    return known + [Known(p["recipe_key"], "recipe key", "pinned") for p in pins]


def cmd_pin(args: argparse.Namespace) -> int:
    """``kcache pin``: recipe keys (or a job's recipes) kept through any eviction; ``--list``."""
    server = open_server(args, required=True)
    assert server is not None
    with closing(server):
        if args.list:
            query = f"?{urlencode({'group': args.group})}" if args.group else ""
            body = server.request("GET", f"/v1/pins{query}").json()
            rows = [
                [
                    p["recipe_key"],
                    p["group"] or "-",
                    format_size(p["size"]) if p["size"] is not None else "(not compiled)",
                    p["created_by"] or "-",
                    when(p["created_at"]),
                ]
                for p in body["pins"]
            ]
            return emit(
                args, body, text_table(["recipe key", "group", "size", "by", "pinned"], rows)
            )
        keys = resolve_keys(
            args.keys, lambda: _pinnable(server), f"the server {server.url}", names="recipe key"
        )
        if not keys and not args.job:
            raise ClientError(
                "name recipe keys to pin, or --job JOB to pin a job's recipes (or --list)"
            )
        body = {"requested": 0, "pinned": 0}
        if args.job:
            # The job alone first: a job id nobody was served (a typo) pins nothing, keys neither.
            request = {"recipe_keys": [], "group": args.group, "job_id": args.job}
            job = server.request("POST", "/v1/pins", json=request).json()
            if not job["requested"]:
                raise ClientError(
                    f"--job {show(args.job)!r}: the server recorded no lookups for this job id, "
                    "so there is nothing to pin (nothing was pinned); `kcache stats --group-by job` "
                    "lists the job ids it has seen"
                )
            body = {k: body[k] + int(job[k]) for k in body}
        if keys:
            request = {"recipe_keys": keys, "group": args.group}
            named = server.request("POST", "/v1/pins", json=request).json()
            body = {k: body[k] + int(named[k]) for k in body}
        group = f" in group {show(args.group)}" if args.group else ""
        return emit(
            args, body, f"pinned {body['requested']} recipe keys{group} ({body['pinned']} new pins)"
        )


def cmd_unpin(args: argparse.Namespace) -> int:
    """``kcache unpin``: pins removed by recipe key, or a whole ``--group``."""
    check_keys(args.keys, "RECIPE_KEY")
    if not args.keys and not args.group:
        raise ClientError("name recipe keys to unpin, or --group G to unpin a whole group")
    server = open_server(args, required=True)
    assert server is not None
    with closing(server):

        def pinned() -> list[Known]:
            pins = server.request("GET", "/v1/pins").json()["pins"]
            return [Known(p["recipe_key"], "recipe key", "pinned") for p in pins]

        keys = resolve_keys(
            args.keys, pinned, f"the pins of {server.url}", "RECIPE_KEY", names="pinned recipe key"
        )
        params = [("recipe_key", k) for k in keys] + ([("group", args.group)] if args.group else [])
        body = server.request("DELETE", f"/v1/pins?{urlencode(params)}").json()
        if args.group and not body["unpinned"]:  # a misspelt group read as done
            pins = server.request("GET", "/v1/pins").json()["pins"]
            groups = sorted({p["group"] for p in pins if p["group"]})
            raise ClientError(
                f"--group {show(args.group)!r}: no pin {'of these keys ' if keys else ''}is in "
                f"this group, so nothing was unpinned; the groups: "
                f"{', '.join(map(show, groups)) or '(none)'} (`kcache pin --list`)"
            )
    return emit(args, body, f"unpinned {body['unpinned']}")
