"""``pytest -m gpu`` collects where the test-only schema packages are missing (the GPU image).

The GPU machines run the GPU tests from an image without ``jsonschema`` and
``schemathesis`` (nor ``jsonschema_rs``, which schemathesis brings). Collecting the
tree imports every test module, so one module importing them at its top stopped the
whole collection there. The modules that need them import them where they are used, or
skip at collection; this runs the collection in a subprocess where importing them
fails as it does when they are not installed.
"""

from __future__ import annotations

import subprocess
import sys

from tests.support import ROOT

#: The packages the GPU image lacks, made unimportable in the subprocess.
MISSING = ("jsonschema", "jsonschema_rs", "schemathesis")

#: ``pytest ARGS`` with every import of :data:`MISSING` (or a submodule) failing.
_BLOCKED_PYTEST = """
import sys
from importlib.abc import MetaPathFinder

missing = set(sys.argv[1].split(","))


class NotInstalled(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in missing:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, NotInstalled())
import pytest

sys.exit(pytest.main(sys.argv[2:]))
"""


def test_gpu_tests_collect_without_the_schema_packages() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            _BLOCKED_PYTEST,
            ",".join(MISSING),
            "--collect-only",
            "-q",
            "-m",
            "gpu",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:schemathesis",  # its pytest plugin is not there when it is not installed
            str(ROOT / "tests"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]  # 2: a module failed to import
    collected = [line for line in result.stdout.splitlines() if "::" in line]
    assert collected and all("test_gpu" in line for line in collected), out[-4000:]
