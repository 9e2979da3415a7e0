#!/usr/bin/env bash
# Fill .device/ (git-ignored) for run_program_tests.sh, here, from the repository root:
#  - .device/whl, .device/meta: the server's wheels and the distributions' egg-info, as
#    prepare.sh makes them (the same list);
#  - .device/cuda_core_tests/test_program.py: cuda-python's cuda_core/tests/test_program.py,
#    copied there by hand (never committed); bench/RESULTS.md names the version used.
set -euo pipefail
mkdir -p .device/whl .device/meta .device/cuda_core_tests
.venv/bin/pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 -d .device/whl \
  fastapi starlette uvicorn httptools pydantic pydantic-core pydantic-settings python-dotenv \
  annotated-types typing-inspection opentelemetry-api typing-extensions sqlalchemy greenlet alembic mako cryptography cffi pycparser
cp -r kcache_core.egg-info client/kcache_client.egg-info server/kcache_server.egg-info .device/meta/
test -f .device/cuda_core_tests/test_program.py || echo "copy cuda-python's cuda_core/tests/test_program.py to .device/cuda_core_tests/" >&2
