"""GPU proof of the CuPy, cuda.core and PyTorch adapters (one process, one GPU).

    python tests/gpu/adapters_check.py [WORKDIR]

Compiles CuPy-style kernels through kcache (local compiles into a node tier under
WORKDIR, default a temporary directory; no server) and the same code with CuPy and
cuda.core directly, launches both on the GPU and requires identical results, and exact
ones against NumPy/torch where the arithmetic is exact:

* CuPy ``RawModule``: a plain ``extern "C"`` kernel, templated kernels through name
  expressions, headers from an ``-I`` directory, ``-std=c++17`` with CCCL (cub), and a
  kernel whose results are denormal (CuPy compiles with ``-ftz=true``; so must kcache);
* CuPy ``RawKernel``: a plain name, and a name expression (beyond CuPy);
* cuda.core ``Program.compile`` with ``ProgramOptions`` and ``get_kernel(name_expression)``,
  against cuda.core's own ``Program``; and cuda.core's own ``Program`` with
  ``cache=program_cache()`` (cuda.core >= 1.0), hit on the second compile;
* torch: ``Kernel`` launches with tensors on the current stream and on a side stream,
  and refuses a host tensor and a wrong dtype before launching.

Prints one JSON line per check (the first says the versions); exits non-zero if any fails.
"""

from __future__ import annotations

import io
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

FAILURES: list[str] = []

PLAIN = """
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
HEADERED = """
#include "ops/twice.cuh"
extern "C" __global__ void twice_all(int* x, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] = ops::twice(x[i]) + OFFSET;
}
"""
CCCL = """
#include <cub/block/block_reduce.cuh>
#include <cuda/std/type_traits>
template <typename T, int BLOCK>
__global__ void block_sum(const T* x, T* out) {
  using Reduce = cub::BlockReduce<T, BLOCK>;
  __shared__ typename Reduce::TempStorage storage;
  T v = x[blockIdx.x * BLOCK + threadIdx.x];
  if constexpr (cuda::std::is_integral_v<T>) { v = Reduce(storage).Sum(v); }
  if (threadIdx.x == 0) out[blockIdx.x] = v;
}
"""
DENORMAL = """
extern "C" __global__ void mul(const float* x, const float* y, float* out, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = x[i] * y[i];
}
"""
N = 1000


def report(check: str, ok: bool, **fields: Any) -> None:
    """One JSON line; a failed check is remembered for the exit status."""
    if not ok:
        FAILURES.append(check)
    print(json.dumps({"check": check, "ok": ok, **fields}, default=str), flush=True)


def run(check: str, body: Callable[[], dict[str, Any]]) -> None:
    """Run one check; an exception is a failure with its traceback's last line."""
    try:
        fields = body()
        ok = bool(fields.pop("ok"))
        report(check, ok, **fields)
    except Exception as exc:
        report(
            check, False, error=f"{type(exc).__name__}: {exc}", where=traceback.format_exc(limit=-3)
        )


