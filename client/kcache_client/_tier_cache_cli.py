"""``kcache cache`` on a node tier: the user's cache directory, or ``--cache-dir``.

What ``ccache -s``/``-z``/``-C`` and ``hf cache scan`` do for their caches: where the
tier is, its size of the cap, its entries and read-only layers (``cache info``); its hits
and misses since ``cache stats --zero`` (:mod:`kcache_client._tier_stats`); its entries
(``cache ls``); removing some (``cache rm``) or all (``cache clear``). A client installed
without the server distribution answers ``kcache stats`` from here too.

Removal follows what the user named, not what happens to share its bytes: recipes that
compile to the same code share one blob, so removing a recipe key removes that recipe's
entry, and the blob only when no other recipe key names it; a digest removes the artifact
for every recipe (:func:`tier_remove`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kcache.cli_toolkit import readable_cache_dir
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
from kcache_client._key_prefixes import Known, resolve_keys
from kcache_client.errors import ClientError

if TYPE_CHECKING:  # imported when a command runs: `kcache --help` stays instant
    from kcache_client._tier import NodeTier

__all__ = [
    "cmd_stats",
    "layer_rows",
    "open_tier",
    "tier_clear",
    "tier_info",
    "tier_ls",
    "tier_remove",
]


def open_tier(args: argparse.Namespace) -> NodeTier:
    """The node tier the command names (``--cache-dir``, else the settings' cache directory)."""
    from kcache_client._settings import ClientSettings
    from kcache_client._tier import NodeTier

    settings = ClientSettings.from_env(cache_dir=args.cache_dir)
    readable_cache_dir(settings.cache_dir, "--cache-dir", bool(args.cache_dir))
    return NodeTier(settings.cache_dir, max_bytes=settings.cache_max_bytes)


def layer_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
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
        return f"{head}{show(row['source'])}: refused: {show(row['error'])}"
    where = show(row["source"])
    if row["location"] != row["source"]:
        where += f" (unpacked in {show(row['location'])})"
    return f"{head}{where}: {row['entries']} entries, {format_size(row['bytes_used'])}, read-only"


def tier_info(
    tier: NodeTier, args: argparse.Namespace, layers: Sequence[dict[str, Any]] = ()
) -> int:
    """``kcache cache info`` (with the ``layers``), and ``kcache stats`` of a client alone."""
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
            f"location       {show(usage.root)} (writable)",
            f"size           {format_size(usage.bytes_used)} of "
            f"{format_size(cap) if cap else 'no cap'}{share}",
            f"entries        {usage.entries}",
            "pinned         0 (pins are a server's: kcache pin --server)",
            f"oldest use     {when(usage.oldest_use)}",
            f"newest use     {when(usage.newest_use)}",
        ]
        + [_layer_text(i, row) for i, row in enumerate(layers, 1)]
    )
    return emit(args, data, text)


def tier_ls(tier: NodeTier, args: argparse.Namespace) -> int:
    """``kcache cache ls``: the tier's entries, most recently used first."""
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
            when(e.last_used),
        ]
        for e in entries
    ]
    return emit(args, data, text_table(["key", "kernel", "target", "size", "last used"], rows))


def cmd_stats(args: argparse.Namespace) -> int:
    """``kcache cache stats [--zero]``: the node tier's hits and misses since the mark
    (:mod:`kcache_client._tier_stats`), with its size, like ``ccache -s``/``-z``."""
    from kcache_client import _tier_stats

    tier = open_tier(args)
    if args.zero:
        if not tier.standing.writable:
            raise ClientError(
                f"the cache directory {show(tier.root)} is not writable here "
                f"({show(tier.standing.reason)}): its statistics cannot be zeroed"
            )
        at = _tier_stats.zero(tier.root)
        data = {"location": str(tier.root), "zeroed_at": at}
        return emit(args, data, f"statistics of {show(tier.root)} zeroed: counting from now")
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
        since = f"{when(counts.mark)}, the mark (kcache cache stats --zero)"
    elif counts.first is not None:
        since = f"{when(counts.first)}, the first process counted (never zeroed)"
    else:
        since = "- (nothing counted yet; never zeroed)"
    c = counts.counts
    text = "\n".join(
        [
            f"location       {show(usage.root)}",
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
    return emit(args, data, text)


def tier_remove(tier: NodeTier, values: Sequence[str], *, dry_run: bool = False) -> dict[str, Any]:
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
    known = [Known(k, "recipe key", e.kernel) for e in entries for k in e.recipe_keys]
    known += [Known(e.digest, "digest", e.kernel) for e in entries]
    keys = resolve_keys(values, lambda: known, f"the cache directory {tier.root}")
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
        artifacts = [listed(vars(e)) for e in entries if e.digest in blobs]
        return {
            "dry_run": True,
            "recipes_removed": sum(len(g) for g in forgotten.values()),
            "evicted": len(artifacts),
            "bytes_freed": sum(e["size"] for e in artifacts),
            "artifacts": artifacts,
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


def tier_clear(tier: NodeTier, args: argparse.Namespace) -> int:
    """``kcache cache clear``: every entry of the node tier."""
    usage = tier.usage()
    if args.dry_run:
        data = {
            "dry_run": True,
            "evicted": usage.entries,
            "bytes_freed": usage.bytes_used,
            "artifacts": [listed(vars(e)) for e in tier.entries()],
        }
        return emit(args, data, removal_text(data))
    what = (
        f"every entry of the cache directory {show(tier.root)} ({usage.entries} artifacts, "
        f"{format_size(usage.bytes_used)})"
    )
    if not confirm(args, what):
        print("kcache: nothing removed", file=sys.stderr)
        return 1
    removal = tier.clear()
    data = {"evicted": removal.removed, "bytes_freed": removal.bytes_freed}
    return emit(args, data, removal_text(data))
