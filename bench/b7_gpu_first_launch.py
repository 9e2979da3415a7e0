"""B7 (GPU): first launch of a kernel in a fresh process, ms from "I need this kernel" to
its first launch finished, with the CUDA context already up in every variant.

    ours            KernelCache(cache_dir=tier).get(recipe).load(), then launch (the node tier
                    was filled by a warmup against a real server on the build machine)
    nvrtc           NVRTC in-process (the GPU machine's own), cuModuleLoadData, launch
    cupy_cold       cupy.RawModule with an empty CUPY_CACHE_DIR (compiles)
    cupy_cached     cupy.RawModule with its disk cache already warm

Two phases, since the server and NVRTC 13.5 run on the build machine, the GPU elsewhere:

    python bench/b7_gpu_first_launch.py prepare DIR    # here: real server + warmup into DIR/tier
    python bench/b7_gpu_first_launch.py run DIR        # on the GPU machine (PYTHONPATH=.:client)

Each variant runs in ROUNDS fresh processes; the median is reported. Goals: ours >= 20 x
faster than compiling (nvrtc), and <= CuPy's cached path.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _harness
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support
from _harness import emit

from tests.support import VECTOR_ADD

ROUNDS = int(os.environ.get("BENCH_ROUNDS", "5"))
#: The same ``add`` kernel twice: plain, and pulling in cub (a CCCL-heavy compile).
CUB_ADD = """
#include <cub/block/block_reduce.cuh>
extern "C" __global__ void add(const float* x, const float* y, float* out, int n) {
  using Reduce = cub::BlockReduce<float, 256>;
  __shared__ typename Reduce::TempStorage tmp;
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  float v = i < n ? x[i] + y[i] : 0.0f;
  float total = Reduce(tmp).Sum(v);
  if (i < n) out[i] = v + 0.0f * total;
}
"""
KERNELS = {"vector_add": VECTOR_ADD, "cub_add": CUB_ADD}

_CHILD = r"""
import ctypes, json, os, sys, time
variant, where = sys.argv[1], sys.argv[2]
from cuda.bindings import driver
driver.cuInit(0)
_, dev = driver.cuDeviceGet(0)
_, ctx = driver.cuDevicePrimaryCtxRetain(dev)
driver.cuCtxSetCurrent(ctx)
n = 1024
bufs = [driver.cuMemAlloc(n * 4)[1] for _ in range(3)]
if variant.startswith("cupy"):
    import cupy
    cupy.cuda.Device(0).use()
    x = cupy.ones(n, dtype=cupy.float32)
SRC = open(os.path.join(where, "add.cu")).read()
INCLUDES = [f"-I{d}" for d in os.environ.get("B7_INCLUDES", "").split(":") if d]
# Every variant imports its libraries before the clock starts, as a job does at start-up.
if variant == "ours":
    from kcache import Recipe
    from kcache_client import ClientSettings, KernelCache
    from cuda.core import launch, LaunchConfig, Device
elif variant == "nvrtc":
    from cuda.bindings import nvrtc
started = time.perf_counter()
if variant == "ours":
    quiet = ClientSettings.from_env(send_events=False)
    cache = KernelCache(cache_dir=os.path.join(where, "..", "tier"), settings=quiet)
    kernel = cache.get(Recipe.from_dict(json.load(open(os.path.join(where, "recipe.json"))))).load()
    stream = Device().create_stream()
    launch(stream, LaunchConfig(grid=4, block=256), kernel, *[int(b) for b in bufs], ctypes.c_int(n))
    stream.sync()
elif variant == "nvrtc":
    _, prog = nvrtc.nvrtcCreateProgram(SRC.encode(), b"kernel.cu", 0, [], [])
    options = [b"-arch=sm_90", b"-std=c++17", *(o.encode() for o in INCLUDES)]
    nvrtc.nvrtcCompileProgram(prog, len(options), options)
    _, size = nvrtc.nvrtcGetCUBINSize(prog)
    cubin = bytearray(size)
    nvrtc.nvrtcGetCUBIN(prog, cubin)
    _, mod = driver.cuModuleLoadData(bytes(cubin))
    _, fn = driver.cuModuleGetFunction(mod, b"add")
    args = [ctypes.c_uint64(int(b)) for b in bufs] + [ctypes.c_int(n)]
    ptrs = (ctypes.c_void_p * 4)(*[ctypes.addressof(a) for a in args])
    driver.cuLaunchKernel(fn, 4, 1, 1, 256, 1, 1, 0, 0, ctypes.addressof(ptrs), 0)
    driver.cuCtxSynchronize()
else:
    mod = cupy.RawModule(code=SRC, options=("-arch=sm_90", "-std=c++17", *INCLUDES), backend="nvrtc")
    fn = mod.get_function("add")
    out = cupy.empty(n, dtype=cupy.float32)
    fn((4,), (256,), (x, x, out, cupy.int32(n)))
    cupy.cuda.Device(0).synchronize()
