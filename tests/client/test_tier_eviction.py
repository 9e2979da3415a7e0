"""The node tier's cap (issue 12): eight processes share one small tier while it evicts.

Every process fetches kernels from a real server through ``KernelCache.get`` with its
memory tier emptied before each get, so each get reads the shared tier (or downloads
into it, evicting the least recently used); every answer is checked against the
digest the server gave. Kernels carry 48 KiB of data (about 53 KB cubins), so 16 of
them overflow a 256 KiB tier many times over.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from client_harness import KcacheServer
from kcache_client import ClientSettings, KernelCache, NodeTier

from kcache import Recipe
from kcache.eviction import parse_size
from tests.support import QUIET

CAP = 256 << 10
PAD = 48 << 10
PROCESSES = 8
GETS = 60

# One process of the test: JSON config path in argv[1], a JSON summary on stdout.
WORKER = r"""
import hashlib, json, random, sys
from kcache import Recipe
from kcache_client import ClientSettings, KernelCache

config = json.load(open(sys.argv[1]))
rng = random.Random(int(sys.argv[2]))
items = [(Recipe.from_dict(r), d) for r, d in config["recipes"]]
quiet = ClientSettings.from_env(send_events=False)
cache = KernelCache(config["url"], cache_dir=config["tier"], settings=quiet)
summary = {"gets": 0, "bad": [], "node_hits": 0, "server_fetches": 0}
for _ in range(config["gets"]):
    recipe, digest = rng.choice(items)
    cache.forget_memory()  # read the shared tier, not this process's memory
    art = cache.get(recipe, compile=False)
    summary["gets"] += 1
    if art.digest != digest or hashlib.sha256(art.data).hexdigest() != digest:
        summary["bad"].append(digest)
