"""pytest plugin (``-p cupy_plugin``): CuPy's own tests with kcache's ``KernelCacheBackend``.

The pattern of CuPy's CI (``tests/conftest.py`` under ``CUPY_CI_ENABLE_GCP_KERNEL_CACHE``
sets a remote backend before any test runs), with kcache's backend: installed when
``KCACHE_CUPY_BACKEND=1``, from the environment's ``KCACHE_URL``/``KCACHE_TOKEN``/
``KCACHE_CACHE_DIR``. With or without it, the plugin counts per test what CuPy really
compiled (``_compile_using_nvrtc_no_warning`` and ``compile_using_nvcc`` calls) and,
with the backend, what kcache's lookups did (the ``ForeignCache`` counters and the
compiles kept off the fleet), and writes them to ``$ACCEPT_OUT/<tag>-<worker>.json``.
At the end it waits for the backend's queued publishes, so the next process finds them.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from typing import Any

import pytest

_state: dict[str, Any] = {"backend": None, "tests": {}, "compiles": Counter()}


def _count_compiles() -> None:
    from cupy.cuda import compiler

    for name in ("_compile_using_nvrtc_no_warning", "compile_using_nvcc"):
        real = getattr(compiler, name)

        def counted(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            # CuPy's nvcc backend also runs nvcc on an empty file once per process and
            # options (its key's compiler fingerprint): counted apart, it is not a compile
            # a cache could have saved.
            preprocess = len(args) > 3 and args[3] == "preprocess.cu"
            _state["compiles"][_name + (":preprocess" if preprocess else "")] += 1
            return _real(*args, **kwargs)

        setattr(compiler, name, counted)


def pytest_configure(config: pytest.Config) -> None:
    _count_compiles()
    if os.environ.get("KCACHE_CUPY_BACKEND") == "1":
        from kcache_client._cupy_backend import install_backend

        _state["backend"] = install_backend()


def _snapshot() -> Counter[str]:
    snap: Counter[str] = Counter({f"compile:{k}": v for k, v in _state["compiles"].items()})
    backend = _state["backend"]
    if backend is not None:
        snap.update({f"kcache:{k}": v for k, v in backend.foreign.counts.items()})
        snap.update({f"unshared:{k}": v for k, v in backend.unshared.items()})
    return snap


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: Any) -> Any:
    before = _snapshot()
    yield
    delta = _snapshot()
    delta.subtract(before)
    _state["tests"][item.nodeid] = {k: v for k, v in delta.items() if v}


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    backend = _state["backend"]
    flushed = None
    if backend is not None:
        flushed = backend.foreign.flush(120)
    out = os.environ.get("ACCEPT_OUT")
    if not out:
        return
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    tag = os.environ.get("ACCEPT_TAG", "cupy")
    totals = _snapshot()
    with open(os.path.join(out, f"{tag}-{worker}.json"), "w") as f:
        json.dump(
            {"flushed": flushed, "totals": dict(totals), "tests": _state["tests"]}, f, indent=1
        )