elapsed_ms = (time.perf_counter() - started) * 1e3
exact = None
if variant == "ours":
    # After timing: the tier's kernel, launched again on known data, must be exact.
    import struct
    driver.cuMemcpyHtoD(bufs[0], struct.pack(f"{n}f", *range(n)), n * 4)
    driver.cuMemcpyHtoD(bufs[1], struct.pack(f"{n}f", *(2.0 * i for i in range(n))), n * 4)
    driver.cuMemcpyHtoD(bufs[2], struct.pack(f"{n}f", *([float("nan")] * n)), n * 4)
    launch(stream, LaunchConfig(grid=4, block=256), kernel, *[int(b) for b in bufs], ctypes.c_int(n))
    stream.sync()
    out = bytearray(n * 4)
    driver.cuMemcpyDtoH(out, bufs[2], n * 4)
    exact = struct.unpack(f"{n}f", bytes(out)) == tuple(3.0 * i for i in range(n))
print(json.dumps({"ms": elapsed_ms, "exact": exact}))
"""


def prepare(where: Path) -> None:
    """Fill ``where/tier`` through a real server and KernelCache.warmup (build machine)."""
    from _harness import kcache_server
    from kcache_client import ClientSettings, KernelCache

    from kcache import Recipe

    recipes = {
        name: Recipe(source=source, target="sm_90", flags=["-std=c++17"])
        for name, source in KERNELS.items()
    }
    with kcache_server() as url:
        quiet = ClientSettings.from_env(send_events=False)
        cache = KernelCache(url, cache_dir=where / "tier", settings=quiet)
        cache.warmup(list(recipes.values()))
        for name, recipe in recipes.items():
            (where / name).mkdir(parents=True, exist_ok=True)
            (where / name / "add.cu").write_text(KERNELS[name])
            concrete = cache.prepare(recipe)
            (where / name / "recipe.json").write_text(json.dumps(concrete.to_dict()))
            print(json.dumps({"prepared": name, "recipe_key": concrete.key()}))
        cache.close()


def _first_launch(variant: str, where: Path, env: dict[str, str]) -> float:
    """One fresh process; its first-launch time (and, for ours, an exactness check)."""
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, variant, str(where)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{variant} failed: {proc.stderr[-2000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if result["exact"] is False:
        raise RuntimeError(f"{variant}: the kernel from the tier computed wrong results")
    return float(result["ms"])


def _cuda_includes() -> str:
    """The GPU machine's CUDA headers (with CCCL) for the anchors' own compiles."""
    found = []
    for root in (os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"):
        include = Path(root) / "include"
        if root and include.is_dir():
            found += [str(include / "cccl")] if (include / "cccl").is_dir() else []
            found.append(str(include))
            break
    return ":".join(found)


def run(where: Path) -> None:
    """Time each kernel's variants in fresh processes (GPU machine)."""
    for name in KERNELS:
        _run_kernel(name, where / name)


def _run_kernel(name: str, where: Path) -> None:
    base = {
        **os.environ,
        "PYTHONPATH": f"{Path.cwd()}:{Path.cwd() / 'client'}",
        "B7_INCLUDES": _cuda_includes(),
    }
    medians: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as cupy_warm:
        warm_env = {**base, "CUPY_CACHE_DIR": cupy_warm}
        errors: dict[str, str] = {}
        try:
            _first_launch("cupy_cached", where, warm_env)  # fills CuPy's disk cache once
        except RuntimeError as exc:
            errors["cupy"] = str(exc)[-300:]
        for variant in ("ours", "nvrtc", "cupy_cold", "cupy_cached"):
            if variant.startswith("cupy") and "cupy" in errors:
                continue
            times = []
            for _ in range(ROUNDS):
                if variant == "cupy_cold":
                    with tempfile.TemporaryDirectory() as empty:
                        times.append(
                            _first_launch(variant, where, {**base, "CUPY_CACHE_DIR": empty})
                        )
                else:
                    times.append(_first_launch(variant, where, warm_env))
            medians[variant] = statistics.median(times)
    emit(
        f"B7.{name}.first_launch.vs_nvrtc_ms",
        medians["ours"],
        medians["nvrtc"],
        "ms",
        speedup=round(medians["nvrtc"] / medians["ours"], 1),
        goal=">= 20 x faster",
    )
    for variant, goal in (("cupy_cold", None), ("cupy_cached", "ours <= cupy cached")):
        if variant in medians:
            emit(
                f"B7.{name}.first_launch.vs_{variant}_ms",
                medians["ours"],
                medians[variant],
                "ms",
                goal=goal,
            )
        else:
            emit(
                f"B7.{name}.first_launch.vs_{variant}_ms",
                medians["ours"],
                None,
                "ms",
                error=errors["cupy"],
            )


if __name__ == "__main__":
    phase, where = sys.argv[1], Path(sys.argv[2]).resolve()
    prepare(where) if phase == "prepare" else run(where)
