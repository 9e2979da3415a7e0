"""B9: the client's node-local tier at 1k, 10k and 100k entries: node-tier hit p50 and p99.

A script fills one tier directory per size (no compiles, no server): ``n`` real recipes
(a vector add, one distinct source per entry, four toolchain strings in turn, keyed by
the core's own ``Recipe.key()``) each with a synthetic blob of its own (4 KB, the size of
a small cubin; its ``ArtifactMeta`` names the bytes' sha256), published through
``NodeTier.publish`` as a download would be, from ``--workers`` processes at once as the
ranks of a node do, and flushed (``os.sync``) so that no writeback of the fill lands in
the timings. Then, for 1,000 keys sampled at random from the tier, each asked once per
round, in a new random order each round:

- ``tier_hit``: ``KernelCache(...).get(recipe)``, a fresh cache per round (no server,
  no audit events), so the process memory never answers and every call is what a new
  process sees: the alias read and parsed, the blob read and its digest verified, the
  access stamp written. Each answer's ``origin`` (``node``) and digest are checked,
  outside the timing. The recipes are keyed before timing (their key is memoised on
  the object), so the figure is the tier and ``get``, not hashing the source;
- ``tier_lookup``: ``NodeTier.lookup(key)`` alone, a fresh ``NodeTier`` per round.

Sizes and the two figures are interleaved within each round (a new random order each
round); each figure is the median over rounds of that round's p50 (and p99), and its
ratio is against the same figure at the smallest size in the same run.

The tiers go to ``--dir``, by default ``/dev/shm`` (a tmpfs): the fill creates four
files per entry, which on the shared virtual disk here took 1 to 7 minutes for 100k
entries (and as long again to delete), and file creation is not what is measured. A
tier on a disk filesystem (``--dir /tmp``) is read from the page cache and the dentry
cache all the same (its files were just written), so this is the cost of a big tier's
directories and of reading it, not of the disk. Goal (issue 13 item 5): p50 at 100k
<= 1.5 x the p50 at 1k.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _harness
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support
from _harness import emit
from kcache_client import ClientSettings, KernelCache
from kcache_client._tier import NodeTier

from kcache import Recipe
from kcache.artifact import ArtifactMeta
from tests.support import VECTOR_ADD

TARGET = "sm_90"
TOOLCHAINS = ("nvrtc-12.8.93", "nvrtc-12.9.86", "nvrtc-13.0.48", "nvrtc-13.1.80")
BLOB_BYTES = 4096
FILL_CHUNK = 1000


@dataclass(frozen=True)
class Entry:
    """One filled entry: the recipe a caller would ask for, its key and blob digest."""

    recipe: Recipe
    key: str
    digest: str


def make_entry(i: int) -> tuple[Entry, ArtifactMeta, bytes]:
    """Entry ``i``: a distinct source, its blob (distinct bytes) and the metadata naming them."""
    recipe = Recipe(
        source=f"// entry {i}\n{VECTOR_ADD}",
        target=TARGET,
        toolchain=TOOLCHAINS[i % len(TOOLCHAINS)],
    )
    head = b"\x7fELF bench blob %d\n" % i
    data = head + bytes(BLOB_BYTES - len(head))
    digest = hashlib.sha256(data).hexdigest()
    meta = ArtifactMeta(
        digest=digest,
        size=len(data),
        kind="cubin",
        target=TARGET,
        toolchain=recipe.toolchain or "",
        kernel="add",
        compile_seconds=0.5,
    )
    return Entry(recipe, recipe.key(), digest), meta, data


def publish_range(root: Path, first: int, stop: int) -> None:
    """Publish entries ``first`` to ``stop - 1`` into the tier at ``root`` (one fill worker)."""
    tier = NodeTier(root, max_bytes=0)  # unbounded: no eviction pass while filling
    for i in range(first, stop):
        entry, meta, data = make_entry(i)
        tier.publish(entry.key, entry.recipe.base_key(), meta, data)


def fill(root: Path, n: int, workers: int) -> float:
    """Publish ``n`` entries into the tier at ``root`` from ``workers`` processes; seconds taken.

    Flushed to disk before it returns, not counted in the seconds.

    Several processes publishing into one tier is what the ranks of a node do.
    """
    NodeTier(root, max_bytes=0)  # the directories, before the workers race to make them
    starts = range(0, n, FILL_CHUNK)
    stops = [min(n, s + FILL_CHUNK) for s in starts]
    started = time.perf_counter()
    with ProcessPoolExecutor(workers) as pool:
        list(pool.map(publish_range, [root] * len(starts), starts, stops))
    took = time.perf_counter() - started
    os.sync()
    return took


def settings_for(root: Path) -> ClientSettings:
    """A client of the tier at ``root`` alone: no server, no events, no local compiles."""
    return ClientSettings(
        url=None, cache_dir=root, cache_max_bytes=0, send_events=False, local_compile=False
    )


def timed_us(call: Callable[[Entry], None], sample: list[Entry]) -> list[float]:
    """Microseconds of ``call(entry)`` for each entry of ``sample``, one after another."""
    times = []
    for entry in sample:
        started = time.perf_counter()
        call(entry)
        times.append((time.perf_counter() - started) * 1e6)
    return times


def one_round(kind: str, root: Path, sample: list[Entry]) -> list[float]:
    """One pass over ``sample`` by a fresh ``KernelCache`` (``tier_hit``) or ``NodeTier``."""
    if kind == "tier_hit":
        cache = KernelCache(settings=settings_for(root))
        answers: list[tuple[str, str]] = []

        def get(entry: Entry) -> None:
            art = cache.get(entry.recipe)
            answers.append((art.origin, art.digest))

        try:
            times = timed_us(get, sample)
        finally:
            cache.close()
        expected = [("node", e.digest) for e in sample]
        assert answers == expected, "a get() was not answered by the node tier"
        return times
    tier = NodeTier(root, max_bytes=0)
    found: list[str | None] = []

    def lookup(entry: Entry) -> None:
        hit = tier.lookup(entry.key)
        found.append(None if hit is None else hit[0].digest)

    times = timed_us(lookup, sample)
    assert found == [e.digest for e in sample], "a lookup missed"
    return times


def p99(times: list[float]) -> float:
    return statistics.quantiles(times, n=100)[98]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,10000,100000", help="comma-separated entries")
    parser.add_argument("--sample", type=int, default=1000, help="keys asked per round and size")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--workers", type=int, default=2, help="fill processes")
    parser.add_argument(
        "--dir",
        default="/dev/shm" if os.path.isdir("/dev/shm") else None,
        help="where the tiers go (default /dev/shm: a tmpfs, for the fill's sake)",
    )
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    kinds = ("tier_hit", "tier_lookup")
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="kcache-b9-tier-", dir=args.dir) as tmp:
        roots, samples, fill_s = {}, {}, {}
        for n in sizes:
            roots[n] = Path(tmp) / f"tier-{n}"
            fill_s[n] = fill(roots[n], n, args.workers)
            picked = random.Random(n).sample(range(n), min(args.sample, n))
            samples[n] = [make_entry(i)[0] for i in picked]
        load_after_fill = os.getloadavg()
        rng = random.Random(9)
        p50s: dict[tuple[str, int], list[float]] = {(k, n): [] for k in kinds for n in sizes}
        p99s: dict[tuple[str, int], list[float]] = {(k, n): [] for k in kinds for n in sizes}
        # Round 0 warms every path (imports, the page cache's dentries) and is not counted.
        for counted in [False] + [True] * args.rounds:
            order = [(k, n) for k in kinds for n in sizes]
            rng.shuffle(order)
            for kind, n in order:
                sample = samples[n][:]
                rng.shuffle(sample)
                times = one_round(kind, roots[n], sample)
                if counted:
                    p50s[kind, n].append(statistics.median(times))
                    p99s[kind, n].append(p99(times))
    load_after = os.getloadavg()
    load = {
        "load_before": round(load_before[0], 2),
        "load_after_fill": round(load_after_fill[0], 2),
        "load_after": round(load_after[0], 2),
    }
    for kind in kinds:
        base50 = statistics.median(p50s[kind, sizes[0]])
        base99 = statistics.median(p99s[kind, sizes[0]])
        for n in sizes:
            common = {
                "entries": n,
                "anchor_entries": sizes[0],
                "sample": len(samples[n]),
                "rounds": args.rounds,
                "fill_s": round(fill_s[n], 1),
                "fill_workers": args.workers,
                "tier_dir": args.dir or tempfile.gettempdir(),
                **load,
            }
            emit(
                f"B9.{kind}.p50",
                statistics.median(p50s[kind, n]),
                base50,
                "us",
                goal="<= 1.5 at 100k",
                **common,
            )
            emit(
                f"B9.{kind}.p99",
                statistics.median(p99s[kind, n]),
                base99,
                "us",
                **common,
            )


if __name__ == "__main__":
    main()
