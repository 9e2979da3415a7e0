"""The notes a node tier keeps beside its kernels: what a server said, what a prefetch found.

Two kinds of small JSON file, each written by atomic rename and not synced (the tier is a
cache): a note that does not parse, or is not of the expected shape, reads as absent.

* ``servers/<hash of the url>.json``: a server's facts (its default toolchain, its include
  sets' digests), so that keys can be computed when the server is out of reach;
* ``index/complete/<manifest digest>.json``: the (recipe key, digest) entries a prefetch of
  that manifest found every one of in the tiers, each verified, so that a later prefetch
  of the node (another rank, the next job) finds it complete by checking that those
  entries are still here, without a request (:mod:`kcache_client._bundle`; whether this
  process may use each entry is the tier's own check:
  :meth:`~kcache_client._tier.NodeTier.present`).

Nothing is written into a tier this process may not write, and a note of another user's
that stands in the way in a shared tier is left as it is.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from kcache.fsutil import UnsafeFileError, atomic_write, read_file_identified
from kcache.index.file import MAX_ENTRY_BYTES
from kcache.keys import require_hex_key, sha256_hex
from kcache.standing import Standing
from kcache_client._disk_full import tolerate_full
from kcache_client._tier_standing import SERVERS_DIR

__all__ = ["load_server_facts", "mark_complete", "marked", "save_server_facts"]


def _facts_path(root: Path, url: str) -> Path:
    return root / SERVERS_DIR / f"{sha256_hex(url)[:32]}.json"


def save_server_facts(root: Path, standing: Standing, url: str, facts: dict[str, Any]) -> None:
    """Remember what a server said (its default toolchain), so keys can be computed offline."""
    if not standing.writable:
        return
    with contextlib.suppress(PermissionError), tolerate_full(root, "saving server facts"):
        atomic_write(  # another user's file in a shared tier: suppressed
            _facts_path(root, url),
            json.dumps({"url": url, "saved_at": time.time(), **facts}).encode(),
            durable=False,  # a cache too: load_server_facts reads garbage as absent
        )


def load_server_facts(root: Path, url: str) -> dict[str, Any] | None:
    """The last facts saved for ``url`` in the tier at ``root``, or None."""
    try:
        data = json.loads(_facts_path(root, url).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _complete_path(root: Path, manifest_digest: str) -> Path:
    name = require_hex_key(manifest_digest, "manifest digest")
    return root / "index" / "complete" / f"{name}.json"


def mark_complete(
    root: Path, standing: Standing, manifest_digest: str, entries: Iterable[tuple[str, str]]
) -> None:
    """Note that the tiers held every recipe key of manifest ``manifest_digest``, as the
    (recipe key, digest) ``entries``, each verified (digest and signature)."""
    if not standing.writable:
        return
    body = {"manifest": manifest_digest, "at": time.time(), "kernels": sorted(entries)}
    with contextlib.suppress(PermissionError), tolerate_full(root, "marking a prefetch"):
        atomic_write(  # another user's marker in a shared tier: suppressed
            _complete_path(root, manifest_digest), json.dumps(body).encode(), durable=False
        )


def marked(root: Path, manifest_digest: str) -> list[tuple[str, str]] | None:
    """The entries :func:`mark_complete` noted for the manifest, or None (no readable marker)."""
    try:
        raw, _ = read_file_identified(
            str(_complete_path(root, manifest_digest)), MAX_ENTRY_BYTES * 16
        )
        body = json.loads(raw)
    except (OSError, UnsafeFileError, ValueError):
        return None
    kernels = body.get("kernels") if isinstance(body, dict) else None
    if not isinstance(kernels, list):
        return None
    out = []
    for item in kernels:
        if not (
            isinstance(item, list) and len(item) == 2 and all(isinstance(v, str) for v in item)
        ):
            return None
        out.append((item[0], item[1]))
    return out
