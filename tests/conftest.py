"""Fixtures shared by the whole test tree: the real toolchain and small kernels."""

from __future__ import annotations

import pytest

from kcache.toolchain import Toolchain, load_toolchain

VECTOR_ADD = """
extern "C" __global__ void add(const float* x, const float* y, float* out, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = x[i] + y[i];
}
"""


@pytest.fixture(scope="session")
def toolchain() -> Toolchain:
    """The real NVRTC/nvJitLink toolchain with its bundled headers (installed once)."""
    return load_toolchain()
