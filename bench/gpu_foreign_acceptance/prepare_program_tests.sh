#!/usr/bin/env bash
# Fill .device/ (git-ignored) for run_program_tests.sh, here, from the repository root:
#  - .device/whl, .device/meta: the server's wheels and the distributions' egg-info
#    (device_wheels.sh, as for prepare.sh);
#  - .device/cuda_core_tests/test_program.py: cuda-python's cuda_core/tests/test_program.py,
#    copied there by hand (never committed); bench/RESULTS.md names the version used.
set -euo pipefail
mkdir -p .device/cuda_core_tests
source bench/gpu_foreign_acceptance/device_wheels.sh
test -f .device/cuda_core_tests/test_program.py || echo "copy cuda-python's cuda_core/tests/test_program.py to .device/cuda_core_tests/" >&2
