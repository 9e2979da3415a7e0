"""A job's Triton kernel reaches a new node through the job's manifest, in one request.

Issue 47 item 4 on the GPU: a process of job J compiles and launches a Triton kernel with
``TRITON_CACHE_MANAGER=kcache_client.triton:CacheManager`` (a salt of this run in a
constexpr makes its key new to the server); the hook publishes the group under J's
context. Then a fresh process on "another node" (empty Triton cache directory, empty
kcache node tier) asks the server for J's manifest, which must name the Triton group,
prefetches it (one bundle request, besides the read of the server's withdrawals every
process makes before it first answers from its tier), and launches the same kernel: Triton must compile nothing
(no ``put_group``), the hook must find the group in the node tier (no server lookup) and
the results must be exact.

Run with ``KCACHE_URL`` and ``KCACHE_TOKEN`` (publish scope) set:
``python triton_job_manifest.py WORKDIR``; prints one JSON line per phase and a verdict.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
import uuid
from typing import Any

#: Job J's id, the same in every process of a run (the parent sets it, its phases read it).
JOB = os.environ.setdefault("ACCEPT_JOB", f"triton-manifest-{uuid.uuid4().hex[:8]}")


def launch(salt: int) -> dict[str, Any]:
    """Compile (or find) and launch the salted kernel through Triton; what the hook did."""
    import torch
    import triton
    import triton.language as tl
    from kcache_client import triton as hook

    puts: list[str] = []
    real_put = hook.CacheManager.put_group

    def put_group(self: Any, filename: str, group: Any) -> Any:
        puts.append(filename)
        return real_put(self, filename, group)

    hook.CacheManager.put_group = put_group  # type: ignore[method-assign]

    @triton.jit
    def scale_add(x_ptr, out_ptr, n, SALT: tl.constexpr, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask)
        tl.store(out_ptr + offs, x * 3 + SALT, mask=mask)

    n = 100_003
    x = torch.arange(n, dtype=torch.int32, device="cuda")
    out = torch.empty_like(x)
    scale_add[(triton.cdiv(n, 1024),)](x, out, n, SALT=salt, BLOCK=1024)
    torch.cuda.synchronize()
    foreign = hook._foreign
    flushed = foreign.flush(60) if foreign is not None and puts else None
    return {
        "exact": bool(torch.equal(out, x * 3 + salt)),
        "put_group": len(puts),
        "flushed": flushed,
        "hook": dict(foreign.counts) if foreign is not None else {},
    }


def build(salt: int) -> dict[str, Any]:
    """Job J's process: Triton compiles, the hook publishes under J."""
    return {"phase": "build", **launch(salt)}


def node(salt: int) -> dict[str, Any]:
    """A new node: J's manifest from the server, one prefetch, then the launch."""
    from kcache_client import KernelCache

    with KernelCache() as cache:
        manifest = cache.job_manifest(JOB)
        before = cache.requests
        result = cache.prefetch(manifest)
        prefetch_requests = cache.requests - before
    libraries = sorted({group.name.library for group in manifest.foreign})
    return {
        "phase": "node",
        "manifest_version": manifest.version,
        "manifest_foreign": len(manifest.foreign),
        "libraries": libraries,
        "prefetch": {
            "requests": prefetch_requests,  # the bundle, and the withdrawals read before it
            "bundle_requests": cache.stats.bundle_requests,
            "withdrawal_requests": cache.stats.withdrawal_requests,
            "fetched": result.fetched,
            "missing": list(result.missing),
        },
        **launch(salt),
    }


def main() -> int:
    if len(sys.argv) == 4:  # one phase, in its own process
        phase, salt = sys.argv[1], int(sys.argv[3])
        print(json.dumps(build(salt) if phase == "build" else node(salt)), flush=True)
        return 0
    workdir = sys.argv[1]
    salt = uuid.uuid4().int % 1_000_000 + 7
    # The server's key, as a fleet's images carry it (KCACHE_TRUSTED_KEYS): the new node
    # trusts it without a first contact of its own.
    keys = urllib.request.Request(
        f"{os.environ['KCACHE_URL']}/v1/keys",
        headers={"Authorization": f"Bearer {os.environ['KCACHE_TOKEN']}"},
    )
    with urllib.request.urlopen(keys, timeout=30) as answer:
        fleet_key = json.load(answer)["keys"][0]["public_key"]
    results = {}
    for phase in ("build", "node"):
        env = {
            **os.environ,
            "KCACHE_JOB_ID": JOB if phase == "build" else f"{JOB}-node",
            "TRITON_CACHE_MANAGER": "kcache_client.triton:CacheManager",
            "TRITON_CACHE_DIR": os.path.join(workdir, f"triton-{phase}"),
            "KCACHE_CACHE_DIR": os.path.join(workdir, f"tier-{phase}"),
            "KCACHE_TRUSTED_KEYS": fleet_key,
        }
        proc = subprocess.run(
            [sys.executable, __file__, phase, workdir, str(salt)],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        if proc.returncode != 0:
            print(json.dumps({"phase": phase, "failed": proc.stderr[-3000:]}))
            return 1
        results[phase] = json.loads(proc.stdout.strip().splitlines()[-1])
        print(json.dumps(results[phase]), flush=True)
    built, fresh = results["build"], results["node"]
    verdict = {
        "built_and_published": built["exact"]
        and built["put_group"] >= 1
        and bool(built["flushed"]),
        "manifest_names_triton": "triton" in fresh["libraries"],
        "one_bundle_request": fresh["prefetch"]["bundle_requests"] == 1
        and fresh["prefetch"]["requests"] == 1 + fresh["prefetch"]["withdrawal_requests"]
        and not fresh["prefetch"]["missing"],
        "no_compile_no_lookup_on_the_node": fresh["put_group"] == 0
        and fresh["hook"].get("node_hits", 0) >= 1
        and not fresh["hook"].get("server_hits")
        and not fresh["hook"].get("misses"),
        "exact": fresh["exact"],
    }
    print(json.dumps({"verdict": verdict, "met": all(verdict.values())}))
    return 0 if all(verdict.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
