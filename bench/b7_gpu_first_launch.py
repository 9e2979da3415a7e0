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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import VECTOR_ADD, emit

ROUNDS = int(os.environ.get("BENCH_ROUNDS", "5"))
RECIPE = {"source": VECTOR_ADD, "target": "sm_90"}

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
# Every variant imports its libraries before the clock starts, as a job does at start-up.
if variant == "ours":
    from kcache import Recipe
    from kcache_client import KernelCache
    from cuda.core import launch, LaunchConfig, Device
elif variant == "nvrtc":
    from cuda.bindings import nvrtc
started = time.perf_counter()
if variant == "ours":
    cache = KernelCache(url=None, cache_dir=os.path.join(where, "tier"), send_events=False)
    kernel = cache.get(Recipe.from_dict(json.load(open(os.path.join(where, "recipe.json"))))).load()
    stream = Device().create_stream()
    launch(stream, LaunchConfig(grid=4, block=256), kernel, *[int(b) for b in bufs], ctypes.c_int(n))
    stream.sync()
elif variant == "nvrtc":
    _, prog = nvrtc.nvrtcCreateProgram(SRC.encode(), b"kernel.cu", 0, [], [])
    nvrtc.nvrtcCompileProgram(prog, 1, [b"-arch=sm_90"])
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
    mod = cupy.RawModule(code=SRC, options=("-arch=sm_90",), backend="nvrtc")
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
    from kcache_client import KernelCache

    from kcache import Recipe

    where.mkdir(parents=True, exist_ok=True)
    (where / "add.cu").write_text(VECTOR_ADD)
    with kcache_server() as url:
        cache = KernelCache(url=url, cache_dir=where / "tier", send_events=False)
        recipe = Recipe.from_dict(RECIPE)
        cache.warmup([recipe])
        concrete = cache.prepare(recipe)
        (where / "recipe.json").write_text(json.dumps(concrete.to_dict()))
        cache.close()
    print(json.dumps({"prepared": str(where), "recipe_key": concrete.key()}))


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


def run(where: Path) -> None:
    """Time each variant in fresh processes (GPU machine)."""
    base = {**os.environ, "PYTHONPATH": f"{Path.cwd()}:{Path.cwd() / 'client'}"}
    medians: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as cupy_warm:
        warm_env = {**base, "CUPY_CACHE_DIR": cupy_warm}
        _first_launch("cupy_cached", where, warm_env)  # fills CuPy's disk cache once
        for variant in ("ours", "nvrtc", "cupy_cold", "cupy_cached"):
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
        "B7.first_launch.vs_nvrtc_ms",
        medians["ours"],
        medians["nvrtc"],
        "ms",
        speedup=round(medians["nvrtc"] / medians["ours"], 1),
        goal=">= 20 x faster",
    )
    emit("B7.first_launch.vs_cupy_cold_ms", medians["ours"], medians["cupy_cold"], "ms")
    emit(
        "B7.first_launch.vs_cupy_cached_ms",
        medians["ours"],
        medians["cupy_cached"],
        "ms",
        goal="ours <= cupy cached",
    )


if __name__ == "__main__":
    phase, where = sys.argv[1], Path(sys.argv[2]).resolve()
    prepare(where) if phase == "prepare" else run(where)
