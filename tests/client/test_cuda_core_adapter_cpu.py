"""The cuda.core adapter compiles as cuda.core's own ``Program.compile`` does: without a GPU,
returning an ``ObjectCode`` named by ``ProgramOptions.name``.

Before, ``compile("cubin")`` loaded the module to check its architecture, so a GPU-less CI
or an ahead-of-time build failed where cuda.core's own compile works, and the returned
``ObjectCode`` was named after the kernel, not the program's ``name`` ("42" in cuda.core's
own test). This machine has no GPU: the test runs here, in CI.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from kcache_client import ClientSettings, KernelCache

SOURCE = 'extern "C" __global__ void add(float* x) { x[threadIdx.x] += 1.0f; }\n'


@pytest.mark.parametrize("kind", ["cubin", "ptx", "ltoir"])
def test_compile_needs_no_gpu_and_keeps_the_programs_name(tmp_path: Path, kind: str) -> None:
    pytest.importorskip("cuda.core")
    from kcache_client.cuda_core import Program

    settings = ClientSettings.from_env(send_events=False)
    with KernelCache(cache_dir=tmp_path, settings=settings) as cache:
        program = Program(SOURCE, "c++", options={"name": "42", "arch": "sm_90"}, cache=cache)
        code = program.compile(kind)
        artifact = cache.get(program.recipe(kind, []))
    assert code.name == "42" and code.code_type == kind
    assert bytes(code.code) == artifact.data  # the stored bytes, not a compile of its own
