"""Multi-rank warmup with real processes: torch.distributed on gloo (CPU) against a real server.

docs/design.md, section 8: the union of all ranks' recipes is resolved once by the leader,
its broadcast is the barrier, every rank ends with the same artifacts, and a failing
leader makes every rank raise the same error within the timeout.

Issue 18: warmups repeated in one job, on WORLD, None and subgroups, with ranks arriving
in any order (seeded random skews of up to 3 s), never fail or hang; a rank that does
not arrive, or a leader that dies, makes every other rank raise the same
WarmupTimeoutError naming it.

The many-rank and many-repetition runs are seeded samples by default (four ranks, four
repetitions); ``pytest --slow`` runs them in full (eight ranks, twenty repetitions).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from client_harness import Proxy, kernels

from kcache import Recipe
from tests.support import free_port, sample_size

dist = pytest.importorskip("torch.distributed")

WORKER = Path(__file__).with_name("warmup_worker.py")
RETRY = {"attempts": 3, "base_s": 0.05, "cap_s": 0.2, "budget_s": 2.0}
#: Ranks of the many-rank tests: eight in a --slow run, four (two per subgroup) otherwise.
MANY = sample_size(4, 8)
#: Repetitions of three skewed warmups in the two-rank test (the issue's case comes first).
REPETITIONS = sample_size(4, 20)


def run_ranks(
    tmp_path: Path,
    url: str,
    recipes: list[list[Recipe]],
    *,
    targets: list[str],
    cache_dirs: list[str] | None = None,
    timeout: float = 60.0,
    wait_s: float | None = None,
    **extra: Any,
) -> list[dict[str, Any]]:
    """Start one process per rank, wait (bounded), return each rank's JSON report.

    ``extra`` goes into the worker's config (see warmup_worker.py). The ranks are
    killed after ``wait_s`` seconds (default ``timeout + 60``): a hang fails the test.
    """
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
    # As torchrun's agent does, the test itself can host the job's store.
    store = (
        dist.TCPStore(
            "127.0.0.1",
            cfg["port"],
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=timeout * 2),
        )
        if extra.get("store") == "external"
        else None
    )
    logs = [tmp_path / f"rank{rank}.log" for rank in range(world)]
    procs = []
    for rank in range(world):
        with logs[rank].open("wb") as log:  # a file, not a pipe: a chatty rank cannot block
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(WORKER), str(cfg_path), str(rank)],
                    stderr=log,
                    env={**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world)},
                )
            )
    deadline = time.monotonic() + (wait_s if wait_s is not None else timeout + 60)
    hung = []
    try:
        for proc in procs:
            proc.wait(max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for rank, proc in enumerate(procs):
            if proc.poll() is None:  # a hung rank fails the test instead of hanging it
                hung.append(rank)
                proc.kill()
                proc.wait()
    del store
    errors = [log.read_text(errors="replace")[-3000:] for log in logs]
    assert not hung, f"ranks {hung} hung:\n" + "\n".join(errors[r] for r in hung)
    reports = []
    for rank in range(world):
        path = out / f"{rank}.json"
        assert path.exists(), (
            f"rank {rank} wrote no report (exit {procs[rank].returncode}):\n{errors[rank]}"
        )
        reports.append({**json.loads(path.read_text()), "exit": procs[rank].returncode})
    return reports


def test_many_ranks_compile_each_recipe_once_and_download_it_once(
    proxy: Proxy, tmp_path: Path
) -> None:
    """Eight ranks and twelve recipes in a --slow run; four ranks and six recipes otherwise."""
    count, half = 3 * MANY // 2, MANY // 2
    recipes = kernels(count, f"many{MANY}")
    # Every rank asks for an overlapping share: ranks r and r + MANY/2 ask for the same
    # half of the recipes (eight ranks: r and r + 4 the same six of twelve).
    per_rank = [
        [recipes[(r % half * 3 + j) % count] for j in range(count // 2)] for r in range(MANY)
    ]
    reports = run_ranks(tmp_path, proxy.url, per_rank, targets=["sm_80"] * MANY)
    assert all(r["ok"] for r in reports), reports
    assert [r["leader"] for r in reports] == [True] + [False] * (MANY - 1)
    assert {r["union"] for r in reports} == {count}
    assert all(r["verified"] for r in reports)
    # Each recipe compiled on the server exactly once: one batch pass, and "compiled" for all.
    batches = [s.json() for s in proxy.seen if s.path == "/v1/resolve/batch"]
    sent = [json.dumps(rec, sort_keys=True) for body in batches for rec in body["recipes"]]
    assert len(sent) == count and len(set(sent)) == count
    assert proxy.count("POST", "/v1/resolve") == len(batches)  # nobody resolved on their own
    digest_of: dict[str, str] = {}
    for report in reports:
        assert set(report["statuses"]) == {"compiled"}
        for key, digest in zip(report["keys"], report["digests"], strict=True):
            assert digest_of.setdefault(key, digest) == digest  # identical digests on every rank
    assert len(digest_of) == count
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


# ---------------------------------------------------------------------- issue 18
MAX_DELAY = 3.0


def skewed(rng: random.Random, kinds: list[str], world: int) -> list[dict[str, Any]]:
    """One call per kind, each rank delayed by a seeded random 0-3 s before it.

    Each rank sleeps its delay minus the smallest one: the ranks arrive with exactly
    the skews of the full delays, without the test also waiting the common part.
    """
    calls = []
    for kind in kinds:
        delays = [rng.uniform(0, MAX_DELAY) for _ in range(world)]
        calls.append({"group": kind, "delays": [d - min(delays) for d in delays]})
    return calls


def per_rank_recipes(world: int, tag: str) -> list[list[Recipe]]:
    """Three tiny kernels; every rank asks for the first and one of the other two."""
    ks = kernels(3, tag)
    return [[ks[0], ks[1 + r % 2]] for r in range(world)]


def check_schedule(
    reports: list[dict[str, Any]],
    schedule: list[dict[str, Any]],
    subgroups: list[list[int]],
    proxy: Proxy,
) -> None:
    """Every call succeeded on every rank it involved, with one leader per group and the
    same artifacts everywhere; the job compiled each kernel once, in its first warmup.

    The ranks asked as :func:`per_rank_recipes` says: the first kernel, then the second
    or third by the rank's parity (every group here holds both parities).
    """
    world = len(reports)
    assert all(r["exit"] == 0 for r in reports), [r["exit"] for r in reports]
    assert all(len(r["calls"]) == len(schedule) for r in reports)
    first = reports[0]["calls"][0]["keys"]
    second = reports[1]["calls"][0]["keys"]
    assert first[0] == second[0] and first[1] != second[1]
    wanted = [[first[0], (first, second)[r % 2][1]] for r in range(world)]
    digest_of: dict[str, str] = {}
    for index, call in enumerate(schedule):
        groups = subgroups if call["group"] == "sub" else [list(range(world))]
        for members in groups:
            results = [reports[r]["calls"][index] for r in members]
            failed = [(r, c) for r, c in zip(members, results, strict=True) if not c.get("ok")]
            assert not failed, (index, call, failed)
            assert [c["leader"] for c in results] == [True] + [False] * (len(members) - 1)
            assert {c["union"] for c in results} == {3}
            for r, c in zip(members, results, strict=True):
                assert c["keys"] == wanted[r]
                assert c["verified"]
                assert c["statuses"] == ["compiled" if index == 0 else "local_hit"] * 2
                assert c["context_rank"] == r  # the cache's own rank was left alone
                for key, digest in zip(c["keys"], c["digests"], strict=True):
                    assert digest_of.setdefault(key, digest) == digest
        for r in range(world):
            if not any(r in g for g in groups):
                assert reports[r]["calls"][index] == {"skipped": True}
    assert len(digest_of) == 3
    assert proxy.count("POST", "/v1/resolve/batch") == 1  # compiled once, in the first warmup
    assert proxy.count("POST", "/v1/resolve") == 1


def test_two_ranks_repetitions_of_three_skewed_warmups(proxy: Proxy, tmp_path: Path) -> None:
    """Twenty repetitions in a --slow run; four otherwise (the first of each of the kinds)."""
    rng = random.Random(1802)
    # The exact case first (WORLD, the last rank 2 s late before the later
    # calls), then repetitions of 3 warmups with fresh random delays, on None, a
    # subgroup and WORLD in turn, all in one pair of processes.
    schedule = [{"group": "world", "delays": d} for d in ([0, 0], [0, 2.0], [0, 2.0])]
    for rep in range(1, REPETITIONS):
        schedule += skewed(rng, [("world", "none", "sub")[rep % 3]] * 3, 2)
    recipes = per_rank_recipes(2, f"repeated{REPETITIONS}")
    subgroups = [[0, 1]]
    reports = run_ranks(
        tmp_path,
        proxy.url,
        recipes,
        targets=["sm_80"] * 2,
        timeout=30,
        wait_s=sum(max(c["delays"]) for c in schedule) + 120,
        schedule=schedule,
        subgroups=subgroups,
    )
    check_schedule(reports, schedule, subgroups, proxy)


def test_many_ranks_skewed_warmups_on_world_none_and_subgroups(
    proxy: Proxy, tmp_path: Path
) -> None:
    """Eight ranks, three warmups of each kind in a --slow run; four ranks, one of each otherwise."""
    rng = random.Random(1808)
    each = sample_size(1, 3)
    schedule = skewed(rng, ["world"] * each + ["none"] * each + ["sub"] * each, MANY)
    recipes = per_rank_recipes(MANY, f"skewed{MANY}")
    # Two disjoint subgroups warm up at the same time; one's leader is global rank 1
    # (each holds both parities, as check_schedule expects).
    subgroups = [[1, 3, 4, 6], [0, 2, 5, 7]] if MANY == 8 else [[1, 2], [0, 3]]
    reports = run_ranks(
        tmp_path,
        proxy.url,
        recipes,
        targets=["sm_80"] * MANY,
        timeout=30,
        wait_s=sum(max(c["delays"]) for c in schedule) + 150,
        schedule=schedule,
        subgroups=subgroups,
    )
    check_schedule(reports, schedule, subgroups, proxy)


@pytest.mark.parametrize("store", ["external", "rank0"])
def test_the_leader_killed_in_the_second_warmup_fails_every_survivor_alike(
    proxy: Proxy, tmp_path: Path, store: str
) -> None:
    # "external": the store outlives the leader (torchrun's agent hosts it); the
    # survivors agree on a verdict naming rank 0. "rank0": the leader hosted the store
    # (tcp:// rendezvous) and took it down; the survivors raise the same error naming it.
    timeout = 6.0
    schedule = [{"group": "world", "delays": [0, 0, 0]}] * 2
    reports = run_ranks(
        tmp_path,
        proxy.url,
        [kernels(2, "killed")] * 3,
        targets=["sm_80"] * 3,
        timeout=timeout,
        schedule=schedule,
        die={"rank": 0, "call": 1},
        store=store,
    )
    assert reports[0]["exit"] == -9 and len(reports[0]["calls"]) == 1  # died in call 2
    survivors = [r["calls"] for r in reports[1:]]
    assert all(calls[0]["ok"] for calls in survivors)
    second = [calls[1] for calls in survivors]
    assert {c["error"] for c in second} == {"WarmupTimeoutError"}
    assert all(c["timeout_error"] for c in second)
    assert len({c["message"] for c in second}) == 1, [c["message"] for c in second]
    if store == "external":
        assert {tuple(c["missing_ranks"]) for c in second} == {(0,)}
        assert "rank 0 sent nothing in the broadcast" in second[0]["message"]
    else:
        assert "key-value store stopped answering" in second[0]["message"]
    assert max(c["seconds"] for c in second) < timeout + 5  # liveness: nobody hung


def test_a_rank_that_never_arrives_is_named_and_the_next_warmup_works(
    proxy: Proxy, tmp_path: Path
) -> None:
    timeout = 4.0
    schedule = [
        {"group": "world", "delays": [0, 0, 0]},
        {"group": "world", "delays": [0, 0, timeout + 2]},  # rank 2 comes too late
        {"group": "none", "delays": [0, 0, 0]},
    ]
    recipes = per_rank_recipes(3, "absent")
    reports = run_ranks(
        tmp_path, proxy.url, recipes, targets=["sm_80"] * 3, timeout=timeout, schedule=schedule
    )
    assert all(r["exit"] == 0 for r in reports)
    second = [r["calls"][1] for r in reports]
    # Every rank, the late one included, raises the one verdict naming rank 2.
    assert {c["error"] for c in second} == {"WarmupTimeoutError"}
    assert len({c["message"] for c in second}) == 1, [c["message"] for c in second]
    assert {tuple(c["missing_ranks"]) for c in second} == {(2,)}
    assert "rank 2 did not reach the all-gather" in second[0]["message"]
    assert max(c["seconds"] for c in second[:2]) < timeout + 5
    assert all(r["calls"][0]["ok"] and r["calls"][2]["ok"] for r in reports)
