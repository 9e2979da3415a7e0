"""``kcache cache stats [--zero]``: a node tier's hits and misses since a mark, like ``ccache -s``.

Before (issue 45) a node tier had no statistics but its size. Now every process writes its
counts once, when it ends, into a small file of its own under ``stats/``, which the command
sums; ``--zero`` sets a mark the sums count from. Nothing is written on the hit path (the
files appear only when a process ends or flushes). Real processes, a real NVRTC, and for a
shared (1777) tier a second real uid.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from kcache_client import ClientSettings, KernelCache
from kcache_client import _tier_stats as tier_stats

from kcache import Recipe
from tests.cli_harness import kcache, user_env
from tests.support import VECTOR_ADD, unique


def _stats(env: dict[str, str], cwd: Path) -> dict[str, Any]:
    result = kcache("cache", "stats", "--json", env=env, cwd=cwd)
    assert result.returncode == 0, result.stderr
    body: dict[str, Any] = json.loads(result.stdout)
    return body


def _ok(*args: str, env: dict[str, str], cwd: Path) -> str:
    result = kcache(*args, env=env, cwd=cwd)
    assert result.returncode == 0, (args, result.stderr)
    return result.stdout


def test_hits_misses_and_the_mark_across_processes(tmp_path: Path) -> None:
    env = user_env(tmp_path)
    tag = unique("ts").replace("-", "_")
    (tmp_path / "k.cu").write_text(VECTOR_ADD.replace("add(", f"k_{tag}("))
    (tmp_path / "cache").mkdir()
    empty = _stats(env, tmp_path)
    assert (empty["hits"], empty["misses"], empty["processes"], empty["since"]) == (0, 0, 0, None)

    for target in ("sm_80", "sm_90"):  # two misses, compiled here
        _ok("get", "k.cu", "--target", target, env=env, cwd=tmp_path)
    for _ in range(3):  # three processes, each a node-tier hit
        got = _ok("get", "k.cu", "--target", "sm_80", env=env, cwd=tmp_path)
        assert json.loads(got)["status"] == "local_hit"
    body = _stats(env, tmp_path)
    assert (body["hits"], body["misses"]) == (3, 2)
    assert (body["node_hits"], body["local_compiles"], body["server_fetches"]) == (3, 2, 0)
    assert body["hit_rate"] == pytest.approx(0.6)
    assert body["processes"] == 5 and body["zeroed_at"] is None and body["since"] is not None
    assert body["entries"] == 2 and body["bytes_used"] > 0
    # Ended processes' files are folded into one total by the next process that ends.
    names = [p.name for p in _written(tmp_path / "cache")]
    assert len(names) == 2 and names[0].startswith("p.") and names[1].startswith("total."), names
    text = _ok("cache", "stats", env=env, cwd=tmp_path)
    assert "hits           3 " in text and "misses         2 (0 from the server, 2 compiled" in text
    assert "hit rate       60.0 %" in text and "never zeroed" in text and "entries        2" in text

    zeroed = json.loads(_ok("cache", "stats", "--zero", "--json", env=env, cwd=tmp_path))
    assert zeroed["zeroed_at"] is not None
    after = _stats(env, tmp_path)
    assert (after["hits"], after["misses"], after["processes"]) == (0, 0, 0)
    assert after["zeroed_at"] == pytest.approx(zeroed["zeroed_at"])
    assert after["entries"] == 2  # the mark zeroes counts, never entries
    # The ended processes' files went with the mark: only the mark is left.
    left = [p.name for p in _written(tmp_path / "cache")]
    assert left == [f"zero.{os.geteuid()}.json"]
    _ok("get", "k.cu", "--target", "sm_90", env=env, cwd=tmp_path)
    again = _stats(env, tmp_path)
    assert (again["hits"], again["misses"], again["processes"]) == (1, 0, 1)
    _ok("get", "k.cu", "--target", "sm_80", env=env, cwd=tmp_path)  # folds the one before
    folded = _stats(env, tmp_path)
    assert (folded["hits"], folded["misses"], folded["processes"]) == (2, 0, 2)
    assert sum(p.name.startswith("p.") for p in _written(tmp_path / "cache")) == 1
    assert "the mark (kcache cache stats --zero)" in _ok("cache", "stats", env=env, cwd=tmp_path)


def _written(root: Path) -> list[Path]:
    """The counts' files under ``root/stats`` (not the hidden lock files)."""
    return sorted(p for p in (root / "stats").iterdir() if not p.name.startswith("."))


def _recipe(tag: str) -> Recipe:
    return Recipe(source=VECTOR_ADD.replace("add(", f"m_{tag}("), target="sm_80")


