"""B7 (GPU): first launch of a kernel in a fresh process, ms from "I need this kernel" to
its first launch finished, with the CUDA context already up in every variant.

    ours            KernelCache(cache_dir=tier).get(recipe).load(), then launch: a private node
                    tier (this user's, used as it is: no signature checked, no crypto imported),
                    filled by a warmup against a real server on the build machine and copied
    ours_shared     the same from a shared node tier (a copy of it, mode 1777): only entries
                    whose signature verifies by the fleet key (KCACHE_TRUSTED_KEYS, saved at
                    prepare from the server's GET /v1/keys) are used; a fresh home, no server,
                    where the user's earlier processes ran (signatures they verified are
                    remembered beside the pin file: kcache_client._verified)
    ours_shared_first  the same in the user's first process (a pin file's directory of its own
                    each round: every signature verified)
    nvrtc           NVRTC in-process (the GPU machine's own), cuModuleLoadData, launch
    cupy_cold       cupy.RawModule with an empty CUPY_CACHE_DIR (compiles)
    cupy_cached     cupy.RawModule with its disk cache already warm

Two phases, since the server and NVRTC 13.5 run on the build machine, the GPU elsewhere:

    python bench/b7_gpu_first_launch.py prepare DIR    # here: real server + warmup into DIR/tier
    python bench/b7_gpu_first_launch.py run DIR        # on the GPU machine (PYTHONPATH=.:client)

Each variant runs in ROUNDS fresh processes, the variants interleaved round by round; the
median is reported. Goals: ours (and ours_shared) >= 20 x faster than compiling (nvrtc),
and <= CuPy's cached path. Ours also reports its phases (median ms): ``KernelCache()``,
``get``, ``load``, the launch (on the default stream, as the nvrtc variant's).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

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
    TIER = os.environ["B7_TIER"]
    RECIPE = Recipe.from_dict(json.load(open(os.path.join(where, "recipe.json"))))
elif variant == "nvrtc":
    from cuda.bindings import nvrtc
phases = None
started = time.perf_counter()
if variant == "ours":
    quiet = ClientSettings.from_env(send_events=False)
    cache = KernelCache(cache_dir=TIER, settings=quiet)
    t_made = time.perf_counter()
    art = cache.get(RECIPE)
    t_got = time.perf_counter()
    kernel = art.load()
    t_loaded = time.perf_counter()
    # The default stream, as the nvrtc variant launches on (a new stream is the job's own cost).
    stream = Device().default_stream
    launch(stream, LaunchConfig(grid=4, block=256), kernel, *[int(b) for b in bufs], ctypes.c_int(n))
    stream.sync()
    t_launched = time.perf_counter()
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
    phases = {"cache": (t_made - started) * 1e3, "get": (t_got - t_made) * 1e3,
              "load": (t_loaded - t_got) * 1e3, "launch": (t_launched - t_loaded) * 1e3,
              "origin": art.origin, "standing": cache.tier.standing.kind,
              "cryptography": "cryptography" in sys.modules}
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
print(json.dumps({"ms": elapsed_ms, "exact": exact, "phases": phases}))
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
        import httpx

        keys = httpx.get(f"{url}/v1/keys", timeout=10).json()
        # The key the server signed with: what a fleet's images carry (KCACHE_TRUSTED_KEYS).
        where.mkdir(parents=True, exist_ok=True)
        (where / "fleet_key").write_text(keys["keys"][0]["public_key"] + "\n")
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
    return _launch(variant, where, env)[0]


def _launch(variant: str, where: Path, env: dict[str, str]) -> tuple[float, dict[str, Any] | None]:
    """One fresh process: its first-launch ms, and ours' phases."""
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            _CHILD,
            "ours" if variant.startswith("ours") else variant,
            str(where),
        ],
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
    return float(result["ms"]), result.get("phases")


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
    with tempfile.TemporaryDirectory() as scratch:
        # Both tiers are copies of the prepared one in the machine's temporary directory, where
        # a node's cache lives (a local disk), not in the carried working tree (whatever
        # filesystem that is mounted on): the private one as this user has it, the shared one
        # mode 1777 (a team's), signed entries only.
        private = Path(scratch) / "private-tier"
        shared = Path(scratch) / "shared-tier"
        for tier in (private, shared):
            shutil.copytree(where / "tier", tier, symlinks=True)
        os.chmod(shared, 0o1777)
        fresh_home = Path(scratch) / "home"
        fresh_home.mkdir()
        tiers = {"ours": str(private), "ours_shared": str(shared)}
        for name in KERNELS:
            _run_kernel(name, where / name, tiers, where, fresh_home)


