"""On a GPU: ``target="auto"`` from the driver, and ``Artifact.load()`` launching real kernels.

Run on the device machine: ``pytest -m gpu tests/client/test_gpu_load.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from client_harness import start_server
from kcache_client import ClientSettings, KernelCache, auto_target

from kcache import Recipe, load_toolchain

pytestmark = pytest.mark.gpu

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


def _gpu() -> tuple[Any, Any, Any]:
    torch = pytest.importorskip("torch")
    np = pytest.importorskip("numpy")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    try:
        import cuda.core as core

        if not hasattr(core, "launch"):
            raise ImportError
    except ImportError:
        core = pytest.importorskip("cuda.core.experimental")
    return torch, np, core


def _launch(core: Any, kernel: Any, n: int, *args: Any) -> None:
    dev = core.Device()
    dev.set_current()
    stream = dev.create_stream()
    config = core.LaunchConfig(grid=(n + 255) // 256, block=256)
    core.launch(stream, config, kernel, *args)
    stream.sync()


def test_warmup_then_load_launches_vector_add_exactly(tmp_path: Path) -> None:
    torch, np, core = _gpu()
    server = start_server(tmp_path / "server")
    try:
        recipe = Recipe(source=VECTOR_ADD)  # target "auto": this GPU
        with KernelCache(url=server.url, cache_dir=tmp_path / "tier") as cache:
            result = cache.warmup([recipe], progress=False)
            assert result.statuses == ["compiled"]
            art = cache.get(recipe)
            assert art.metadata.target == auto_target()
            kernel = art.load()
        for n in (1, 255, 256, 257, 1000):
            x = torch.randn(1024, device="cuda")
            y = torch.randn(1024, device="cuda")
            out = torch.full((1024,), float("nan"), device="cuda")
            _launch(
                core,
                kernel,
                n,
                np.uint64(x.data_ptr()),
                np.uint64(y.data_ptr()),
                np.uint64(out.data_ptr()),
                np.int32(n),
            )
            assert torch.equal(out[:n], x[:n] + y[:n])  # bit for bit
            assert torch.isnan(out[n:]).all()  # nothing written past n
    finally:
        server.stop()


def test_templated_kernel_loads_by_its_name_expression(tmp_path: Path) -> None:
    torch, np, core = _gpu()
    try:
        load_toolchain()
    except Exception as exc:  # an NVRTC older than the core needs (the image's own, say)
        pytest.skip(f"no usable local NVRTC: {exc}")
    recipe = Recipe(source=SCALE, name_expressions=["scale<float, 3>"])
    local = ClientSettings.from_env(local_compile=True)
    with KernelCache(cache_dir=tmp_path, settings=local) as cache:
        art = cache.get(recipe)
    assert art.metadata.target == auto_target()
    assert art.lowered_names["scale<float, 3>"].startswith("_Z")  # mangled, as NVRTC lowered it
    kernel = art.load()  # found through the stored lowered name
    x = torch.arange(300, dtype=torch.float32, device="cuda")
    _launch(core, kernel, 300, np.uint64(x.data_ptr()), np.int32(300))
    assert torch.equal(x, torch.arange(300, dtype=torch.float32, device="cuda") * 3)
