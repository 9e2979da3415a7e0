"""Without a GPU, what needs one says so in one typed line (issue 45).

``Artifact.load()`` raised cuda.pathfinder's ``DynamicLibNotFoundError`` from under
cuda.core's ``cuInit`` (a 25-line traceback), and the torch adapter torch's bare
``AssertionError: Torch not compiled with CUDA enabled``. Both are now
:class:`NoDeviceError`, as ``target="auto"`` gives. The kernels are compiled here by the
real NVRTC (no GPU needed); the tests run where no driver is usable (this CI machine, a
CPU-only torch) and skip where one is.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from kcache_client import ClientSettings, KernelCache, NoDeviceError
from kcache_client._artifact import Artifact
from kcache_client._device import driver_version

from kcache import Recipe

SOURCE = 'extern "C" __global__ void twice(float* x) { x[threadIdx.x] *= 2.0f; }\n'

needs_no_gpu = pytest.mark.skipif(
    driver_version() is not None, reason="a CUDA driver is usable here: the GPU tests cover it"
)


def _artifact(cache_dir: Path) -> Artifact:
    settings = ClientSettings.from_env(url="", send_events=False, local_compile=True)
    with KernelCache(cache_dir=cache_dir, settings=settings) as cache:
        return cache.get(Recipe(source=SOURCE, target="sm_80"))


@needs_no_gpu
def test_load_without_a_gpu_is_one_typed_line(tmp_path: Path) -> None:
    pytest.importorskip("cuda.core")
    art = _artifact(tmp_path)
    for call in (art.load, art.load_module, lambda: art.load(device=3)):
        with pytest.raises(NoDeviceError) as caught:
            call()
        message = str(caught.value)
        assert "\n" not in message
        assert message.startswith("Artifact.load() needs ")
        assert "NVIDIA GPU" in message and "driver" in message
        # the cause is named in the line, not as a chained traceback
        assert caught.value.__cause__ is None and caught.value.__suppress_context__
    with pytest.raises(NoDeviceError, match=r"needs device 3 "):
        art.load(device=3)


def test_the_torch_adapter_on_a_cpu_torch_is_no_device_error(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("torch sees a GPU here")
    from kcache_client.torch import Kernel, launch

    art = _artifact(tmp_path)
    x = torch.ones(4)
    for call in (
        lambda: Kernel(art, signature=("float*",))(1, 4, x),
        lambda: launch(art, 1, 4, x, signature=("float*",)),
    ):
        with pytest.raises(NoDeviceError) as caught:
            call()
        message = str(caught.value)
        assert not isinstance(caught.value, AssertionError)
        assert "\n" not in message
        assert "torch's current CUDA device, and there is none" in message
        if torch.version.cuda is None:  # this machine's torch: a CPU build
            assert f"torch {torch.__version__} is a CPU-only build" in message
            assert "Torch not compiled with CUDA enabled" in message