def _run_kernel(name: str, where: Path, tiers: dict[str, str], prepared: Path, home: Path) -> None:
    base = {
        **{k: v for k, v in os.environ.items() if k not in ("KCACHE_URL", "KCACHE_TRUSTED_KEYS")},
        "PYTHONPATH": f"{Path.cwd()}:{Path.cwd() / 'client'}",
        "B7_INCLUDES": _cuda_includes(),
        # A fresh home: nothing pinned, nothing configured but what each variant says.
        "KCACHE_KNOWN_SERVERS": str(home / "known_servers.json"),
        "XDG_CONFIG_HOME": str(home / "config"),
    }
    fleet_key = (prepared / "fleet_key").read_text().strip()
    ours_env = {
        "ours": {"B7_TIER": tiers["ours"]},
        "ours_shared": {"B7_TIER": tiers["ours_shared"], "KCACHE_TRUSTED_KEYS": fleet_key},
    }
    ours_env["ours_shared_first"] = ours_env["ours_shared"]
    variants = ["ours", "ours_shared", "ours_shared_first", "nvrtc", "cupy_cold", "cupy_cached"]
    times: dict[str, list[float]] = {variant: [] for variant in variants}
    phases: dict[str, list[dict[str, Any]]] = {v: [] for v in ours_env}
    with tempfile.TemporaryDirectory() as cupy_warm:
        warm_env = {**base, "CUPY_CACHE_DIR": cupy_warm}
        errors: dict[str, str] = {}
        try:
            _first_launch("cupy_cached", where, warm_env)  # fills CuPy's disk cache once
        except RuntimeError as exc:
            errors["cupy"] = str(exc)[-300:]
            variants = [v for v in variants if not v.startswith("cupy")]
        # Interleaved rounds: each round runs every variant once, so a machine whose speed
        # drifts during the run moves ours and its anchors alike.
        for _ in range(ROUNDS):
            for variant in variants:
                if variant == "cupy_cold":
                    with tempfile.TemporaryDirectory() as empty:
                        ms = _first_launch(variant, where, {**base, "CUPY_CACHE_DIR": empty})
                elif variant in ours_env:
                    with tempfile.TemporaryDirectory() as first_home:
                        env = {**warm_env, **ours_env[variant]}
                        if variant == "ours_shared_first":
                            env["KCACHE_KNOWN_SERVERS"] = f"{first_home}/known_servers.json"
                        ms, seen = _launch(variant, where, env)
                    if seen is not None:
                        phases[variant].append(seen)
                else:
                    ms = _first_launch(variant, where, warm_env)
                times[variant].append(ms)
    medians = {variant: statistics.median(seen) for variant, seen in times.items() if seen}
    suffixes = {
        "ours": "",
        "ours_shared": ".shared_signed_tier",
        "ours_shared_first": ".shared_signed_tier.users_first_process",
    }
    for variant, tier in (
        ("ours", "private"),
        ("ours_shared", "shared"),
        ("ours_shared_first", "shared"),
    ):
        seen = phases[variant]
        emit(
            f"B7.{name}.first_launch.vs_nvrtc_ms" + suffixes[variant],
            medians[variant],
            medians["nvrtc"],
            "ms",
            speedup=round(medians["nvrtc"] / medians[variant], 1),
            goal=">= 20 x faster",
            tier=tier,
            phases_ms={
                phase: round(statistics.median(p[phase] for p in seen), 3)
                for phase in ("cache", "get", "load", "launch")
            }
            if seen
            else None,
            origins=sorted({p["origin"] for p in seen}),
            standing=sorted({p["standing"] for p in seen}),
            imported_cryptography=any(p["cryptography"] for p in seen),
        )
    for variant, goal in (("cupy_cold", None), ("cupy_cached", "ours <= cupy cached")):
        if variant in medians:
            emit(
                f"B7.{name}.first_launch.vs_{variant}_ms",
                medians["ours"],
                medians[variant],
                "ms",
                goal=goal,
                ours_shared_ms=round(medians["ours_shared"], 3),
                ours_shared_first_ms=round(medians["ours_shared_first"], 3),
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
