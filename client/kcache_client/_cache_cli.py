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
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import closing as _closing
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode

from kcache.eviction import format_size
from kcache.keys import is_hex_key
from kcache_client.errors import ClientError

if TYPE_CHECKING:  # imported when a command runs: `kcache --help` stays instant
    from kcache_client._http import Transport
    from kcache_client._tier import NodeTier

__all__ = ["register", "text_table"]

#: The most entries one listing asks a server for (its own limit).
_LISTING = 10_000


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


def text_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[_show(h) for h in headers]] + [[_show(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


#: The shortest prefix of a key accepted (git's): shorter ones would match by chance.
_MIN_PREFIX = 4
_PREFIX_RE = re.compile(rf"[0-9a-f]{{{_MIN_PREFIX},64}}")


@dataclass(frozen=True)
class _Known:
    """A key a prefix may stand for: a recipe key or a digest, and what it names."""

    key: str
    kind: str  # "recipe key" or "digest"
    kernel: str


def _unpack(values: Sequence[str], what: str) -> list[str]:
    """Check the form of each value: a key, or a prefix of one (what ``kcache cache ls`` prints)."""
    for value in values:
        if not _PREFIX_RE.fullmatch(value):
            raise ClientError(
                f"{what} {_show(value[:80])!r} is not a recipe key or digest, nor the start of one "
                f"({_MIN_PREFIX} to 64 lowercase hex digits, as `kcache cache ls` prints them; "
                "`kcache key RECIPE` prints a recipe's key)"
            )
    return list(values)


def _keys(
    values: Sequence[str],
    known: Callable[[], Sequence[_Known]],
    where: str,
    what: str = "KEY",
) -> list[str]:
    """Each value as the whole key it starts, the way git takes a commit's prefix.

    A whole key (64 digits) is taken as it is, known or not; a shorter one must begin
    exactly one of ``known()`` (asked only when a prefix needs it): none is an error,
    and so is more than one, listing them.
    """
    out: list[str] = []
    candidates: Sequence[_Known] | None = None
    for value in _unpack(values, what):
        if is_hex_key(value):
            out.append(value)
            continue
        if candidates is None:
            candidates = known()
        matches = {k.key: k for k in candidates if k.key.startswith(value)}
        if not matches:
            raise ClientError(
                f"{what} {value} begins no recipe key or digest of {where} "
                "(`kcache cache ls` lists them)"
            )
        if len(matches) > 1:
            shown = [
                f"{k.key[:16]} ({k.kind}{', ' + _show(k.kernel) if k.kernel else ''})"
                for k in list(matches.values())[:5]
            ]
            more = f" and {len(matches) - 5} more" if len(matches) > 5 else ""
            raise ClientError(
                f"{what} {value} is ambiguous in {where}: it begins {', '.join(shown)}{more}; "
                "give more of its digits"
            )
        out.append(next(iter(matches)))
    return out


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
    from kcache_client._settings import RetryPolicy, timeout_from_env

    token = args.token or os.environ.get("KCACHE_TOKEN") or None
    # Run by a person: a few quick retries, not a training job's patience (unless the
    # environment's KCACHE_RETRY_* and KCACHE_*_TIMEOUT_S say otherwise).
    retry = RetryPolicy.from_env(attempts=3, budget_s=10.0)
    timeout = timeout_from_env(httpx.Timeout(300.0, connect=5.0))
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
    return _emit(args, body, text_table(["key", "kernel", "target", "size", "last used", ""], rows))


def _server_entries(server: Transport) -> list[dict[str, Any]]:
    """The server's stored artifacts, as many as one listing gives (the most recently used)."""
    entries: list[dict[str, Any]] = server.request(
        "GET", f"/v1/cache/entries?limit={_LISTING}"
    ).json()["entries"]
    return entries


def _known_of_entries(entries: Sequence[dict[str, Any]]) -> list[_Known]:
    known = [_Known(k, "recipe key", e["kernel"]) for e in entries for k in e["recipe_keys"]]
    return known + [_Known(e["digest"], "digest", e["kernel"]) for e in entries]


def _refuse_shared(keys: Sequence[str], entries: Sequence[dict[str, Any]]) -> None:
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


def _removal_text(body: dict[str, Any]) -> str:
    lines = []
    dry = bool(body.get("dry_run"))
    removed = "would remove" if dry else "removed"
    if "recipes_removed" in body:
        count = int(body["recipes_removed"])
        lines.append(f"{removed} {count} recipe {'entry' if count == 1 else 'entries'}")
    freed = "would be freed" if dry else "freed"
    lines.append(
        f"{removed} {body['evicted']} artifacts, {format_size(body['bytes_freed'])} {freed}"
    )
    if dry:
        rows = [
            [
                (a["recipe_keys"][0] if a["recipe_keys"] else a["digest"])[:16],
                a["kernel"] or "-",
                a["target"] or "-",
                format_size(a["size"]),
            ]
            for a in body.get("artifacts") or ()
        ]
        if rows:
            table = text_table(["key", "kernel", "target", "size"], rows)
            lines.extend("  " + line for line in table.splitlines())
        more = int(body["evicted"]) - len(rows)
        if more > 0:
            lines.append(f"  ... and {more} more (not listed)")
    for digest, others in (body.get("kept") or {}).items():
        lines.append(
            f"kept artifact {digest[:16]}: {len(others)} other recipe key(s) name it "
            f"({', '.join(k[:16] for k in others[:3])}); `kcache cache rm {digest[:16]}` "
            "removes it for all"
        )
    if body.get("pinned"):
        lines.append(
            f"kept {len(body['pinned'])} pinned (kcache unpin them first): {' '.join(body['pinned'])}"
        )
    if body.get("unknown"):
        lines.append(f"not stored: {' '.join(body['unknown'])}")
    if dry:
        lines.append("dry run: nothing was removed")
    return "\n".join(lines)


# ---------------------------------------------------------------------- node tiers
def _tier(args: argparse.Namespace) -> NodeTier:
    from kcache_client._settings import ClientSettings
    from kcache_client._tier import NodeTier

    settings = ClientSettings.from_env(cache_dir=args.cache_dir)
    if args.cache_dir and not settings.cache_dir.is_dir():  # a typo must not make a new tier
        raise ClientError(
            f"{settings.cache_dir} (--cache-dir) is not a cache directory: it does not exist"
        )
    return NodeTier(settings.cache_dir, max_bytes=settings.cache_max_bytes)


def _layers(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Each read-only layer of ``KCACHE_CACHE_LAYERS``, opened as a cache opens it.

    A bundle file is unpacked (once, as the cache would at start) and checked whole; one
    that is refused, or a directory that is gone, is shown with the reason rather than
    stopping the listing, since ``cache info`` is where one looks to find it.
    """
    from kcache.errors import KCacheError
    from kcache_client._bundle import open_layers
    from kcache_client._settings import ClientSettings
    from kcache_client._trust import Trust

    settings = ClientSettings.from_env(cache_dir=args.cache_dir)
    if not settings.layers:
        return []
    trust = Trust.from_settings(settings.trusted_keys, settings.known_servers, settings.url)
    rows: list[dict[str, Any]] = []
    for path in settings.layers:
        row: dict[str, Any] = {"source": str(path), "location": None, "entries": 0, "bytes_used": 0}
        try:
            (layer,) = open_layers(
                [path], settings.cache_dir, trust, max_entry_bytes=settings.max_artifact_bytes
            )
        except KCacheError as exc:
            rows.append({**row, "error": str(exc)})
            continue
        usage = layer.usage()
        rows.append(
            {
                **row,
                "location": str(layer.root),
                "entries": usage.entries,
                "bytes_used": usage.bytes_used,
                "error": None,
            }
        )
    return rows


def _layer_text(i: int, row: dict[str, Any]) -> str:
    head = f"layer {i}".ljust(15)
    if row["error"]:
        return f"{head}{_show(row['source'])}: refused: {_show(row['error'])}"
    where = _show(row["source"])
    if row["location"] != row["source"]:
        where += f" (unpacked in {_show(row['location'])})"
    return f"{head}{where}: {row['entries']} entries, {format_size(row['bytes_used'])}, read-only"


def _tier_info(
    tier: NodeTier, args: argparse.Namespace, layers: Sequence[dict[str, Any]] = ()
) -> int:
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
        "layers": list(layers),
    }
    text = "\n".join(
        [
            f"location       {_show(usage.root)} (writable)",
            f"size           {format_size(usage.bytes_used)} of "
            f"{format_size(cap) if cap else 'no cap'}{share}",
            f"entries        {usage.entries}",
            "pinned         0 (pins are a server's: kcache pin --server)",
            f"oldest use     {_when(usage.oldest_use)}",
            f"newest use     {_when(usage.newest_use)}",
        ]
        + [_layer_text(i, row) for i, row in enumerate(layers, 1)]
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
    return _emit(args, data, text_table(["key", "kernel", "target", "size", "last used"], rows))


# ---------------------------------------------------------------------- commands
def _cmd_info(args: argparse.Namespace) -> int:
    server = _server(args, required=False)
    if server is not None:
        with _closing(server):
            return _server_info(server, args)
    return _tier_info(_tier(args), args, _layers(args))


def _cmd_tier_stats(args: argparse.Namespace) -> int:
    """``kcache stats`` of a client installed alone: the node tier's numbers."""
    return _tier_info(_tier(args), args)


def _cmd_stats(args: argparse.Namespace) -> int:
    """``kcache cache stats [--zero]``: the node tier's hits and misses since the mark
    (:mod:`kcache_client._tier_stats`), with its size, like ``ccache -s``/``-z``."""
    from kcache_client import _tier_stats

    tier = _tier(args)
    if args.zero:
        if not tier.standing.writable:
            raise ClientError(
                f"the cache directory {_show(tier.root)} is not writable here "
                f"({_show(tier.standing.reason)}): its statistics cannot be zeroed"
            )
        at = _tier_stats.zero(tier.root)
        data = {"location": str(tier.root), "zeroed_at": at}
        return _emit(args, data, f"statistics of {_show(tier.root)} zeroed: counting from now")
    counts = _tier_stats.read(tier.root)
    usage = tier.usage()
    cap = usage.marks.cap
    share = f" ({usage.bytes_used / cap * 100:.1f}%)" if cap else ""
    rate = counts.hit_rate
    data = {
        "location": str(usage.root),
        "since": counts.mark if counts.mark is not None else counts.first,
        "zeroed_at": counts.mark,
        "hits": counts.hits,
        "misses": counts.misses,
        "hit_rate": rate,
        **counts.counts,
        "processes": counts.processes,
        "bytes_used": usage.bytes_used,
        "bytes_cap": cap or None,
        "entries": usage.entries,
    }
    if counts.mark is not None:
        since = f"{_when(counts.mark)}, the mark (kcache cache stats --zero)"
    elif counts.first is not None:
        since = f"{_when(counts.first)}, the first process counted (never zeroed)"
    else:
        since = "- (nothing counted yet; never zeroed)"
    c = counts.counts
    text = "\n".join(
        [
            f"location       {_show(usage.root)}",
            f"since          {since}",
            f"hits           {counts.hits} (answered by the node tier or its layers)",
            f"misses         {counts.misses} ({c['server_fetches']} from the server, "
            f"{c['local_compiles']} compiled here)",
            f"hit rate       {'-' if rate is None else f'{rate * 100:.1f} %'}",
            f"memory hits    {c['memory_hits']} (a process asking again: not counted above)",
            f"prefetched     {c['bundle_entries']} kernels put into the tier by prefetches",
            f"processes      {counts.processes} (each writes its counts when it ends)",
            f"size           {format_size(usage.bytes_used)} of "
            f"{format_size(cap) if cap else 'no cap'}{share}",
            f"entries        {usage.entries}",
        ]
    )
    return _emit(args, data, text)


def _cmd_ls(args: argparse.Namespace) -> int:
    server = _server(args, required=False)
    if server is not None:
        with _closing(server):
            return _server_ls(server, args)
    return _tier_ls(_tier(args), args)


def _cmd_rm(args: argparse.Namespace) -> int:
    _unpack(args.keys, "KEY")
    server = _server(args, required=False)
    if server is not None:
        with _closing(server):
            entries = _server_entries(server)
            keys = _keys(args.keys, lambda: _known_of_entries(entries), f"the server {server.url}")
            _refuse_shared(keys, entries)
            if args.dry_run:
                body = _server_would_remove(keys, entries)
            else:
                body = server.request("POST", "/v1/cache/remove", json={"keys": keys}).json()
        _emit(args, body, _removal_text(body))
        return 0 if not body.get("unknown") and not body.get("pinned") else 1
    data = _tier_remove(_tier(args), args.keys, dry_run=args.dry_run)
    _emit(args, data, _removal_text(data))
    return 0 if not data["unknown"] else 1


def _listed(entry: dict[str, Any]) -> dict[str, Any]:
    """What a dry run names of an artifact it would remove (the same fields everywhere)."""
    return {
        "digest": entry["digest"],
        "recipe_keys": list(entry["recipe_keys"]),
        "kernel": entry.get("kernel") or "",
        "target": entry.get("target") or "",
        "size": int(entry["size"]),
    }


def _server_would_remove(keys: Sequence[str], entries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """What ``POST /v1/cache/remove`` of ``keys`` would answer, from the server's listing,
    and the artifacts it would remove: whole artifacts (a recipe key stands for its
    artifact once :func:`_refuse_shared` let it), pinned ones kept. Nothing is sent."""
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
    listed = [_listed(e) for e in chosen.values()]
    return {
        "dry_run": True,
        "evicted": len(listed),
        "bytes_freed": sum(e["size"] for e in listed),
        "artifacts": listed,
        "pinned": pinned,
        "unknown": unknown,
    }


def _tier_remove(tier: NodeTier, values: Sequence[str], *, dry_run: bool = False) -> dict[str, Any]:
    """Remove what each value names from a node tier: a recipe key its entry, a digest its artifact.

    A recipe key's artifact goes too when no other recipe key names it (recipes that
    compile to the same bytes share one blob); otherwise it stays for them, and is
    reported as kept. A digest removes the artifact and every recipe entry naming it.
    A kept artifact's manifest entry stays too (the tier's index has no removal of one):
    a local compile of the removed recipe may match it by its dependencies and find the
    same bytes again instead of compiling.

    ``dry_run``: the same decisions, and the artifacts they would remove listed, with
    nothing forgotten or removed.
    """
    entries = tier.entries()
    known = [_Known(k, "recipe key", e.kernel) for e in entries for k in e.recipe_keys]
    known += [_Known(e.digest, "digest", e.kernel) for e in entries]
    keys = _keys(values, lambda: known, f"the cache directory {tier.root}")
    by_recipe = {k: e for e in entries for k in e.recipe_keys}
    by_digest = {e.digest: e for e in entries}
    forgotten: dict[str, set[str]] = {}
    blobs: set[str] = set()
    unknown: list[str] = []
    for key in keys:
        if key in by_recipe:
            entry = by_recipe[key]
            if not dry_run:
                tier.index.forget(key)
            forgotten.setdefault(entry.digest, set()).add(key)
        elif key in by_digest:
            blobs.add(key)
        else:
            unknown.append(key)
    kept: dict[str, list[str]] = {}
    for digest, gone in forgotten.items():
        others = sorted(set(by_digest[digest].recipe_keys) - gone)
        if others and digest not in blobs:
            kept[digest] = others
        else:
            blobs.add(digest)
    if dry_run:
        listed = [_listed(vars(e)) for e in entries if e.digest in blobs]
        return {
            "dry_run": True,
            "recipes_removed": sum(len(g) for g in forgotten.values()),
            "evicted": len(listed),
            "bytes_freed": sum(e["size"] for e in listed),
            "artifacts": listed,
            "kept": kept,
            "unknown": unknown,
        }
    removal = tier.remove(sorted(blobs)) if blobs else None
    return {
        "recipes_removed": sum(len(g) for g in forgotten.values()),
        "evicted": removal.removed if removal else 0,
        "bytes_freed": removal.bytes_freed if removal else 0,
        "kept": kept,
        "unknown": unknown,
    }


def _confirm(args: argparse.Namespace, what: str) -> bool:
    """Whether the person at the terminal agrees to ``what`` (``--yes``: agreed beforehand)."""
    if args.yes:
        return True
    if not sys.stdin.isatty():
        raise ClientError(
            f"kcache cache clear would remove {what}: pass --yes to do it (stdin is not a "
            "terminal, so it cannot ask)"
        )
    sys.stderr.write(f"remove {what}? [y/N] ")
    sys.stderr.flush()
    answer = sys.stdin.readline().strip().lower()
    return answer in ("y", "yes")


def _cmd_clear(args: argparse.Namespace) -> int:
    server = _server(args, required=False)
    if server is not None:
        with _closing(server):
            info = server.request("GET", "/v1/cache").json()
            unpinned = int(info["artifacts"]) - int(info["pinned_artifacts"])
            unpinned_bytes = int(info["bytes_used"]) - int(info["pinned_bytes"])
            what = (
                f"every unpinned artifact of the server {server.url} ({unpinned} artifacts, "
                f"{format_size(unpinned_bytes)})"
            )
            if args.dry_run:
                listed = [_listed(e) for e in _server_entries(server) if not e["pinned"]]
                body = {
                    "dry_run": True,
                    "evicted": unpinned,
                    "bytes_freed": unpinned_bytes,
                    "artifacts": listed,
                }
                return _emit(args, body, _removal_text(body))
            if not _confirm(args, what):
                print("kcache: nothing removed", file=sys.stderr)
                return 1
            body = server.request("POST", "/v1/cache/clear").json()
        return _emit(args, body, _removal_text(body))
    tier = _tier(args)
    usage = tier.usage()
    if args.dry_run:
        entries = tier.entries()
        data = {
            "dry_run": True,
            "evicted": usage.entries,
            "bytes_freed": usage.bytes_used,
            "artifacts": [_listed(vars(e)) for e in entries],
        }
        return _emit(args, data, _removal_text(data))
    what = (
        f"every entry of the cache directory {_show(tier.root)} ({usage.entries} artifacts, "
        f"{format_size(usage.bytes_used)})"
    )
    if not _confirm(args, what):
        print("kcache: nothing removed", file=sys.stderr)
        return 1
    removal = tier.clear()
    data = {"evicted": removal.removed, "bytes_freed": removal.bytes_freed}
    return _emit(args, data, _removal_text(data))


def _pinnable(server: Transport) -> list[_Known]:
    """What a pin's prefix may stand for: stored artifacts' recipe keys and pinned keys."""
    known = [k for k in _known_of_entries(_server_entries(server)) if k.kind == "recipe key"]
    pins = server.request("GET", "/v1/pins").json()["pins"]
    return known + [_Known(p["recipe_key"], "recipe key", "pinned") for p in pins]


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
            return _emit(
                args, body, text_table(["recipe key", "group", "size", "by", "pinned"], rows)
            )
        keys = _keys(args.keys, lambda: _pinnable(server), f"the server {server.url}")
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
                    f"--job {_show(args.job)!r}: the server recorded no lookups for this job id, "
                    "so there is nothing to pin (nothing was pinned); `kcache stats --group-by job` "
                    "lists the job ids it has seen"
                )
            body = {k: body[k] + int(job[k]) for k in body}
        if keys:
            request = {"recipe_keys": keys, "group": args.group}
            named = server.request("POST", "/v1/pins", json=request).json()
            body = {k: body[k] + int(named[k]) for k in body}
        group = f" in group {_show(args.group)}" if args.group else ""
        return _emit(
            args, body, f"pinned {body['requested']} recipe keys{group} ({body['pinned']} new pins)"
        )


def _cmd_unpin(args: argparse.Namespace) -> int:
    _unpack(args.keys, "RECIPE_KEY")
    if not args.keys and not args.group:
        raise ClientError("name recipe keys to unpin, or --group G to unpin a whole group")
    server = _server(args, required=True)
    assert server is not None
    with _closing(server):

        def pinned() -> list[_Known]:
            pins = server.request("GET", "/v1/pins").json()["pins"]
            return [_Known(p["recipe_key"], "recipe key", "pinned") for p in pins]

        keys = _keys(args.keys, pinned, f"the pins of {server.url}", "RECIPE_KEY")
        params = [("recipe_key", k) for k in keys] + ([("group", args.group)] if args.group else [])
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
    stats.set_defaults(func=_cmd_stats)
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
        f"any unique start of at least {_MIN_PREFIX} digits, as `kcache cache ls` prints them.",
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
    pin.set_defaults(func=_cmd_pin)
    unpin = subparsers.add_parser("unpin", help="remove pins by recipe key, or a whole --group")
    unpin.add_argument(
        "keys", nargs="*", metavar="RECIPE_KEY", help="pinned recipe keys, or unique starts of them"
    )
    unpin.add_argument("--group", help="unpin every pin of this group (or only KEYs within it)")
    unpin.add_argument("--server", help=server_default)
    unpin.add_argument("--token", help="an admin token (default $KCACHE_TOKEN)")
    unpin.add_argument("--json", action="store_true", help="print JSON")
    unpin.set_defaults(func=_cmd_unpin)

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