def test_counts_stay_in_memory_until_the_process_writes_them(tmp_path: Path) -> None:
    """A hit writes nothing; a flush writes one file; a forked child counts only its own."""
    root = tmp_path / "tier"
    settings = ClientSettings.from_env(url="", send_events=False, local_compile=True)
    recipe = _recipe(unique("mem").replace("-", "_"))
    with KernelCache(cache_dir=root, settings=settings) as first:
        first.get(recipe)  # a miss, compiled here
    with KernelCache(cache_dir=root, settings=settings) as cache:
        for _ in range(3):
            cache.get(recipe)  # a node-tier hit, then two memory hits
        assert not (root / "stats").exists()  # nothing written on the way
        tier_stats.flush()
        (mine,) = _written(root)
        assert mine.name.split(".")[2] == str(os.getpid())
        assert stat.S_IMODE(mine.stat().st_mode) == 0o644
        counts = tier_stats.read(root).counts
        assert (counts["local_compiles"], counts["node_hits"], counts["memory_hits"]) == (1, 1, 2)

        pid = os.fork()
        if pid == 0:  # the child: one more hit, its own file, then out without atexit
            try:
                cache.get(recipe)
                tier_stats.flush()
            finally:
                os._exit(0)
        assert os.waitpid(pid, 0)[1] == 0
    files = _written(root)
    assert len(files) == 2
    child = json.loads(next(f for f in files if f != mine).read_text())
    assert child["pid"] == pid and child["counts"]["memory_hits"] == 1
    assert child["counts"]["node_hits"] == 0  # the parent's counts before the fork are not its
    totals = tier_stats.read(root)
    assert totals.processes == 2 and totals.counts["memory_hits"] == 3
    tier_stats.flush()  # written again: replaced, not added
    assert tier_stats.read(root).counts == totals.counts


_OTHER_USER = """
import json, os, sys
from kcache_client._stats import CacheStats
from kcache_client._tier import NodeTier
from kcache_client import _tier_stats
root, uid = sys.argv[1], int(sys.argv[2])
os.setgid(uid)
os.setuid(uid)
tier = NodeTier(root)
_tier_stats.track(tier, CacheStats(node_hits=5, server_fetches=1))
_tier_stats.flush()
if sys.argv[3:] == ["zero"]:
    _tier_stats.zero(root)
print(json.dumps(tier.standing.kind))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="another uid needs root to start as (CI: root)")
def test_a_shared_tier_sums_every_users_files(tmp_path: Path) -> None:
    top = Path(tempfile.mkdtemp(prefix="kcache-shared-stats-"))  # pytest's tmp is 0700
    try:
        _shared_tier(top, tmp_path)
    finally:
        shutil.rmtree(top, ignore_errors=True)


def _shared_tier(top: Path, tmp_path: Path) -> None:
    os.chmod(top, 0o755)
    shared = top / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    with NodeTierCounts(shared) as counts:
        counts.node_hits = 2
    mode = stat.S_IMODE((shared / "stats").stat().st_mode)
    assert mode == 0o1777  # the root's mode: every user can add their file

    def other(uid: int, *extra: str) -> None:
        done = subprocess.run(
            [sys.executable, "-c", _OTHER_USER, str(shared), str(uid), *extra],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "HOME": str(top)},
            check=False,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert json.loads(done.stdout) == "shared"

    other(65534)
    owners = {p.stat().st_uid for p in (shared / "stats").iterdir()}
    assert owners == {0, 65534}
    totals = tier_stats.read(shared)
    assert totals.processes == 2
    assert (totals.hits, totals.misses) == (7, 1)
    other(65533, "zero")  # another user's mark counts for everyone; it removes no one's file
    assert tier_stats.read(shared).hits == 0
    assert {p.stat().st_uid for p in (shared / "stats").iterdir()} == {0, 65533, 65534}


class NodeTierCounts:
    """Counts of this process into ``root`` as a cache's would be, written on leaving."""

    def __init__(self, root: Path) -> None:
        from kcache_client._stats import CacheStats
        from kcache_client._tier import NodeTier

        self.stats = CacheStats()
        tier_stats.track(NodeTier(root), self.stats)

    def __enter__(self) -> Any:
        return self.stats

    def __exit__(self, *exc: object) -> None:
        tier_stats.flush()


_ACROSS = """
import sys
from kcache import Recipe
from kcache_client import ClientSettings, KernelCache
from kcache_client import _tier_stats
root, wait, *sources = sys.argv[1:]
settings = ClientSettings.from_env(url="", send_events=False, local_compile=True)
cache = KernelCache(cache_dir=root, settings=settings)
for n, source in enumerate(sources):
    if n == 1 and wait == "wait":
        _tier_stats.flush()
        print("flushed", flush=True)
        sys.stdin.readline()  # the mark is set meanwhile
    cache.get(Recipe(source=open(source).read(), target="sm_80"))
"""


def test_a_process_running_across_the_mark_counts_what_came_after(tmp_path: Path) -> None:
    env = user_env(tmp_path)
    tag = unique("across").replace("-", "_")
    root = tmp_path / "cache"
    sources = []
    for name in ("a", "b", "c"):
        (tmp_path / f"{name}.cu").write_text(VECTOR_ADD.replace("add(", f"{name}_{tag}("))
        sources.append(str(tmp_path / f"{name}.cu"))

    def run(wait: str, *chosen: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-c", _ACROSS, str(root), wait, *chosen],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )

    with run("no", *sources) as compiling:  # three misses, compiled here
        assert compiling.wait(timeout=300) == 0
    with run("wait", sources[0], sources[1]) as running:
        assert running.stdout is not None and running.stdin is not None
        assert running.stdout.readline().strip() == "flushed"  # its hit of a, before the mark
        _ok("cache", "stats", "--zero", env=env, cwd=tmp_path)
        running.stdin.write("\n")
        running.stdin.close()
        assert running.wait(timeout=120) == 0
    after = _stats(env, tmp_path)
    assert (after["hits"], after["misses"]) == (1, 0)  # b, after the mark; a was before it
    with run("no", sources[2]) as last:  # a hit of c; folds the one that ended
        assert last.wait(timeout=120) == 0
    folded = _stats(env, tmp_path)
    assert (folded["hits"], folded["misses"], folded["processes"]) == (2, 0, 2)
    assert [p.name.split(".")[0] for p in _written(root)] == ["p", "total", "zero"]
