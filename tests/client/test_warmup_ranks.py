"""Multi-rank warmup with real processes: torch.distributed on gloo (CPU) against a real server.

ARCHITECTURE section 8: the union of all ranks' recipes is resolved once by the leader,
its broadcast is the barrier, every rank ends with the same artifacts, and a failing
leader makes every rank raise the same error within the timeout.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch.distributed")

from client_harness import Proxy, free_port, kernels

from kcache import Recipe

WORKER = Path(__file__).with_name("warmup_worker.py")
RETRY = {"attempts": 3, "base_s": 0.05, "cap_s": 0.2, "budget_s": 2.0}


def run_ranks(
    tmp_path: Path,
    url: str,
    recipes: list[list[Recipe]],
    *,
    targets: list[str],
    cache_dirs: list[str] | None = None,
    timeout: float = 60.0,
    **extra: Any,
) -> list[dict[str, Any]]:
    """Start one process per rank, wait (bounded), return each rank's JSON report."""
    world = len(recipes)
    out = tmp_path / "ranks"
    out.mkdir()
    cfg = {
        "world": world,
        "port": free_port(),
        "url": url,
        "recipes": [[r.to_dict() for r in rs] for rs in recipes],
        "targets": targets,
        "cache_dirs": cache_dirs or [str(tmp_path / "node")] * world,
        "timeout": timeout,
        "retry": RETRY,
        "out": str(out),
        **extra,
    }
    cfg_path = tmp_path / "config.json"
    cfg_path.write_text(json.dumps(cfg))
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(cfg_path), str(rank)], stderr=subprocess.PIPE
        )
        for rank in range(world)
    ]
    deadline = time.monotonic() + timeout + 60
    try:
        for proc in procs:
            proc.wait(max(1.0, deadline - time.monotonic()))
    finally:
        for proc in procs:
            if proc.poll() is None:  # a hung rank fails the test instead of hanging it
                proc.kill()
    errors = [p.stderr.read().decode(errors="replace")[-3000:] if p.stderr else "" for p in procs]
    for p in procs:
        if p.stderr:
            p.stderr.close()
    reports = []
    for rank in range(world):
        path = out / f"{rank}.json"
        assert path.exists(), (
            f"rank {rank} wrote no report (exit {procs[rank].returncode}):\n{errors[rank]}"
        )
        reports.append(json.loads(path.read_text()))
    return reports


@pytest.mark.slow
def test_eight_ranks_twelve_recipes_compile_once_and_download_once(
    proxy: Proxy, tmp_path: Path
) -> None:
    recipes = kernels(12, "eight")
    # Every rank asks for an overlapping share: ranks r and r+4 ask for the same six.
    per_rank = [[recipes[(r % 4 * 3 + j) % 12] for j in range(6)] for r in range(8)]
    reports = run_ranks(tmp_path, proxy.url, per_rank, targets=["sm_80"] * 8)
    assert all(r["ok"] for r in reports), reports
    assert [r["leader"] for r in reports] == [True] + [False] * 7
    assert {r["union"] for r in reports} == {12}
    assert all(r["verified"] for r in reports)
    # Each recipe compiled on the server exactly once: one batch pass, and "compiled" for all 12.
    batches = [s.json() for s in proxy.seen if s.path == "/v1/resolve/batch"]
    sent = [json.dumps(rec, sort_keys=True) for body in batches for rec in body["recipes"]]
    assert len(sent) == 12 and len(set(sent)) == 12
    assert proxy.count("POST", "/v1/resolve") == len(batches)  # nobody resolved on their own
    digest_of: dict[str, str] = {}
    for report in reports:
        assert set(report["statuses"]) == {"compiled"}
        for key, digest in zip(report["keys"], report["digests"], strict=True):
            assert digest_of.setdefault(key, digest) == digest  # identical digests on every rank
    assert len(digest_of) == 12
    # The node downloaded each blob once, however many ranks wanted it.
    downloads = proxy.paths("GET", "/v1/blobs/") + proxy.paths("GET", "/v1/recipes/")
    per_digest = {d: sum(n for p, n in downloads.items() if d in p) for d in digest_of.values()}
    assert set(per_digest.values()) == {1}, per_digest


def test_two_targets_are_both_compiled_in_one_warmup(proxy: Proxy, tmp_path: Path) -> None:
    recipes = kernels(3, "mixed")  # target "auto": each rank's own device decides
    targets = ["sm_80", "sm_90", "sm_80", "sm_90"]
    reports = run_ranks(tmp_path, proxy.url, [recipes] * 4, targets=targets)
    assert all(r["ok"] for r in reports), reports
    assert {r["union"] for r in reports} == {6}  # 3 recipes x 2 targets, in one pass
    for report, target in zip(reports, targets, strict=True):
        assert report["targets"] == [target] * 3  # each rank got its own
    assert (
        reports[0]["digests"]
        == reports[2]["digests"]
        != reports[1]["digests"]
        == reports[3]["digests"]
    )
    assert proxy.count("POST", "/v1/resolve/batch") == 1


def test_a_compile_error_is_raised_identically_on_every_rank(proxy: Proxy, tmp_path: Path) -> None:
    good = kernels(2, "err")
    broken = Recipe(
        source='extern "C" __global__ void bad_kernel(float* x) { x[0] = not_declared; }\n'
    )
    per_rank = [good, good, [*good, broken], good]  # only rank 2 asks for the broken one
    reports = run_ranks(tmp_path, proxy.url, per_rank, targets=["sm_80"] * 4, timeout=30)
    assert not any(r["ok"] for r in reports)
    assert {r["error"] for r in reports} == {"WarmupCompileError"}
    assert all(r["compile_error"] for r in reports)  # `except CompileError` catches it everywhere
    assert len({(r["message"], r["recipe_key"], r["log"]) for r in reports}) == 1  # the same error
    assert "not_declared" in reports[0]["log"]
    assert max(r["seconds"] for r in reports) < 30


def test_the_leader_losing_the_server_fails_every_rank_within_the_timeout(
    proxy: Proxy, tmp_path: Path
) -> None:
    recipes = kernels(12, "lost")  # two batches: the server is lost after the first
    proxy.faults.cut_after = "/v1/resolve/batch"
    reports = run_ranks(tmp_path, proxy.url, [recipes] * 4, targets=["sm_80"] * 4, timeout=20)
    assert not any(r["ok"] for r in reports)
    assert {r["error"] for r in reports} == {"WarmupError"}
    assert len({r["message"] for r in reports}) == 1, [r["message"] for r in reports]
    assert proxy.url in reports[0]["message"] and "unreachable" in reports[0]["message"]
    assert max(r["seconds"] for r in reports) < 20


def test_ranks_on_separate_nodes_each_have_a_leader(proxy: Proxy, tmp_path: Path) -> None:
    recipes = kernels(4, "pernode")
    hosts = ["node-a", "node-a", "node-b", "node-b"]
    dirs = [str(tmp_path / h) for h in hosts]
    reports = run_ranks(
        tmp_path,
        proxy.url,
        [recipes] * 4,
        targets=["sm_80"] * 4,
        cache_dirs=dirs,
        hosts=hosts,
        per_node=True,
    )
    assert all(r["ok"] for r in reports), reports
    assert [r["leader"] for r in reports] == [True, False, True, False]
    assert proxy.count("POST", "/v1/resolve/batch") == 2  # one per node
    assert len({tuple(r["digests"]) for r in reports}) == 1
    for report, node in zip(reports, dirs, strict=True):
        assert all(p.startswith(node) for p in report["paths"])  # each node's tier was filled
