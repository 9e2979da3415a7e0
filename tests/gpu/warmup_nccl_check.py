"""GPU check of issue 18 on two GPUs: repeated, skewed warmups in a torchrun job on NCCL.

    torchrun --nproc-per-node 2 tests/gpu/warmup_nccl_check.py [--url URL] [--workdir DIR]

with kcache and kcache-client installed (``pip install --no-deps . ./client``; and
``./server`` with its dependencies unless ``--url`` names a running server: ``kcache
serve`` finds its command through the package's entry point), and cuda-core, numpy and
a CUDA build of PyTorch. One process per GPU, ``init_process_group("nccl")`` as a
training job would. Without ``--url`` rank 0 starts a real ``kcache serve`` and hands
its URL to the other ranks through the job's store. Then, on every rank:

1. ``warmup`` of three kernels (``target="auto"``: this GPU) on ``group=WORLD``, rank 1
   arriving 2 s late; every kernel is loaded with ``Artifact.load()`` and launched on
   this rank's GPU, and its output compared exactly with PyTorch's;
2. a second ``warmup`` on ``group=None`` with a late fourth kernel, the leader (rank 0)
   arriving 2 s late; all four kernels launched and compared again;
3. an ``sm_80`` cubin refused by ``load()`` with ``ArchitectureMismatchError`` naming
   both architectures (and, for the record, what the driver itself answers);
4. a PTX artifact for this GPU: ``load()`` either loads it (then it is launched and
   compared) or refuses it naming the PTX ISA and the driver's version; either way the
   verdict must agree with what the driver itself does with the same PTX.

Prints one JSON line per check (``"ok": false`` marks a failure); the failure counts
are summed over NCCL, rank 0 prints the summary, and every rank exits non-zero if any
check failed anywhere.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from kcache_client import ArchitectureMismatchError, ClientSettings, KernelCache
from kcache_client._device import driver_version

from kcache import Recipe

ROOT = Path(__file__).resolve().parents[2]

VECTOR_ADD = """
extern "C" __global__ void add(const float* x, const float* y, float* out, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = x[i] + y[i];
}
"""
SCALE = """
template <typename T, int K>
__global__ void scale(T* x, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] = x[i] * K;
}
"""
AXPY_INT = """
extern "C" __global__ void axpy(int a, const int* x, int* y, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = a * x[i] + y[i];
}
"""
MAXIMUM = """
extern "C" __global__ void maximum(const float* x, const float* y, float* out, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = fmaxf(x[i], y[i]);
}
"""
#: Kernel name (a name expression for the template) by recipe, as load() takes it.
ENTRY = {"add": "add", "scale": "scale<float, 3>", "axpy": "axpy", "maximum": "maximum"}
N = 1000
CAPACITY = 1024
SKEW_S = 2.0
TIMEOUT_S = 300.0


class Checks:
    """Prints each check as a JSON line and counts the failures."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.failures = 0

    def record(self, check: str, ok: bool, **facts: Any) -> None:
        self.failures += not ok
        print(json.dumps({"rank": self.rank, "check": check, "ok": ok, **facts}), flush=True)


def cuda_core() -> Any:
    try:
        import cuda.core as core

        if hasattr(core, "launch"):
            return core
    except ImportError:
        pass
    import cuda.core.experimental as experimental

    return experimental


