"""What ``kcache cache``, ``kcache pin`` and ``kcache unpin`` print, and what they ask.

One place for their terminal output, whether the numbers come from a node tier
(:mod:`~kcache_client._tier_cache_cli`) or a server (:mod:`~kcache_client._server_cache_cli`):
strings that came from a server or from index files (kernel names) are printed with
control characters escaped, never sent raw to the terminal (:func:`show`); times as a
local date with their age; rows as an aligned table (``kcache prebuild`` prints its own
with :func:`text_table` too); everything as JSON instead with ``--json`` (:func:`emit`).
The report of a removal (:func:`removal_text`) reads alike from both places, dry run or
not, and ``cache clear`` asks on the terminal first (:func:`confirm`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

from kcache.eviction import format_size
from kcache_client.errors import ClientError

__all__ = ["confirm", "emit", "listed", "removal_text", "show", "text_table", "when"]


def show(text: object) -> str:
    """``text`` with control characters escaped (``\\x1b``), for a terminal."""
    value = "-" if text is None else str(text)
    if value.isprintable():
        return value
    return "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in value)


def when(value: float | str | None) -> str:
    """A time (epoch seconds or ISO text) as a local date and how long ago it was."""
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
    """``rows`` under ``headers`` in aligned columns, every cell escaped (:func:`show`)."""
    cells = [[show(h) for h in headers]] + [[show(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def emit(args: argparse.Namespace, data: Any, text: str) -> int:
    """Print ``data`` as JSON with ``--json``, else ``text``; the command's exit status (0)."""
    if args.json:
        json.dump(data, sys.stdout, indent=2, default=str)
        print()
    else:
        print(text)
    return 0


def listed(entry: dict[str, Any]) -> dict[str, Any]:
    """What a dry run names of an artifact it would remove (the same fields everywhere)."""
    return {
        "digest": entry["digest"],
        "recipe_keys": list(entry["recipe_keys"]),
        "kernel": entry.get("kernel") or "",
        "target": entry.get("target") or "",
        "size": int(entry["size"]),
    }


def removal_text(body: dict[str, Any]) -> str:
    """The report of a removal (``cache rm``, ``cache clear``), or of a dry run of one."""
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


def confirm(args: argparse.Namespace, what: str) -> bool:
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
