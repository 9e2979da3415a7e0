# Sourced by prepare.sh and prepare_program_tests.sh, here, from the repository root: fills
# .device/whl with the py3.12 wheels of the server's dependencies that the GPU image lacks,
# and .device/meta with the three distributions' egg-info (their entry points: `kcache
# serve`); device_server.sh installs and uses both there.
mkdir -p .device/whl .device/meta
.venv/bin/pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 -d .device/whl \
  fastapi starlette uvicorn httptools pydantic pydantic-core pydantic-settings python-dotenv \
  annotated-types typing-inspection opentelemetry-api typing-extensions sqlalchemy greenlet alembic mako cryptography cffi pycparser
cp -r kcache_core.egg-info client/kcache_client.egg-info server/kcache_server.egg-info .device/meta/
