"""pytest plugin (``-p cuda_core_plugin``): cuda.core's ``Program.compile(cache=)`` tests.

Gives the ``init_cuda`` fixture of cuda.core's own ``tests/conftest.py`` (the current
device made current). With ``KCACHE_CUDA_CORE=1``, the tests' ``FileStreamProgramCache``
(the resource they open with a directory) is kcache's ``ProgramCache`` instead: each
open is a new process's view of the fleet, a ``KernelCache`` with an empty node tier of
its own (``$KCACHE_CACHE_DIR/<n>``), so what a reopened cache finds came from the
server. Counters go to ``$ACCEPT_OUT/<tag>.json``.
"""

from __future__ import annotations

import itertools
import json
import os
from collections import Counter
from typing import Any

import pytest

_opened: list[Any] = []
_serial = itertools.count()


def _kcache_resource(path: Any = None, **_: Any) -> Any:
    from kcache_client import KernelCache
    from kcache_client.cuda_core import ProgramCache

    root = os.environ["KCACHE_CACHE_DIR"]
    cache = KernelCache(
        os.environ["KCACHE_URL"], os.environ["KCACHE_TOKEN"], os.path.join(root, str(next(_serial)))
    )
    resource = ProgramCache(cache)
    _opened.append(resource)
    return resource


@pytest.fixture
def init_cuda() -> Any:
    from cuda.core import Device

    device = Device()
    device.set_current()
    yield device


def pytest_collection_modifyitems(session: pytest.Session, config: Any, items: list[Any]) -> None:
    if os.environ.get("KCACHE_CUDA_CORE") != "1":
        return
    for module in {item.module for item in items if hasattr(item, "module")}:
        if hasattr(module, "FileStreamProgramCache"):
            module.FileStreamProgramCache = _kcache_resource


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    out = os.environ.get("ACCEPT_OUT")
    if not out:
        return
    totals: Counter[str] = Counter()
    for resource in _opened:
        totals.update(resource.foreign.counts)
    tag = os.environ.get("ACCEPT_TAG", "cuda_core")
    with open(os.path.join(out, f"{tag}.json"), "w") as f:
        json.dump({"opened": len(_opened), "totals": dict(totals)}, f, indent=1)
