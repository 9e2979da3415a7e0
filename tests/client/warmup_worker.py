"""One rank of a multi-rank warmup test: a real process in a gloo (CPU) torch.distributed job.

    python warmup_worker.py CONFIG.json RANK

The config gives the world size, the rendezvous port, the server URL, each rank's
recipes, cache directory and auto target. Without a ``schedule`` the rank makes one
``warmup(recipes)`` and writes ``<out>/<rank>.json`` with what it got (digests,
targets, statuses) or the error it raised.

With a ``schedule`` (a list of calls, each ``{"group": "world"|"none"|"sub", "delays":
[seconds per rank]}``) the rank sleeps its delay before each call, warms up on that
group (``sub``: the group of ``subgroups`` this rank belongs to; a rank in none skips
the call) and writes ``{"rank", "calls": [...]}`` after every call, so a rank that dies
leaves what it had done. Other keys:

* ``store``: ``"rank0"`` (default: ``tcp://`` rendezvous, rank 0 hosts the store) or
  ``"external"`` (the test hosts the TCPStore, as torchrun's agent does);
* ``die``: ``{"rank": r, "call": i}``: rank r kills itself with SIGKILL while it leads
  call i, inside its resolve of the union (after the all-gather, before its answer).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
from kcache_client import ClientSettings, KernelCache, RetryPolicy, WarmupError

from kcache import Recipe
from kcache.errors import CompileError


def init(cfg: dict[str, Any], rank: int) -> None:
    timeout = timedelta(seconds=cfg["timeout"] * 2)
    if cfg.get("store") == "external":
        store = dist.TCPStore(
            "127.0.0.1", cfg["port"], cfg["world"], is_master=False, timeout=timeout
        )
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=cfg["world"], timeout=timeout
        )
    else:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{cfg['port']}",
            rank=rank,
            world_size=cfg["world"],
            timeout=timeout,
        )


def warmup_once(
    cache: KernelCache, recipes: list[Recipe], group: Any, cfg: dict[str, Any], rank: int
) -> dict[str, Any]:
    """One warmup call and what it gave this rank (or the error it raised)."""
    out: dict[str, Any] = {}
    started = time.monotonic()
    try:
        result = cache.warmup(
            recipes,
            group,
            timeout=cfg["timeout"],
            per_node=cfg.get("per_node", False),
            progress=rank == 0,
        )
        out.update(
            ok=True,
            keys=[a.recipe_key for a in result.artifacts],
            digests=[a.digest for a in result.artifacts],
            targets=[a.metadata.target for a in result.artifacts],
            statuses=result.statuses,
            leader=result.leader,
            union=result.union_size,
            verified=all(hashlib.sha256(a.data).hexdigest() == a.digest for a in result.artifacts),
            paths=[str(a.path) for a in result.artifacts],
        )
    except WarmupError as exc:
        out.update(
            ok=False,
            error=type(exc).__name__,
            timeout_error=isinstance(exc, TimeoutError),
            message=str(exc),
            recipe_key=exc.recipe_key,
            compile_error=isinstance(exc, CompileError),
            log=exc.log,
            missing_ranks=exc.missing_ranks,
        )
    out["seconds"] = time.monotonic() - started
    out["context_rank"] = cache.rank  # the warmup must leave the cache's own rank alone
    return out


def die_while_leading(cache: KernelCache) -> None:
    """Make this process's next resolve of a warmup's union end the process, as a crash would."""

    def get_many(*args: Any, **kwargs: Any) -> Any:
        os.kill(os.getpid(), signal.SIGKILL)
        raise AssertionError("unreachable")

    cache.get_many = get_many  # type: ignore[method-assign]


def main() -> None:
    cfg = json.loads(Path(sys.argv[1]).read_text())
    rank = int(sys.argv[2])
    init(cfg, rank)
    subgroups = [dist.new_group(ranks) for ranks in cfg.get("subgroups", [])]
    mine = next(
        (g for g, ranks in zip(subgroups, cfg.get("subgroups", []), strict=True) if rank in ranks),
        None,
    )
    recipes = [Recipe.from_dict(d) for d in cfg["recipes"][rank]]
    settings = ClientSettings.from_env(
        auto_target=cfg["targets"][rank],
        retry=RetryPolicy(**cfg.get("retry", {})),
        job_id="warmup-test",
        host=cfg["hosts"][rank] if "hosts" in cfg else None,
        send_events=False,
    )
    cache = KernelCache(cfg["url"], cache_dir=cfg["cache_dirs"][rank], settings=settings)
    report = Path(cfg["out"], f"{rank}.json")
    schedule = cfg.get("schedule")
    if schedule is None:
        out = {"rank": rank, **warmup_once(cache, recipes, None, cfg, rank)}
        report.write_text(json.dumps(out))
    else:
        die = cfg.get("die") or {}
        groups = {"world": dist.group.WORLD, "none": None, "sub": mine}
        calls: list[dict[str, Any]] = []
        for index, call in enumerate(schedule):
            time.sleep(call["delays"][rank])
            if call["group"] == "sub" and mine is None:
                calls.append({"skipped": True})
            else:
                if die.get("rank") == rank and die.get("call") == index:
                    die_while_leading(cache)
                calls.append(warmup_once(cache, recipes, groups[call["group"]], cfg, rank))
            report.write_text(json.dumps({"rank": rank, "calls": calls}))
    cache.close()
    stay_while_others_use_the_store(cfg, rank)
    dist.destroy_process_group()


def stay_while_others_use_the_store(cfg: dict[str, Any], rank: int) -> None:
    """Under ``tcp://`` rendezvous rank 0's process hosts the job's store, and a job keeps it
    up while the other ranks use it (a launcher outlives its ranks; a job ends in a barrier):
    each rank says it is done, and rank 0 waits (bounded) for the ranks that live, so a rank
    still in a warmup on a subgroup never finds the store gone because rank 0 finished first.
    """
    if cfg.get("store") == "external":
        return  # the test hosts it
    die = cfg.get("die") or {}
    living = cfg["world"] - (1 if die else 0)
    deadline = time.monotonic() + 2 * cfg["timeout"]
    try:
        store = dist.TCPStore(
            "127.0.0.1", cfg["port"], is_master=False, timeout=timedelta(seconds=cfg["timeout"])
        )
        store.add("test/finished", 1)
        while rank == 0 and store.add("test/finished", 0) < living:
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)
    except (RuntimeError, OSError):  # the host is gone (a test that kills it): nothing to keep
        return


if __name__ == "__main__":
    main()
