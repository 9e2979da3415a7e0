"""A Triton kernel compiled by rank 0 of a 2-rank job is a kcache hit on rank 1.

Two processes on the one GPU (gloo), each with its own empty Triton cache directory and
empty kcache node tier, both with ``TRITON_CACHE_MANAGER=kcache_client.triton:CacheManager``
and the same server. Rank 0 compiles and launches the kernel (a salt of this run in a
constexpr makes its key new to the server), waits for its publish, then the ranks meet at
a barrier; rank 1 then launches the same kernel: its compile must find the group on the
server (no ``put_group``: Triton compiled nothing) and the results must be exact.

Run: ``python triton_two_ranks.py WORKDIR`` (starts both ranks); prints one JSON line per rank.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from typing import Any


def rank_main(rank: int, workdir: str, salt: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import triton
    import triton.language as tl
    from kcache_client import triton as hook

    dist.init_process_group("gloo", rank=rank, world_size=2)
    puts: list[str] = []
    real_put = hook.CacheManager.put_group

    def put_group(self: Any, filename: str, group: Any) -> Any:
        puts.append(filename)
        return real_put(self, filename, group)

    hook.CacheManager.put_group = put_group

    @triton.jit
    def scale_add(x_ptr, out_ptr, n, SALT: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask)
        tl.store(out_ptr + offs, x * 3 + SALT, mask=mask)

    cache_dir = os.environ["TRITON_CACHE_DIR"]
    before = sorted(os.listdir(cache_dir)) if os.path.isdir(cache_dir) else []
    result: dict[str, Any] = {"rank": rank, "salt": salt, "cache_dir_before": before}
    if rank == 1:
        dist.barrier()  # rank 0 has compiled and published
    n = 100_003
    x = torch.arange(n, dtype=torch.int32, device="cuda")
    out = torch.empty_like(x)
    scale_add[(triton.cdiv(n, 1024),)](x, out, n, SALT=salt, BLOCK=1024)
    torch.cuda.synchronize()
    result["exact"] = bool(torch.equal(out, x * 3 + salt))
    result["put_group"] = puts
    foreign = hook._foreign
    if rank == 0:
        result["flushed"] = foreign.flush(60) if foreign is not None else None
        dist.barrier()
    result["kcache"] = dict(foreign.counts) if foreign is not None else {}
    result["cache_dir_after"] = sorted(os.listdir(cache_dir))
    dist.barrier()
    dist.destroy_process_group()
    return result


def main() -> int:
    if len(sys.argv) == 4:  # a rank
        rank, workdir, salt = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
        print(json.dumps(rank_main(rank, workdir, salt)), flush=True)
        return 0
    workdir = sys.argv[1]
    salt = uuid.uuid4().int % 1_000_000 + 7
    procs = []
    for rank in (0, 1):
        env = dict(os.environ)
        env.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT="29517",
            TRITON_CACHE_MANAGER="kcache_client.triton:CacheManager",
            TRITON_CACHE_DIR=os.path.join(workdir, f"triton-rank{rank}"),
            KCACHE_CACHE_DIR=os.path.join(workdir, f"kcache-rank{rank}"),
        )
        args = [sys.executable, __file__, str(rank), workdir, str(salt)]
        procs.append(subprocess.Popen(args, env=env))
    codes = [p.wait(timeout=300) for p in procs]
    return max(codes)


if __name__ == "__main__":
    sys.exit(main())
