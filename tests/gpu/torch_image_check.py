"""GPU proof of local compiles in an image with torch's pinned CUDA wheels (one GPU).

    python3 tests/gpu/torch_image_check.py [WORKDIR]

For the GPU machines' image, whose torch 2.11 pins ``cuda-toolkit[nvrtc,nvjitlink]==13.0.2``
(NVRTC and nvJitLink 13.0.88), after kcache-core and kcache-client were installed with
what the ``compile`` extra brings (NVRTC 13.3 or later; nvJitLink as the image has it).
With torch imported first (it loads its own CUDA libraries), a ``KernelCache`` without a
server compiles a vector add for ``target="auto"`` with the local NVRTC, and
``kcache_client.torch.Kernel`` launches it on tensors: the sum must be exact. A recipe
with ``lto: true`` must be refused before compiling, by the field ``lto``, with the pip
command that installs an nvJitLink able to link this NVRTC's LTO-IR. Prints one JSON line
per check (the first says the versions); exits non-zero if any fails. torch_image_last_run.jsonl
beside it is the last run's output (an H200 in the GPU machines' image, kcache-client[compile]
installed from wheels with pip's --no-index --find-links).
"""

from __future__ import annotations

import json
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path

FAILURES: list[str] = []

ADD = """
extern "C" __global__ void add(const float* x, const float* y, float* out, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = x[i] + y[i];
}
"""


def check(name: str, run: Callable[[], dict[str, object]]) -> None:
    """Run one check; print its JSON line."""
    try:
        line = {"check": name, "ok": True, **run()}
    except Exception as exc:  # every failure is reported, then the next check runs
        FAILURES.append(name)
        line = {"check": name, "ok": False, "error": repr(exc), "trace": traceback.format_exc()}
    print(json.dumps(line), flush=True)


def main(workdir: Path) -> int:
    from importlib.metadata import version

    import torch  # first, as a training job does: torch loads its pinned CUDA libraries
    from kcache_client import ClientSettings, KernelCache
    from kcache_client.torch import Kernel

    from kcache import Recipe
    from kcache.errors import RecipeError
    from kcache.toolchain import load_toolchain

    toolchain = load_toolchain()

    def versions() -> dict[str, object]:
        names = ("torch", "cuda-toolkit", "nvidia-cuda-nvrtc", "nvidia-nvjitlink", "cuda-bindings")
        return {
            **{name: version(name) for name in names},
            "kcache-core": version("kcache-core"),
            "kcache_from": Recipe.__module__ and sys.modules["kcache"].__file__,  # installed
            "toolchain": toolchain.id,
            "links_lto": toolchain.links_lto,
            "device": torch.cuda.get_device_name(0),
        }

    check("versions", versions)
    settings = ClientSettings.from_env(cache_dir=str(workdir / "cache"))  # no server: local
    cache = KernelCache(settings=settings)

    def compile_and_launch() -> dict[str, object]:
        artifact = cache.get(Recipe(source=ADD, target="auto"))
        add = Kernel(artifact, signature=("const float*", "const float*", "float*", "int"))
        n = 1000
        x = torch.arange(n, device="cuda", dtype=torch.float32) * 0.5 + 0.25
        y = 1.0 / (torch.arange(n, device="cuda", dtype=torch.float32) + 3)
        out = torch.full((n,), float("nan"), device="cuda")
        add(((n + 255) // 256,), 256, x, y, out, n)
        torch.cuda.synchronize()
        assert torch.equal(out, x + y), "the kernel's sum differs from torch's"
        return {"origin": artifact.origin, "digest": artifact.digest, "n": n}

    check("plain recipe compiles and runs", compile_and_launch)

    def lto_refused() -> dict[str, object]:
        try:
            cache.get(Recipe(source=ADD, target="auto", lto=True))
        except RecipeError as exc:
            assert exc.field == "lto", exc.field
            assert "pip install 'nvidia-nvjitlink>=" in str(exc), str(exc)
            return {"refusal": str(exc)}
        if toolchain.links_lto:
            return {"refusal": None, "note": "this nvJitLink links LTO-IR: nothing to refuse"}
        raise AssertionError("an LTO recipe compiled beside an older nvJitLink")

    check("lto recipe refused by name", lto_refused)
    return len(FAILURES)


if __name__ == "__main__":
    where = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="kcache-"))
    sys.exit(1 if main(where) else 0)