def main(workdir: Path) -> int:
    # No server: every miss compiles here with the NVRTC wheel, into a tier under workdir.
    os.environ.pop("KCACHE_URL", None)
    os.environ.pop("KCACHE_LOCAL_COMPILE", None)
    import cupy
    import numpy as np
    import torch
    from kcache_client import KernelCache

    import kcache

    try:
        import cuda.core as core

        if not hasattr(core, "Program"):
            raise ImportError
    except ImportError:
        import cuda.core.experimental as core  # type: ignore[no-redef]
    from importlib.metadata import PackageNotFoundError, version

    def dist_version(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "unknown"

    device = cupy.cuda.Device(0)
    device.use()
    torch.cuda.set_device(0)
    cc = device.compute_capability
    target = f"sm_{cc}"
    cache = KernelCache(cache_dir=workdir / "tier")
    report(
        "versions",
        True,
        python=sys.version.split()[0],
        kcache=getattr(kcache, "__version__", "unknown"),
        cupy=cupy.__version__,
        cuda_core=getattr(core, "__version__", None) or dist_version("cuda-core"),
        cuda_bindings=dist_version("cuda-bindings"),
        nvrtc=dist_version("nvidia-cuda-nvrtc"),
        torch=torch.__version__,
        numpy=np.__version__,
        device=torch.cuda.get_device_name(0),
        target=target,
    )
    from kcache_client.cuda_core import Program as KProgram
    from kcache_client.cuda_core import program_cache
    from kcache_client.cupy import RawKernel as KRawKernel
    from kcache_client.cupy import RawModule as KRawModule
    from kcache_client.torch import Kernel as TorchKernel

    rng = np.random.default_rng(17)
    x32 = rng.standard_normal(N).astype(np.float32)
    y32 = rng.standard_normal(N).astype(np.float32)
    grid, block = ((N + 255) // 256,), (256,)

    def same_bits(a: Any, b: Any) -> bool:
        a, b = np.asarray(a), np.asarray(b)
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()

    def launch_add(module: Any) -> Any:
        x, y = cupy.asarray(x32), cupy.asarray(y32)
        out = cupy.full(N + 24, np.nan, dtype=cupy.float32)
        module.get_function("add")(grid, block, (x, y, out, cupy.int32(N)))
        return cupy.asnumpy(out)

    # ---------------------------------------------------------------- CuPy RawModule
    def cupy_plain() -> dict[str, Any]:
        started = time.perf_counter()
        ours = KRawModule(code=PLAIN, options=("-std=c++17",), cache=cache)
        got = launch_add(ours)
        first_s = time.perf_counter() - started
        theirs = launch_add(cupy.RawModule(code=PLAIN, options=("-std=c++17",)))
        want = x32 + y32
        return {
            "ok": same_bits(got, theirs) and same_bits(got[:N], want) and np.isnan(got[N:]).all(),
            "exact_vs_numpy": same_bits(got[:N], want),
            "same_as_cupy": same_bits(got, theirs),
            "first_use_s": round(first_s, 3),
            "recipe_key": ours.artifact().recipe_key[:16],
        }

    def cupy_templated() -> dict[str, Any]:
        exprs = ("scale<float, 3>", "scale<double, 2>", "scale<int, 5>")
        ours = KRawModule(code=SCALE, options=("--std=c++17",), name_expressions=exprs, cache=cache)
        theirs = cupy.RawModule(code=SCALE, options=("--std=c++17",), name_expressions=exprs)
        results = {}
        ok = True
        for expr, dtype, k in zip(
            exprs, (np.float32, np.float64, np.int32), (3, 2, 5), strict=True
        ):
            host = (rng.standard_normal(N) * 1000).astype(dtype)
            outs = []
            for module in (ours, theirs):
                arr = cupy.asarray(host)
                module.get_function(expr)(grid, block, (arr, cupy.int32(N)))
                outs.append(cupy.asnumpy(arr))
            want = host * dtype(k)
            exact, same = same_bits(outs[0], want), same_bits(outs[0], outs[1])
            results[expr] = {"exact": exact, "same_as_cupy": same}
            ok = ok and exact and same
        return {"ok": ok, "lowered": ours.artifact().lowered_names, **results}

    def cupy_headers() -> dict[str, Any]:
        include = workdir / "include"
        (include / "ops").mkdir(parents=True, exist_ok=True)
        (include / "ops" / "twice.cuh").write_text(
            '#pragma once\n#include "ops/detail.cuh"\nnamespace ops { template <typename T> '
            "__device__ T twice(T v) { return detail::add(v, v); } }\n"
        )
        (include / "ops" / "detail.cuh").write_text(
            "#pragma once\nnamespace ops { namespace detail { template <typename T> "
            "__device__ T add(T a, T b) { return a + b; } } }\n"
        )
        options = ("-I", str(include), "-DOFFSET=7")
        host = np.arange(N, dtype=np.int32) - 300
        outs = []
        for module in (
            KRawModule(code=HEADERED, options=options, cache=cache),
            cupy.RawModule(code=HEADERED, options=(f"-I{include}", "-DOFFSET=7")),
        ):
            arr = cupy.asarray(host)
            module.get_function("twice_all")(grid, block, (arr, cupy.int32(N)))
            outs.append(cupy.asnumpy(arr))
        want = host * 2 + 7
        recipe = KRawModule(code=HEADERED, options=options, cache=cache).recipe
        assert recipe is not None
        return {
            "ok": same_bits(outs[0], want) and same_bits(outs[0], outs[1]),
            "exact": same_bits(outs[0], want),
            "same_as_cupy": same_bits(outs[0], outs[1]),
            "in_memory_headers": sorted(recipe.headers),
        }

    def cupy_cccl_cxx17() -> dict[str, Any]:
        exprs = ("block_sum<int, 128>", "block_sum<long long, 256>")
        ours = KRawModule(code=CCCL, options=("-std=c++17",), name_expressions=exprs, cache=cache)
        theirs = cupy.RawModule(code=CCCL, options=("-std=c++17",), name_expressions=exprs)
        ok, fields = True, {}
        for expr, dtype, width in zip(exprs, (np.int32, np.int64), (128, 256), strict=True):
            blocks = 37
            host = rng.integers(-(10**6), 10**6, size=blocks * width).astype(dtype)
            outs = []
            for module in (ours, theirs):
                x, out = cupy.asarray(host), cupy.zeros(blocks, dtype=dtype)
                module.get_function(expr)((blocks,), (width,), (x, out))
                outs.append(cupy.asnumpy(out))
            want = host.reshape(blocks, width).sum(axis=1, dtype=dtype)
            exact, same = same_bits(outs[0], want), same_bits(outs[0], outs[1])
            fields[expr] = {"exact": exact, "same_as_cupy": same}
            ok = ok and exact and same
        return {"ok": ok, **fields}

    def cupy_ftz_parity() -> dict[str, Any]:
        # Products below FLT_MIN: denormal in IEEE, zero under -ftz=true (which CuPy adds).
        x = np.full(N, 1e-20, dtype=np.float32) * (1 + np.arange(N, dtype=np.float32) / N)
        y = np.full(N, 1e-20, dtype=np.float32)
        outs = []
        for module in (KRawModule(code=DENORMAL, cache=cache), cupy.RawModule(code=DENORMAL)):
            out = cupy.full(N, np.nan, dtype=cupy.float32)
            module.get_function("mul")(
                grid, block, (cupy.asarray(x), cupy.asarray(y), out, cupy.int32(N))
            )
            outs.append(cupy.asnumpy(out))
        return {
            "ok": same_bits(outs[0], outs[1]),
            "same_as_cupy": same_bits(outs[0], outs[1]),
            "flushed_to_zero": bool((outs[0] == 0).all()),
            "ieee_would_be_denormal": bool(((x * y) != 0).all()),
        }

    # ---------------------------------------------------------------- CuPy RawKernel
    def cupy_raw_kernel() -> dict[str, Any]:
        got = launch_add(_KernelAsModule(KRawKernel(PLAIN, "add", cache=cache)))
        theirs = launch_add(_KernelAsModule(cupy.RawKernel(PLAIN, "add")))
        scale = KRawKernel(SCALE, "scale<float, 3>", cache=cache)
        arr = cupy.asarray(x32)
        scale(grid, block, (arr, cupy.int32(N)))
        scaled = cupy.asnumpy(arr)
        return {
            "ok": same_bits(got, theirs) and same_bits(scaled, x32 * np.float32(3)),
            "same_as_cupy": same_bits(got, theirs),
            "expression_exact": same_bits(scaled, x32 * np.float32(3)),
            "num_regs": int(scale.num_regs),
        }

    # ---------------------------------------------------------------- cuda.core
    def _core_launch(kernel: Any, arr: Any, n: int) -> None:
        dev = core.Device(0)
        dev.set_current()
        cupy.cuda.Device(0).synchronize()
        stream = dev.create_stream()
        config = core.LaunchConfig(grid=(n + 255) // 256, block=256)
        core.launch(stream, config, kernel, np.uint64(arr.data.ptr), np.int32(n))
        stream.sync()

    def cuda_core_program() -> dict[str, Any]:
        exprs = ("scale<float, 3>", "scale<double, 2>")
        options = core.ProgramOptions(std="c++17", arch=target)
        log = io.StringIO()
        ours = KProgram(SCALE, "c++", options=options, cache=cache).compile(
            "cubin", name_expressions=exprs, logs=log
        )
        again = KProgram(SCALE, "c++", options=options, cache=cache).compile(
            "cubin", name_expressions=exprs
        )
        theirs = core.Program(SCALE, "c++", options=options).compile(
            "cubin", name_expressions=exprs
        )
        fields: dict[str, Any] = {"object_code": type(ours).__name__, "ok": True}
        for expr, dtype, k in zip(exprs, (np.float32, np.float64), (3, 2), strict=True):
            host = (rng.standard_normal(N) * 100).astype(dtype)
            outs = []
            for code in (ours, again, theirs):
                arr = cupy.asarray(host)
                _core_launch(code.get_kernel(expr), arr, N)
                outs.append(cupy.asnumpy(arr))
            exact = same_bits(outs[0], host * dtype(k))
            same = same_bits(outs[0], outs[2]) and same_bits(outs[1], outs[2])
            fields[expr] = {"exact": exact, "same_as_cuda_core": same}
            fields["ok"] = fields["ok"] and exact and same
        return fields

    def cuda_core_program_cache() -> dict[str, Any]:
        try:
            from cuda.core.utils import ProgramCacheResource  # noqa: F401
        except ImportError:
            return {"ok": True, "skipped": "this cuda.core has no ProgramCacheResource (< 1.0)"}
        resource = program_cache(cache)
        options = core.ProgramOptions(arch=target)
        started = time.perf_counter()
        first = core.Program(PLAIN, "c++", options=options).compile("cubin", cache=resource)
        cold_s = time.perf_counter() - started
        started = time.perf_counter()
        second = core.Program(PLAIN, "c++", options=options).compile("cubin", cache=resource)
        warm_s = time.perf_counter() - started
        x, y = cupy.asarray(x32), cupy.asarray(y32)
        out = cupy.full(N, np.nan, dtype=cupy.float32)
        dev = core.Device(0)
        dev.set_current()
        cupy.cuda.Device(0).synchronize()
        stream = dev.create_stream()
        config = core.LaunchConfig(grid=(N + 255) // 256, block=256)
        core.launch(
            stream,
            config,
            second.get_kernel("add"),
            *(np.uint64(a.data.ptr) for a in (x, y, out)),
            np.int32(N),
        )
        stream.sync()
        exact = same_bits(cupy.asnumpy(out), x32 + y32)
        return {
            "ok": exact and len(resource) >= 1 and bytes(first.code) == bytes(second.code),
            "exact": exact,
            "entries": len(resource),
            "cold_s": round(cold_s, 4),
            "hit_s": round(warm_s, 4),
        }

    # ---------------------------------------------------------------- torch
    def torch_launch() -> dict[str, Any]:
        artifact = cache.get(kcache.Recipe.from_cupy(PLAIN, target=target))
        add = TorchKernel(artifact, signature=("const float*", "const float*", "float*", "int"))
        x, y = torch.from_numpy(x32).cuda(), torch.from_numpy(y32).cuda()
        out = torch.full((N,), float("nan"), device="cuda")
        add(grid[0], block[0], x, y, out, N)  # torch.cuda.current_stream()
        torch.cuda.synchronize()
        exact = torch.equal(out, x + y)
        side = torch.cuda.Stream()
        out2 = torch.full((N,), float("nan"), device="cuda")
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            add(grid[0], block[0], x, y, out2, N)
            side_done = out2.clone()  # ordered after the launch on the same stream
        torch.cuda.synchronize()
        scale_art = cache.get(
            kcache.Recipe.from_cupy(SCALE, (), ["scale<float, 3>"], target=target)
        )
        scale = TorchKernel(scale_art, "scale<float, 3>", signature=("float*", "int"))
        z = x.clone()
        scale((N + 255) // 256, 256, z, N)
        torch.cuda.synchronize()
        refusals = []
        for bad in ((x.cpu(), y, out, N), (x.double(), y, out, N)):
            try:
                add(grid[0], block[0], *bad)
                refusals.append("launched")
            except (TypeError, ValueError) as exc:
                refusals.append(str(exc))
        refused = all(r != "launched" for r in refusals)
        return {
            "ok": exact and torch.equal(side_done, x + y) and torch.equal(z, x * 3) and refused,
            "exact_current_stream": exact,
            "exact_side_stream": torch.equal(side_done, x + y),
            "expression_exact": torch.equal(z, x * 3),
            "refusals": refusals,
        }

    for name, body in [
        ("cupy_raw_module_plain", cupy_plain),
        ("cupy_raw_module_name_expressions", cupy_templated),
        ("cupy_raw_module_headers", cupy_headers),
        ("cupy_raw_module_cccl_cxx17", cupy_cccl_cxx17),
        ("cupy_ftz_parity", cupy_ftz_parity),
        ("cupy_raw_kernel", cupy_raw_kernel),
        ("cuda_core_program", cuda_core_program),
        ("cuda_core_program_cache", cuda_core_program_cache),
        ("torch_launch", torch_launch),
    ]:
        run(name, body)
    compiles = getattr(cache.stats, "local_compiles", None)
    report("summary", not FAILURES, failures=FAILURES, local_compiles=compiles)
    return 1 if FAILURES else 0


class _KernelAsModule:
    """A RawKernel seen through ``get_function``, so one launcher serves modules and kernels."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel

    def get_function(self, name: str) -> Any:
        return self.kernel


if __name__ == "__main__":
    if len(sys.argv) > 1:
        root = Path(sys.argv[1])
        root.mkdir(parents=True, exist_ok=True)
        sys.exit(main(root))
    with tempfile.TemporaryDirectory(prefix="kcache-adapters-") as tmp:
        sys.exit(main(Path(tmp)))