summary["node_hits"] = cache.stats.node_hits
summary["server_fetches"] = cache.stats.server_fetches
cache.close()
print(json.dumps(summary))
"""


def padded(tag: str) -> Recipe:
    """A vector add carrying ``PAD`` bytes of initialised data derived from ``tag``."""
    seed = hashlib.sha256(tag.encode()).hexdigest()
    text = (seed * (PAD // len(seed) + 1))[:PAD]
    return Recipe(
        source=(
            f'extern "C" __device__ const char kc_pad[{PAD + 1}] = "{text}";\n'
            'extern "C" __global__ void vadd(float* out, const float* a, int n) {\n'
            "  int i = blockIdx.x * blockDim.x + threadIdx.x;\n"
            "  if (i < n) out[i] = a[i] + kc_pad[i % 7];\n"
            "}\n"
        ),
        target="sm_80",
    )


def test_eight_processes_share_a_small_tier_while_it_evicts(
    kserver: KcacheServer, tmp_path: Path
) -> None:
    recipes = [padded(f"{tmp_path.name}-{i}") for i in range(16)]
    with KernelCache(kserver.url, cache_dir=tmp_path / "compiler", settings=QUIET) as cache:
        items: list[tuple[dict[str, Any], str]] = []
        for recipe in recipes:
            art = cache.get(recipe)
            items.append((recipe.to_dict(), art.digest))
    tier_dir = tmp_path / "tier"
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps({"url": kserver.url, "tier": str(tier_dir), "recipes": items, "gets": GETS})
    )
    env = {**os.environ, "KCACHE_CACHE_MAX_BYTES": f"{CAP // 1024}KiB"}
    env.pop("KCACHE_URL", None)
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, str(config), str(seed)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed in range(PROCESSES)
    ]
    summaries = []
    for worker in workers:
        out, err = worker.communicate(timeout=120)
        assert worker.returncode == 0, err[-3000:]
        summaries.append(json.loads(out.strip().splitlines()[-1]))

    # Every get of every process returned the right bytes, from the tier or the server.
    assert [s["bad"] for s in summaries] == [[]] * PROCESSES
    assert sum(s["gets"] for s in summaries) == PROCESSES * GETS
    assert sum(s["node_hits"] for s in summaries) > 0  # reads of the shared tier happened ...
    # ... and so did evictions: far more was downloaded than the tier holds.
    assert sum(s["server_fetches"] for s in summaries) * 50_000 > 3 * CAP

    tier = NodeTier(tier_dir, max_bytes=parse_size(env["KCACHE_CACHE_MAX_BYTES"]))
    tier.evict()  # whatever the last publishes added
    usage = tier.usage()
    assert usage.bytes_used <= tier.marks.high_bytes and usage.entries >= 1
    # Nothing torn or half-evicted: every blob hashes to its name, every record has its blob.
    for digest in tier.store.digests():
        assert hashlib.sha256(tier.store.path(digest).read_bytes()).hexdigest() == digest
    records = list(tier.index.files("artifacts"))
    assert records  # the check below looks at something
    for record in records:
        assert tier.store.has(record.stem), record.stem
    assert not (tier_dir / "quarantine").exists() or not any((tier_dir / "quarantine").iterdir())


def test_lru_order_rm_and_clear(tmp_path: Path, kserver: KcacheServer) -> None:
    """The least recently *read* entry goes first; rm and clear remove what they name."""
    recipes = [padded(f"{tmp_path.name}-lru-{i}") for i in range(5)]
    with KernelCache(kserver.url, cache_dir=tmp_path / "sizes", settings=QUIET) as sizer:
        size = max(sizer.get(r).metadata.size for r in recipes)
    cap = int(4.5 * size / 0.9)  # four fit under the high-water mark, five do not
    capped = ClientSettings.from_env(cache_max_bytes=cap, send_events=False)
    with KernelCache(kserver.url, cache_dir=tmp_path / "tier", settings=capped) as cache:
        arts = [cache.get(recipe) for recipe in recipes[:4]]
        assert cache.tier.usage().entries == 4
        # Used a minute ago, in order (a coarse filesystem clock gives four quick
        # publishes one timestamp, and the order of equals is not LRU's to keep).
        for age, art in zip((64, 63, 62, 61), arts, strict=True):
            stamp = time.time() - age
            os.utime(cache.tier.index._path("artifacts", art.digest), (stamp, stamp))
        # Read the first one again, from the tier: it becomes the most recently used.
        cache.forget_memory()
        assert cache.get(recipes[0]).digest == arts[0].digest
        assert cache.stats.node_hits == 1
        cache.get(recipes[4])  # past the high-water mark: the least recently read goes
        kept = {e.digest for e in cache.tier.entries()}
        assert arts[0].digest in kept and arts[1].digest not in kept
        assert cache.tier.usage().bytes_used <= cache.tier.marks.high_bytes
        # An evicted entry is fetched again (a plain miss in the tier), with the right bytes.
        cache.forget_memory()
        again = cache.get(recipes[1])
        assert hashlib.sha256(again.data).hexdigest() == arts[1].digest
        # rm by recipe key (an unknown key is reported), then clear.
        removal = cache.tier.remove([arts[0].recipe_key, "0" * 64])
        assert removal.removed == 1 and removal.unknown == ("0" * 64,)
        assert cache.tier.lookup(arts[0].recipe_key) is None
        left = cache.tier.usage().entries
        assert left >= 1 and cache.tier.clear().removed == left
        assert cache.tier.usage().entries == 0


def test_cache_commands_on_a_node_tier(tmp_path: Path, kserver: KcacheServer) -> None:
    """`kcache cache info|ls|rm|clear` on a cache directory, as a user sees them."""
    tier_dir = tmp_path / "tier"
    with KernelCache(kserver.url, cache_dir=tier_dir, settings=QUIET) as cache:
        arts = [cache.get(padded(f"{tmp_path.name}-cli-{i}")) for i in range(2)]
    kcache = [sys.executable, "-m", "kcache.cli", "cache"]
    env = {**os.environ, "KCACHE_CACHE_MAX_BYTES": "1MiB"}
    env.pop("KCACHE_URL", None)

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*kcache, *args, "--cache-dir", str(tier_dir)], capture_output=True, text=True, env=env
        )

    info = json.loads(run("info", "--json").stdout)
    assert info["entries"] == 2 and info["bytes_cap"] == 1 << 20
    assert info["bytes_used"] == sum(a.metadata.size for a in arts)
    ls = run("ls")
    assert ls.returncode == 0 and "vadd" in ls.stdout and arts[0].recipe_key[:16] in ls.stdout
    rm = run("rm", arts[0].recipe_key)
    assert rm.returncode == 0 and "removed 1" in rm.stdout
    assert run("rm", arts[0].recipe_key).returncode == 1  # gone already: reported, not silent
    cleared = run("clear", "--yes")
    assert cleared.returncode == 0 and "removed 1" in cleared.stdout
    assert json.loads(run("info", "--json").stdout)["entries"] == 0