def launch(core: Any, device: int, kernel: Any, n: int, *args: Any) -> None:
    """Launch on ``device`` after PyTorch's work on it is done, and wait for the kernel."""
    torch.cuda.synchronize(device)
    dev = core.Device(device)
    dev.set_current()
    stream = dev.create_stream()
    core.launch(stream, core.LaunchConfig(grid=(n + 255) // 256, block=256), kernel, *args)
    stream.sync()


def ptr(t: torch.Tensor) -> Any:
    return np.uint64(t.data_ptr())


def run_kernel(core: Any, device: int, name: str, kernel: Any, seed: int) -> tuple[bool, str]:
    """Launch one of the four kernels on fresh data; (bit-exact, what was compared)."""
    gen = torch.Generator(device=f"cuda:{device}").manual_seed(seed)
    cuda = f"cuda:{device}"
    if name in ("add", "maximum"):
        x = torch.randn(CAPACITY, device=cuda, generator=gen)
        y = torch.randn(CAPACITY, device=cuda, generator=gen)
        out = torch.full((CAPACITY,), float("nan"), device=cuda)
        launch(core, device, kernel, N, ptr(x), ptr(y), ptr(out), np.int32(N))
        want = x[:N] + y[:N] if name == "add" else torch.maximum(x[:N], y[:N])
        exact = torch.equal(out[:N], want) and bool(torch.isnan(out[N:]).all())
        return exact, f"out[:{N}] == {'x + y' if name == 'add' else 'max(x, y)'}, tail untouched"
    if name == "scale":
        x = torch.arange(CAPACITY, dtype=torch.float32, device=cuda)
        launch(core, device, kernel, N, ptr(x), np.int32(N))
        want = torch.arange(CAPACITY, dtype=torch.float32, device=cuda)
        want[:N] *= 3
        return torch.equal(x, want), f"x[:{N}] * 3, tail untouched"
    x = torch.randint(-1000, 1000, (CAPACITY,), dtype=torch.int32, device=cuda, generator=gen)
    y = torch.randint(-1000, 1000, (CAPACITY,), dtype=torch.int32, device=cuda, generator=gen)
    want = y.clone()
    want[:N] += 7 * x[:N]
    launch(core, device, kernel, N, np.int32(7), ptr(x), ptr(y), np.int32(N))
    return torch.equal(y, want), f"y[:{N}] = 7 * x + y, tail untouched"


def driver_loads(data: bytes, kind: str) -> str:
    """What the CUDA driver itself answers for these bytes (cuModuleLoadData), for the record."""
    from cuda.bindings import driver

    image = data + b"\0" if kind == "ptx" else data  # PTX is loaded as a C string
    result = driver.cuModuleLoadData(image)
    if result[0] == driver.CUresult.CUDA_SUCCESS:
        driver.cuModuleUnload(result[1])
    return str(result[0].name if hasattr(result[0], "name") else result[0])


def start_server(workdir: Path) -> Any:
    """``kcache serve`` on a free port (it runs in its data directory: relative
    PYTHONPATH entries are made absolute first)."""
    entries = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    os.environ["PYTHONPATH"] = os.pathsep.join(str(Path(e).resolve()) for e in entries if e)
    sys.path.insert(0, str(ROOT))  # tests.support, which client_harness imports
    sys.path.insert(0, str(ROOT / "tests" / "client"))
    from client_harness import KcacheServer

    return KcacheServer(workdir / "server").start(timeout=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="an existing kcache server (default: rank 0 starts one)")
    parser.add_argument(
        "--workdir", type=Path, help="node tier and server data (default: a temp dir)"
    )
    args = parser.parse_args()

    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world = int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    checks = Checks(rank)
    core = cuda_core()
    core.Device(local_rank).set_current()
    major, minor = torch.cuda.get_device_capability(local_rank)
    here = f"sm_{major}{minor}"
    # Rank 0 makes the work directory (and the server) and tells the others through the
    # job's store: a fresh directory each run, so a fresh server compiles everything.
    store = dist.distributed_c10d._get_default_store()
    server = None
    if rank == 0:
        workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kcache-warmup-nccl-"))
        if not args.url:
            server = start_server(workdir)
        store.set("kcache-warmup-nccl-check/workdir", str(workdir))
        store.set("kcache-warmup-nccl-check/url", server.url if server else args.url)
    workdir = Path(store.get("kcache-warmup-nccl-check/workdir").decode())
    url = store.get("kcache-warmup-nccl-check/url").decode()
    fresh = args.url is None
    checks.record(
        "setup",
        True,
        world=world,
        gpu=local_rank,
        arch=here,
        url=url,
        backend=dist.get_backend(),
        torch=torch.__version__,
        driver_cuda=driver_version(),
        workdir=str(workdir),
    )

    settings = ClientSettings.from_env(device=local_rank, job_id="warmup-nccl-check")
    cache = KernelCache(url, cache_dir=workdir / "tier", settings=settings)
    base = {
        "add": Recipe(source=VECTOR_ADD),
        "scale": Recipe(source=SCALE, name_expressions=["scale<float, 3>"]),
        "axpy": Recipe(source=AXPY_INT),
    }
    late = {"maximum": Recipe(source=MAXIMUM)}
    phases = [
        ("warmup 1: group=WORLD, rank 1 late", dist.group.WORLD, base, 1),
        ("warmup 2: group=None, the leader late, one late recipe", None, {**base, **late}, 0),
    ]
    for number, (title, group, recipes, late_rank) in enumerate(phases, 1):
        if rank == late_rank:
            time.sleep(SKEW_S)
        started = time.monotonic()
        try:
            result = cache.warmup(list(recipes.values()), group, timeout=TIMEOUT_S, progress=False)
        except Exception as exc:
            checks.record(
                f"warmup{number}", False, title=title, error=f"{type(exc).__name__}: {exc}"
            )
            continue
        if number == 1:
            want = ["compiled"] * 3 if fresh else None
        else:
            want = ["local_hit"] * 3 + ["compiled"] if fresh else None
        statuses_ok = want is None or result.statuses == want
        checks.record(
            f"warmup{number}",
            statuses_ok and result.leader == (rank == 0) and result.union_size == len(recipes),
            title=title,
            seconds=round(time.monotonic() - started, 3),
            statuses=result.statuses,
            expected_statuses=want,
            leader=result.leader,
            union=result.union_size,
            targets=sorted({a.metadata.target for a in result.artifacts}),
        )
        for name, art in zip(recipes, result.artifacts, strict=True):
            try:
                kernel = art.load(ENTRY[name], device=local_rank)
                exact, compared = run_kernel(
                    core, local_rank, name, kernel, seed=rank * 100 + number
                )
                checks.record(
                    f"launch{number}",
                    exact,
                    kernel=name,
                    gpu=local_rank,
                    target=art.metadata.target,
                    compared=compared,
                )
            except Exception as exc:
                checks.record(
                    f"launch{number}",
                    False,
                    kernel=name,
                    gpu=local_rank,
                    error=f"{type(exc).__name__}: {exc}",
                )

    # An sm_80 cubin on this GPU: refused by load() before the driver, both named (an
    # sm_8x GPU runs it, so there it must load).
    refuse = major != 8
    try:
        wrong = cache.get(Recipe(source=VECTOR_ADD, target="sm_80"))
        try:
            wrong.load("add", device=local_rank)
            checks.record("sm80_refused", not refuse, arch=here, verdict="loaded")
        except ArchitectureMismatchError as exc:
            named = "sm_80" in str(exc) and here in str(exc)
            checks.record(
                "sm80_refused",
                refuse and named,
                arch=here,
                verdict="refused",
                message=str(exc),
                artifact=exc.artifact,
                device=exc.device,
                driver_itself=driver_loads(wrong.data, "cubin"),
            )
    except Exception as exc:
        checks.record("sm80_refused", False, error=f"{type(exc).__name__}: {exc}")

    # PTX for this GPU: load() and the driver must agree on whether it can be loaded.
    try:
        ptx = cache.get(Recipe(source=VECTOR_ADD, target=f"compute_{major}{minor}", output="ptx"))
        isa = next(
            (ln.split()[1] for ln in ptx.data.decode().splitlines() if ln.startswith(".version")),
            "?",
        )
        driver_says = driver_loads(ptx.data, "ptx")
        driver_ok = driver_says == "CUDA_SUCCESS"
        try:
            kernel = ptx.load("add", device=local_rank)
        except ArchitectureMismatchError as exc:
            checks.record(
                "ptx",
                not driver_ok,
                ptx_isa=isa,
                verdict="refused",
                message=str(exc),
                driver_itself=driver_says,
            )
        else:
            exact, compared = run_kernel(core, local_rank, "add", kernel, seed=rank * 100 + 7)
            checks.record(
                "ptx",
                driver_ok and exact,
                ptx_isa=isa,
                verdict="loaded",
                exact=exact,
                compared=compared,
                driver_itself=driver_says,
            )
    except Exception as exc:
        checks.record("ptx", False, error=f"{type(exc).__name__}: {exc}")

    total = torch.tensor([checks.failures], dtype=torch.int64, device=f"cuda:{local_rank}")
    dist.all_reduce(total)  # over NCCL, the job's main backend
    failures = int(total.item())
    if rank == 0:
        print(
            json.dumps(
                {
                    "check": "summary",
                    "ranks": world,
                    "failures": failures,
                    "result": "PASS" if failures == 0 else "FAIL",
                }
            ),
            flush=True,
        )
    cache.close()  # its audit events go to the server: stop that only once every rank is done
    dist.barrier()
    dist.destroy_process_group()
    if server is not None:
        server.stop()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
