"""A process that only gets kernels loads none of the job façade (a first launch, B7).

``KernelCache`` imports :mod:`kcache_client._jobs` (and with it the warmup, the
collectives and the fan-out) when a job's step is first called, not before: a fresh
process makes a cache, runs ``get`` and the get path's own calls, and none of those
modules is loaded until ``job_manifest`` asks for them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.cli_harness import user_env

JOB_MODULES = (
    "kcache_client._jobs",
    "kcache_client._warmup",
    "kcache_client._fanout",
    "kcache_client._collective",
)

PROBE = """
import json, sys
from kcache import Recipe
from kcache_client import KernelCache, ServerUnavailableError

JOB_MODULES = {modules!r}
cache = KernelCache()  # no server: the get path runs through memory and the tier to its end
recipe = Recipe(source='extern "C" __global__ void k(float* x) {{ x[0] = 1; }}', target="sm_80",
                toolchain="nvrtc-test")
try:
    cache.get(recipe, compile=False)
except ServerUnavailableError:
    pass
cache.freeze("warn")
seen = {{"frozen": cache.frozen, "kernels": len(cache.manifest().kernels)}}
cache.check_withdrawals()
cache.forget_memory()
seen["after_get"] = [m for m in JOB_MODULES if m in sys.modules]
try:
    cache.job_manifest("job-1")
except ServerUnavailableError:
    pass
seen["after_job_manifest"] = [m for m in JOB_MODULES if m in sys.modules]
print(json.dumps(seen))
"""


def test_get_loads_none_of_the_job_facade_until_a_job_step_is_called(tmp_path: Path) -> None:
    probe = PROBE.format(modules=JOB_MODULES)
    out = subprocess.run(
        [sys.executable, "-c", probe],
        env=user_env(tmp_path),
        capture_output=True,
        text=True,
        check=True,
    )
    seen = json.loads(out.stdout)
    assert seen["frozen"] == "warn" and seen["kernels"] == 0
    assert seen["after_get"] == []
    assert seen["after_job_manifest"] == list(JOB_MODULES)
