"""pytest plugin (``-p program_plugin``): cuda.core's own ``tests/test_program.py``, stock or
with kcache's ``Program`` swapped in.

What cuda.core's ``tests/conftest.py`` gives that file is given here (CUDA initialised
once, ``init_cuda`` making the device current and popping its context afterwards, the
``agent_authored`` and ``thread_unsafe`` marks), so only the test file itself is needed.
It asks for ``cuda_python_test_helpers.nvvm_bitcode`` (a package of cuda-python's
repository, not of any wheel): when that cannot be imported, a stand-in with the same
``minimal_nvvmir`` fixture is put in its place, whose text form is a minimal NVVM IR
kernel and whose static-bitcode form skips (this stand-in carries no bitcode), in the
stock and the kcache runs alike.

With ``KCACHE_PROGRAM=1`` every module that imported cuda.core's ``Program`` gets
``kcache_client.cuda_core.Program`` under that name, wrapped to note, per test, which
compiles went through kcache and which kcache handed to cuda.core's own Program (a
bypass, with its reason). The notes go to ``$ACCEPT_OUT/<ACCEPT_TAG>-routes.json``.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import types
from collections import Counter, defaultdict
from typing import Any

import pytest

_current_test = "(collection)"
_routes: dict[str, Counter[str]] = defaultdict(Counter)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "agent_authored(model): who wrote the test (cuda-python)")
    config.addinivalue_line("markers", "thread_unsafe(reason): not for parallel threads")
    _install_nvvm_bitcode_stand_in()


# --------------------------------------------------------------------- cuda.core's conftest
@pytest.fixture(scope="session", autouse=True)
def session_setup() -> None:
    from cuda.bindings import driver
    from cuda.core._utils.cuda_utils import handle_return

    handle_return(driver.cuInit(0))


@pytest.fixture
def init_cuda() -> Any:
    from cuda.bindings import driver
    from cuda.core import Device
    from cuda.core._utils.cuda_utils import handle_return

    device = Device()
    device.set_current()
    yield device
    if int(handle_return(driver.cuCtxGetCurrent())) != 0:
        handle_return(driver.cuCtxPopCurrent())
        from cuda.core import _device

        if hasattr(_device._tls, "devices"):
            del _device._tls.devices


def _install_nvvm_bitcode_stand_in() -> None:
    """``cuda_python_test_helpers.nvvm_bitcode``, or a stand-in giving ``minimal_nvvmir``."""
    try:
        importlib.import_module("cuda_python_test_helpers.nvvm_bitcode")
        return
    except ImportError:
        pass

    @pytest.fixture(params=("txt", "bitcode_static"))
    def minimal_nvvmir(request: pytest.FixtureRequest) -> bytes:
        from cuda.bindings import nvvm

        if request.param != "txt":
            pytest.skip("the stand-in for cuda_python_test_helpers carries no static bitcode")
        major, _minor, debug_major, _debug_minor = nvvm.ir_version()
        layout = (
            "e-p:64:64:64-i1:8:8-i8:8:8-i16:16:16-i32:32:32-i64:64:64-i128:128:128"
            "-f32:32:32-f64:64:64-v16:16:16-v32:32:32-v64:64:64-v128:128:128-n16:32:64"
        )
        return (
            f'target datalayout = "{layout}"\n'
            'target triple = "nvptx64-nvidia-cuda"\n\n'
            "define void @kernel() {\nentry:\n  ret void\n}\n\n"
            "!nvvm.annotations = !{!0}\n"
            '!0 = !{void ()* @kernel, !"kernel", i32 1}\n\n'
            "!nvvmir.version = !{!1}\n"
            f"!1 = !{{i32 {major}, i32 0, i32 {debug_major}, i32 0}}\n"
        ).encode()

    package = types.ModuleType("cuda_python_test_helpers")
    package.__path__ = []
    module = types.ModuleType("cuda_python_test_helpers.nvvm_bitcode")
    module.minimal_nvvmir = minimal_nvvmir  # type: ignore[attr-defined]
    package.nvvm_bitcode = module  # type: ignore[attr-defined]
    sys.modules["cuda_python_test_helpers"] = package
    sys.modules["cuda_python_test_helpers.nvvm_bitcode"] = module


# --------------------------------------------------------------------- kcache's Program
def _recording_program() -> type:
    from kcache_client.cuda_core import Program

    class RecordingProgram(Program):  # type: ignore[misc]
        """kcache's Program, noting per test where each compile went."""

        def compile(self, *args: Any, **kwargs: Any) -> Any:
            try:
                result = super().compile(*args, **kwargs)
            except BaseException as exc:
                _routes[_current_test][f"raised {type(exc).__name__}"] += 1
                raise
            bypass = self.last_bypass
            route = "kcache" if bypass is None else f"bypass {bypass.reason}"
            _routes[_current_test][route] += 1
            return result

    RecordingProgram.__name__ = "Program"
    return RecordingProgram


def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    if os.environ.get("KCACHE_PROGRAM") != "1":
        return
    from cuda.core._program import Program as CoreProgram

    swapped = _recording_program()
    for module in {item.module for item in items if getattr(item, "module", None)}:  # type: ignore[attr-defined]
        if getattr(module, "Program", None) is CoreProgram:
            module.Program = swapped


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    global _current_test
    _current_test = item.nodeid


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    out = os.environ.get("ACCEPT_OUT")
    if not out or os.environ.get("KCACHE_PROGRAM") != "1":
        return
    totals: Counter[str] = Counter()
    for counts in _routes.values():
        totals.update(counts)
    tag = os.environ.get("ACCEPT_TAG", "program")
    with open(os.path.join(out, f"{tag}-routes.json"), "w") as f:
        json.dump(
            {"totals": dict(totals), "tests": {t: dict(c) for t, c in sorted(_routes.items())}},
            f,
            indent=1,
        )
