"""GPU check that the adapters are drop-in: kcache's behaviour beside the library's own.

    PYTHONPATH=.:client:server python tests/gpu/adapters_library_check.py [WORKDIR]

Each case runs twice, once with the library (``cupy`` / ``cuda.core``) and once with
kcache's adapter (``kcache_client.cupy`` / ``kcache_client.cuda_core``), on one H200,
and must end the same way: equal results on the GPU, or the same exception type (for
compile errors, the library's ``CompileException`` / ``NVRTCError``). Covered: plain
and templated kernels; what kcache keys (``--Ofast-compile``, ``--no-cache``,
``translate_cucomplex``, ``#include <cupy/complex.cuh>``); what it hands to the library
(``backend="nvcc"``, cooperative groups, ``-Xptxas``, PTX input, PCH,
``compile(cache=program_cache())``); pickling of modules and kernels; cuda.core's
``handle``, ``pch_status``, dict options and its error for an unknown ``code_type``.
Every kcache case also says whether it went through kcache or bypassed it (and why).
``jitify=True`` is left out: CuPy's own jitify compile did not finish in minutes on the
H200 image; its bypass is decided on the CPU (tests/client/test_adapter_translation.py).

No server: misses compile here into a node tier under WORKDIR (default a temporary
directory). Runs from the GPU image as it is (torch, cupy 14.2, cuda-core 1.2, httpx).
Prints one JSON line per case (the first says the versions); exits non-zero if any fails.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

FAILURES: list[str] = []
N = 256

ADD = r"""
extern "C" __global__ void add(const float* x, const float* y, float* out, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = x[i] + y[i];
}
"""
SCALE = r"""
template <typename T, int K>
__global__ void scale(T* x, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] = x[i] * K;
}
"""
CUCOMPLEX = r"""
#include <cuComplex.h>
extern "C" __global__ void cmul(const cuFloatComplex* x, cuFloatComplex* out, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = cuCmulf(x[i], x[i]);
}
"""
CUPY_COMPLEX = r"""
#include <cupy/complex.cuh>
extern "C" __global__ void csq(const complex<float>* x, complex<float>* out, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = x[i] * x[i];
}
"""
COOPERATIVE = r"""
#include <cooperative_groups.h>
namespace cg = cooperative_groups;
extern "C" __global__ void twice_synced(float* x, int n) {
  cg::grid_group grid = cg::this_grid();
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] = x[i] * 2.0f;
  grid.sync();
}
"""
BROKEN = 'extern "C" __global__ void broken(float* x) { x[0] = undefined_name; }\n'


def report(case: str, ok: bool, **fields: Any) -> None:
    """One JSON line; a failed case is remembered for the exit status."""
    if not ok:
        FAILURES.append(case)
    print(json.dumps({"case": case, "ok": ok, **fields}, default=str), flush=True)


def outcome(body: Callable[[], Any]) -> tuple[str, Any]:
    """("ok", value) or ("raised", exception type's qualified name and first line)."""
    try:
        return "ok", body()
    except Exception as exc:
        first = (str(exc).splitlines() or [""])[0][:200]
        return "raised", (f"{type(exc).__module__}.{type(exc).__qualname__}", first, exc)


def main(workdir: Path) -> int:
    os.environ.pop("KCACHE_URL", None)
    os.environ.pop("KCACHE_LOCAL_COMPILE", None)
    os.environ.pop("KCACHE_BYPASS", None)
    os.environ["KCACHE_CACHE_DIR"] = str(workdir / "tier")
    import cupy
    import numpy as np

    try:
        import cuda.core as core

        if not hasattr(core, "Program"):
            raise ImportError
    except ImportError:
        import cuda.core.experimental as core  # type: ignore[no-redef]
    from kcache_client import cuda_core as kcore
    from kcache_client import cupy as kcupy
    from kcache_client._bypass import BypassWarning

    cupy.cuda.Device(0).use()
    cc = cupy.cuda.Device(0).compute_capability
    target = f"sm_{cc}"
    rng = np.random.default_rng(0)
    xs = cupy.asarray(rng.standard_normal(N, dtype=np.float32))
    ys = cupy.asarray(rng.standard_normal(N, dtype=np.float32))
    zs = cupy.asarray((rng.standard_normal(N) + 1j * rng.standard_normal(N)).astype(np.complex64))
    # kcache compiles misses here with the NVRTC it finds; say up front whether it can.
    from kcache_client import KernelCache

    from kcache import Recipe

    with KernelCache() as probe:
        local = outcome(lambda: probe.get(Recipe(source=ADD, target=target)).kind)
    report(
        "versions",
        True,
        kcache_local_compile="ok" if local[0] == "ok" else local[1][1],
        cupy=cupy.__version__,
        cuda_core=getattr(core, "__version__", "unknown"),
        device=cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
        target=target,
    )

    def via(module: Any) -> str:
        """How the kcache object compiled: "kcache", "bypass:<reason>" or "library"."""
        try:  # the adapters decide their plan when asked; a broken kernel raises there
            bypass = getattr(module, "bypass", None) or getattr(module, "last_bypass", None)
        except Exception:
            return "kcache (its compile raised)"
        if bypass is not None:
            return f"bypass:{bypass.reason}"
        ours = hasattr(type(module), "bypass") or "bypass" in getattr(module, "__dict__", {})
        return "kcache" if ours else "library"

    def same(
        case: str,
        make: Callable[[Any], Any],
        run_it: Callable[[Any], Any],
        libs: tuple[Any, Any] = (cupy, kcupy),
    ) -> None:
        """Build with the library, then with kcache's adapter, run each, and require the
        same ending: equal values, or the same exception type."""
        started = time.perf_counter()
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", BypassWarning)
                theirs = outcome(lambda: run_it(make(libs[0])))
                made: list[Any] = []

                def ours_body() -> Any:
                    made.append(make(libs[1]))
                    return run_it(made[0])

                ours = outcome(ours_body)
            fields: dict[str, Any] = {"via": via(made[0]) if made else "raised at construction"}
            fields["warned"] = [str(w.message)[:160] for w in caught if w.category is BypassWarning]
            if theirs[0] == ours[0] == "ok":
                ok = bool(np.array_equal(np.asarray(theirs[1]), np.asarray(ours[1])))
                fields["equal"] = ok
            elif theirs[0] == ours[0] == "raised":
                ok = theirs[1][0] == ours[1][0]
                fields |= {"library_raised": theirs[1][:2], "kcache_raised": ours[1][:2]}
                if ok and isinstance(ours[1][2].__cause__, Exception):
                    fields["chained_from"] = type(ours[1][2].__cause__).__name__
            else:
                ok = False
                fields |= {"library": _shown(theirs), "kcache": _shown(ours)}
            report(case, ok, seconds=round(time.perf_counter() - started, 2), **fields)
        except Exception as exc:
            report(
                case,
                False,
                error=f"{type(exc).__name__}: {exc}",
                where=traceback.format_exc(limit=-3),
            )

    def add_with(kernel: Any) -> Any:
        out = cupy.zeros(N, dtype=cupy.float32)
        kernel((1,), (N,), (xs, ys, out, cupy.int32(N)))
        return cupy.asnumpy(out)

    def module_add(module: Any) -> Any:
        return add_with(module.get_function("add"))

    # ------------------------------------------------------------------ CuPy: keyed by kcache
    same("cupy_raw_kernel", lambda lib: lib.RawKernel(ADD, "add"), add_with)
    same(
        "cupy_name_expressions",
        lambda lib: lib.RawModule(code=SCALE, name_expressions=("scale<float, 3>",)),
        lambda m: _scaled(m.get_function("scale<float, 3>"), xs, cupy),
    )
    for options in [("--Ofast-compile=min",), ("--no-cache",), ("-std=c++17", "-DN=4")]:
        same(
            f"cupy_options {' '.join(options)}",
            lambda lib, o=options: lib.RawModule(code=ADD, options=o),  # type: ignore[misc]
            module_add,
        )
    same(
        "cupy_translate_cucomplex",
        lambda lib: lib.RawKernel(CUCOMPLEX, "cmul", translate_cucomplex=True),
        lambda k: _complex(k, zs, cupy),
    )
    same(
        "cupy_own_headers",
        lambda lib: lib.RawKernel(CUPY_COMPLEX, "csq"),
        lambda k: _complex(k, zs, cupy),
    )
    same("cupy_compile_error", lambda lib: lib.RawKernel(BROKEN, "broken"), lambda k: k.compile())

    # ------------------------------------------------------------------ CuPy: the library's own
    same("cupy_backend_nvcc", lambda lib: lib.RawKernel(ADD, "add", backend="nvcc"), add_with)
    same(
        "cupy_ptxas_options",
        lambda lib: lib.RawModule(code=ADD, options=("-Xptxas", "-v")),
        module_add,
    )

    def cooperative(kernel: Any) -> Any:
        x = xs.copy()
        kernel((1,), (N,), (x, cupy.int32(N)))
        return cupy.asnumpy(x)

    same(
        "cupy_cooperative_groups",
        lambda lib: lib.RawKernel(COOPERATIVE, "twice_synced", enable_cooperative_groups=True),
        cooperative,
    )

    # ------------------------------------------------------------------ CuPy: pickling
    def round_trip(obj: Any) -> Any:
        return pickle.loads(pickle.dumps(obj))

    same("cupy_pickle_raw_kernel", lambda lib: round_trip(lib.RawKernel(ADD, "add")), add_with)
    same(
        "cupy_pickle_raw_module",
        lambda lib: round_trip(lib.RawModule(code=ADD, options=("-std=c++17",))),
        module_add,
    )
    same(
        "cupy_pickle_nvcc_kernel",
        lambda lib: round_trip(lib.RawKernel(ADD, "add", backend="nvcc")),
        add_with,
    )

    # ------------------------------------------------------------------ cuda.core
    dev = core.Device(0)
    dev.set_current()
    stream = dev.create_stream()

    def launch_scale(code: Any, name: str) -> Any:
        x = xs.copy()
        config = core.LaunchConfig(grid=1, block=N)
        core.launch(stream, config, code.get_kernel(name), np.uint64(x.data.ptr), np.int32(N))
        stream.sync()
        return cupy.asnumpy(x)

    def core_same(case: str, make: Callable[[Any], Any], run_it: Callable[[Any], Any]) -> None:
        same(case, make, run_it, libs=(core, kcore))

    def scale3(program: Any) -> Any:
        code = program.compile("cubin", name_expressions=("scale<float, 3>",))
        return launch_scale(code, "scale<float, 3>")

    options = core.ProgramOptions(std="c++17", arch=target)
    core_same(
        "cuda_core_program",
        lambda lib: lib.Program(SCALE, "c++", options=options),
        scale3,
    )
    core_same(
        "cuda_core_dict_options",
        lambda lib: lib.Program(SCALE, "c++", options={"arch": target, "name": "scale.cu"}),
        scale3,  # one compile: a cuda.core Program compiles once (a second one raises)
    )
    core_same(
        "cuda_core_ofast_compile",
        lambda lib: lib.Program(
            SCALE, "c++", options=core.ProgramOptions(arch=target, ofast_compile="min")
        ),
        scale3,
    )
    core_same(
        "cuda_core_compile_error",
        lambda lib: lib.Program(BROKEN, "c++", options=core.ProgramOptions(arch=target)),
        lambda p: p.compile("cubin"),
    )
    core_same(
        "cuda_core_unknown_code_type", lambda lib: lib.Program("x", "fortran"), lambda p: None
    )
    core_same(
        "cuda_core_handle_and_pch_status",
        lambda lib: lib.Program(ADD, "c++", options=core.ProgramOptions(arch=target)),
        lambda p: (int(p.handle) != 0, p.compile("cubin") is not None, p.pch_status),
    )
    ptx = core.Program(ADD, "c++", options=core.ProgramOptions(arch=target)).compile("ptx").code
    ptx_text = ptx.decode() if isinstance(ptx, bytes | bytearray) else str(ptx)
    core_same(
        "cuda_core_ptx_input",
        lambda lib: lib.Program(ptx_text, "ptx", options=core.ProgramOptions(arch=target)),
        lambda p: bytes(p.compile("cubin").code)[:4],
    )
    for field, value in [
        ("frandom_seed", "3"),
        ("brief_diagnostics", True),
        ("create_pch", "x.pch"),
    ]:
        core_same(
            f"cuda_core_option {field}",
            lambda lib, f=field, v=value: lib.Program(  # type: ignore[misc]
                SCALE, "c++", options=core.ProgramOptions(arch=target, **{f: v})
            ),
            scale3,
        )
    try:
        from cuda.core.utils import ProgramCacheResource  # noqa: F401

        resource = kcore.program_cache()
        core_same(
            "cuda_core_compile_with_program_cache",
            lambda lib: lib.Program(ADD, "c++", options=core.ProgramOptions(arch=target)),
            lambda p: bytes(p.compile("cubin", cache=resource).code)[:4],
        )
        core_same(
            "cuda_core_program_cache_refuses_name_expressions",
            lambda lib: lib.Program(SCALE, "c++", options=core.ProgramOptions(arch=target)),
            lambda p: p.compile("cubin", name_expressions=("scale<float, 3>",), cache=resource),
        )
    except ImportError:
        report("cuda_core_program_cache", True, skipped="no ProgramCacheResource in this cuda.core")

    report("summary", not FAILURES, failures=FAILURES)
    return 1 if FAILURES else 0


def _scaled(kernel: Any, xs: Any, cupy: Any) -> Any:
    x = xs.copy()
    kernel((1,), (x.size,), (x, cupy.int32(x.size)))
    return cupy.asnumpy(x)


def _complex(kernel: Any, zs: Any, cupy: Any) -> Any:
    out = cupy.zeros_like(zs)
    kernel((1,), (zs.size,), (zs, out, cupy.int32(zs.size)))
    return cupy.asnumpy(out)


def _shown(result: tuple[str, Any]) -> Any:
    kind, value = result
    return value[:2] if kind == "raised" else "returned"


if __name__ == "__main__":
    if len(sys.argv) > 1:
        root = Path(sys.argv[1])
        root.mkdir(parents=True, exist_ok=True)
        sys.exit(main(root))
    with tempfile.TemporaryDirectory(prefix="kcache-adapters-library-") as tmp:
        sys.exit(main(Path(tmp)))
