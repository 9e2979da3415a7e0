#!/usr/bin/env bash
# Fill .device/ (git-ignored) for run.sh, here, from the repository root:
#  - .device/whl: the server's dependencies that the GPU image lacks, as py3.12 wheels;
#  - .device/meta: the three distributions' egg-info (their entry points: `kcache serve`);
#  - .device/cupy: CuPy v14.2.0's pytest settings and tests/conftest.py, and its
#    core_tests test_raw.py, test_elementwise.py, test_reduction.py, from a CuPy git
#    directory (CUPY_GIT, e.g. the search tool's `fetch github:cupy/cupy`).
# .device/triton (python/test/unit/runtime/test_cache.py and python/test/unit/conftest.py
# of triton-lang/triton) and .device/cuda_core (cuda_core/tests' Program.compile(cache=)
# tests of NVIDIA/cuda-python) are copied there by hand: bench/RESULTS.md names the
# versions used. Then call the device with carry [".device"] and the command
# `bash bench/gpu_foreign_acceptance/run.sh`.
set -euo pipefail
CUPY_GIT=${CUPY_GIT:?the git directory of a CuPy clone}
mkdir -p .device/cupy/tests/cupy_tests/core_tests .device/triton .device/cuda_core
source bench/gpu_foreign_acceptance/device_wheels.sh
for f in tests/conftest.py tests/cupy_tests/__init__.py tests/cupy_tests/core_tests/__init__.py \
  tests/cupy_tests/core_tests/test_raw.py tests/cupy_tests/core_tests/test_elementwise.py \
  tests/cupy_tests/core_tests/test_reduction.py; do
  git --git-dir="$CUPY_GIT" show "v14.2.0:$f" >".device/cupy/$f"
done
git --git-dir="$CUPY_GIT" show v14.2.0:pyproject.toml | .venv/bin/python -c '
import json, sys, tomllib
ini = tomllib.loads(sys.stdin.read())["tool"]["pytest"]["ini_options"]
print("[tool.pytest.ini_options]")
for key, value in ini.items():
    print(f"{key} = {json.dumps(value)}")' >.device/cupy/pyproject.toml
