"""One rank of a fan-out test (issue 48): a real process in a gloo (CPU) torch.distributed job.

    python fanout_worker.py CONFIG.json RANK

The config gives the world size, the port of the store the test hosts (as torchrun's
agent does), the server URL, each rank's host name and cache directory (a node is a
host and its tier directory), the manifest, the warmup's timeout and ``chunk`` (the
fan-out's piece size, small so a pack is many pieces). The rank makes one
``warmup([], manifest=...)`` and writes ``<out>/<rank>.json``: whether every kernel of
the manifest is in its node tier with the manifest's digest and bytes that hash to it,
its cache's bundle and fan-out counters, or the WarmupError it raised.

``fault`` (``{"kind", "rank", "after"}``) makes rank ``rank`` misbehave in the fan-out:
``kill`` (SIGKILL itself after ``after`` pieces of the broadcast), ``corrupt`` (the
source flips a byte of the bundle after its request, so a piece arrives damaged),
``forge`` (the source re-signs every entry and the trailer with a key of its own),
``corrupt_foreign`` (the source flips a byte of the first foreign group it forwards).
``foreign_right`` says whether every foreign group of the manifest is in the node tier,
whole (each file's name, digest and size the manifest's).
``api``: ``"prefetch"`` makes the rank call ``prefetch(manifest, group)`` and then
``warmup([])`` instead.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any, BinaryIO

import torch.distributed as dist
from kcache_client import ClientSettings, KernelCache, RetryPolicy, WarmupError, _fanout
from kcache_client._foreign_groups import unpack_group

from kcache.bundle_format import BundleEntry, BundleReader, end_line, entry_head, header_line
from kcache.job_manifest import JobManifest
from kcache.signing import BundleDigest, SigningKey


def install_fault(fault: dict[str, Any], rank: int) -> None:
    if fault.get("rank") != rank:
        return
    kind = fault["kind"]
    if kind == "kill":
        pieces = _fanout._pieces

        def dying(size: int) -> Iterator[int]:
            for n, piece in enumerate(pieces(size)):
                if n == fault["after"]:
                    os.kill(os.getpid(), signal.SIGKILL)
                yield piece

        _fanout._pieces = dying  # type: ignore[assignment]
        return
    fetch = _fanout._Exchange._fetch

    def tampered(self: Any, spool: BinaryIO, most: int) -> int:
        size = fetch(self, spool, most)
        spool.seek(0)
        whole = spool.read()
        if kind == "corrupt":
            middle = len(whole) // 2
            whole = whole[:middle] + bytes([whole[middle] ^ 0xFF]) + whole[middle + 1 :]
        elif kind == "corrupt_foreign":  # the first group's first byte, after two lines
            at = whole.index(b"\n", whole.index(b"\n") + 1) + 1
            whole = whole[:at] + bytes([whole[at] ^ 0xFF]) + whole[at + 1 :]
        else:
            whole = forged(whole)
        spool.seek(0)
        spool.truncate()
        spool.write(whole)
        spool.flush()
        return len(whole) if size >= 0 else size

    _fanout._Exchange._fetch = tampered  # type: ignore[method-assign]


def forged(whole: bytes) -> bytes:
    """The bundle with every entry and its trailer signed by a key nobody trusts."""
    key = SigningKey.generate()
    signed = BundleDigest()
    out = [header_line()]
    count = 0
    for item in BundleReader([whole], max_entry_bytes=1 << 30, where="forge"):
        if isinstance(item, BundleEntry):
            out += [entry_head(item.recipe_key, item.meta, key.sign(item.recipe_key, item.meta))]
            out += [item.data, b"\n"]
            signed.add(item.recipe_key, item.meta)
            count += 1
    out.append(end_line(count, 0, key.sign_bundle(signed)))
    return b"".join(out)


def main() -> None:
    cfg = json.loads(Path(sys.argv[1]).read_text())
    rank = int(sys.argv[2])
    timeout = timedelta(seconds=cfg["timeout"] * 2)
    store = dist.TCPStore("127.0.0.1", cfg["port"], cfg["world"], is_master=False, timeout=timeout)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=cfg["world"], timeout=timeout
    )
    _fanout.CHUNK = cfg.get("chunk", _fanout.CHUNK)
    install_fault(cfg.get("fault") or {}, rank)
    manifest = JobManifest.from_dict(cfg["manifest"])
    settings = ClientSettings.from_env(
        retry=RetryPolicy(**cfg["retry"]),
        job_id="fanout-test",
        host=cfg["hosts"][rank],
        send_events=False,
    )
    cache = KernelCache(cfg["url"], cache_dir=cfg["cache_dirs"][rank], settings=settings)
    out: dict[str, Any] = {"rank": rank}
    started = time.monotonic()
    try:
        if cfg.get("api") == "prefetch":  # KernelCache.prefetch with the group, then a warmup
            cache.prefetch(manifest, dist.group.WORLD, timeout=cfg["timeout"])
            cache.warmup([], None, timeout=cfg["timeout"])
        else:
            cache.warmup([], None, timeout=cfg["timeout"], manifest=manifest)
        right = []
        for kernel in manifest.kernels:
            found = cache.tier.lookup_signed(kernel.recipe_key)
            right.append(
                found is not None
                and found[0].digest == kernel.digest
                and hashlib.sha256(found[1]).hexdigest() == kernel.digest
            )
        out.update(ok=True, right=all(right) and len(right) == len(manifest))
        whole = []
        for group in manifest.foreign:
            hit = cache.tier.lookup(group.binding_key)
            files = unpack_group(hit[1]) if hit is not None else None
            whole.append(
                files is not None
                and {n: (hashlib.sha256(d).hexdigest(), len(d)) for n, d in files.items()}
                == {f.name: (f.digest, f.size) for f in group.files}
            )
        out["foreign_right"] = all(whole)
    except WarmupError as exc:
        out.update(
            ok=False,
            error=type(exc).__name__,
            timeout_error=isinstance(exc, TimeoutError),
            message=str(exc),
            missing_ranks=exc.missing_ranks,
        )
    out["seconds"] = time.monotonic() - started
    stats = cache.stats
    out.update(
        bundle_requests=stats.bundle_requests,
        fanout_sent=stats.fanout_sent,
        fanout_received=stats.fanout_received,
        fanout_failures=stats.fanout_failures,
    )
    Path(cfg["out"], f"{rank}.json").write_text(json.dumps(out))
    cache.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
