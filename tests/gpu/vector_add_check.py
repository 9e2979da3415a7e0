"""GPU check of cubins made by ``kcache compile`` (run on a machine with an NVIDIA GPU).

Two phases, because NVRTC here and the GPU may live on different machines:

    python tests/gpu/vector_add_check.py build OUTDIR   # kcache compile for sm_90 and sm_80
    python tests/gpu/vector_add_check.py run OUTDIR     # load, launch, compare exactly

``run`` loads the sm_90 cubin with the CUDA driver, launches the bounds-checked vector
add for n = 1, 255, 256, 257, 1000 into an output buffer filled with NaN, and requires
``out == x + y`` bit for bit, with the NaN tail beyond n untouched. The sm_80 cubin must
be refused before launch, by the ELF check, with a message naming both SMs.
Prints one JSON line per check; exits non-zero on any failure.
"""

from __future__ import annotations

import ctypes
import json
import math
import struct
import subprocess
import sys
from pathlib import Path

VECTOR_ADD = """
extern "C" __global__ void add(const float* x, const float* y, float* out, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = x[i] + y[i];
}
"""
SIZES = (1, 255, 256, 257, 1000)
CAPACITY = 1024


def build(outdir: Path) -> None:
    """Compile with the real ``kcache compile`` command into ``outdir``."""
    outdir.mkdir(parents=True, exist_ok=True)
    source = outdir / "add.cu"
    source.write_text(VECTOR_ADD)
    for target in ("sm_90", "sm_80"):
        line = subprocess.run(
            [
                sys.executable,
                "-m",
                "kcache.cli",
                "compile",
                str(source),
                "--target",
                target,
                # Compiled here, into a cache directory of its own: no server is asked
                # (an empty --server overrides a KCACHE_URL in the environment).
                "--server",
                "",
                "--cache-dir",
                str(outdir / "cache"),
                "-o",
                str(outdir / f"add_{target}.cubin"),
            ],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        print(json.dumps({"check": "build", "target": target, **json.loads(line)}))


def _ok(result: tuple[object, ...], what: str) -> tuple[object, ...]:
    from cuda.bindings import driver

    if result[0] != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{what}: {result[0]!r}")
    return result


def run(outdir: Path) -> int:
    """Load and launch on the GPU; return the number of failed checks."""
    from cuda.bindings import driver

    from kcache.elf import cubin_sm

    _ok(driver.cuInit(0), "cuInit")
    (_, device) = _ok(driver.cuDeviceGet(0), "cuDeviceGet")
    (_, major) = _ok(
        driver.cuDeviceGetAttribute(
            driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device
        ),
        "cc major",
    )
    (_, minor) = _ok(
        driver.cuDeviceGetAttribute(
            driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, device
        ),
        "cc minor",
    )
    device_sm = int(major) * 10 + int(minor)
    (_, ctx) = _ok(driver.cuDevicePrimaryCtxRetain(device), "retain")
    _ok(driver.cuCtxSetCurrent(ctx), "set ctx")
    failures = 0

    def load_checked(path: Path) -> object:
        data = path.read_bytes()
        sm = cubin_sm(data)
        if sm != device_sm:
            raise RuntimeError(f"{path.name} is a cubin for sm_{sm}; this GPU is sm_{device_sm}")
        (_, module) = _ok(driver.cuModuleLoadData(data), "cuModuleLoadData")
        (_, function) = _ok(driver.cuModuleGetFunction(module, b"add"), "cuModuleGetFunction")
        return function

    function = load_checked(outdir / "add_sm_90.cubin")
    nbytes = CAPACITY * 4
    buffers = [_ok(driver.cuMemAlloc(nbytes), "cuMemAlloc")[1] for _ in range(3)]
    x = [float(i) * 0.5 + 0.25 for i in range(CAPACITY)]
    y = [1.0 / (i + 3) for i in range(CAPACITY)]
    host_x = struct.pack(f"{CAPACITY}f", *x)
    host_y = struct.pack(f"{CAPACITY}f", *y)
    x32 = struct.unpack(f"{CAPACITY}f", host_x)
    y32 = struct.unpack(f"{CAPACITY}f", host_y)
    # The sum of two float32 values is exact in double; rounding it once to float32 is
    # exactly what the GPU's fp32 add (round to nearest even) produces.
    expected = struct.unpack(
        f"{CAPACITY}f", struct.pack(f"{CAPACITY}f", *[a + b for a, b in zip(x32, y32, strict=True)])
    )
    _ok(driver.cuMemcpyHtoD(buffers[0], host_x, nbytes), "HtoD x")
    _ok(driver.cuMemcpyHtoD(buffers[1], host_y, nbytes), "HtoD y")
    nan_fill = struct.pack(f"{CAPACITY}f", *([math.nan] * CAPACITY))
    for n in SIZES:
        _ok(driver.cuMemcpyHtoD(buffers[2], nan_fill, nbytes), "HtoD nan")
        args = [ctypes.c_uint64(int(b)) for b in buffers] + [ctypes.c_int(n)]
        arg_ptrs = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
        blocks = (n + 255) // 256
        _ok(
            driver.cuLaunchKernel(
                function, blocks, 1, 1, 256, 1, 1, 0, 0, ctypes.addressof(arg_ptrs), 0
            ),
            "launch",
        )
        _ok(driver.cuCtxSynchronize(), "sync")
        out = bytearray(nbytes)
        _ok(driver.cuMemcpyDtoH(out, buffers[2], nbytes), "DtoH")
        values = struct.unpack(f"{CAPACITY}f", bytes(out))
        exact = all(values[i] == expected[i] for i in range(n))
        untouched = all(math.isnan(v) for v in values[n:])
        failures += not (exact and untouched)
        mismatch = next((i for i in range(n) if values[i] != expected[i]), None)
        print(
            json.dumps(
                {
                    "check": "launch",
                    "n": n,
                    "exact": exact,
                    "tail_untouched": untouched,
                    "first_mismatch": None
                    if mismatch is None
                    else [mismatch, values[mismatch], expected[mismatch]],
                }
            )
        )
    try:
        load_checked(outdir / "add_sm_80.cubin")
        refused, message = False, "loaded"
    except RuntimeError as exc:
        refused, message = True, str(exc)
    failures += not refused
    print(json.dumps({"check": "wrong_arch_refused", "refused": refused, "message": message}))
    # What the driver itself says about it, for the record.
    driver_says = driver.cuModuleLoadData((outdir / "add_sm_80.cubin").read_bytes())[0]
    print(json.dumps({"check": "driver_on_sm80_cubin", "result": repr(driver_says)}))
    print(json.dumps({"check": "summary", "device": f"sm_{device_sm}", "failures": failures}))
    return failures


if __name__ == "__main__":
    phase, where = sys.argv[1], Path(sys.argv[2])
    sys.exit(build(where) if phase == "build" else (1 if run(where) else 0))
