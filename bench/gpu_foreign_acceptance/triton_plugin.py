"""pytest plugin (``-p triton_plugin``): Triton's own tests under kcache's cache manager.

``TRITON_CACHE_MANAGER=kcache_client.triton:CacheManager`` is set by the caller (run.sh);
this plugin counts, per test, the groups Triton's compile handed the manager
(``put_group``: a compile happened) and what kcache's lookups did, writes them to
``$ACCEPT_OUT/<tag>.json``, and waits for the queued publishes at the end.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from typing import Any

import pytest

_state: dict[str, Any] = {"tests": {}, "groups": Counter()}


def pytest_configure(config: pytest.Config) -> None:
    if "kcache_client" not in os.environ.get("TRITON_CACHE_MANAGER", ""):
        return
    from kcache_client import triton as hook

    real_put, real_get = hook.CacheManager.put_group, hook.CacheManager.get_group

    def put_group(self: Any, filename: str, group: Any) -> Any:
        _state["groups"]["put_group"] += 1
        return real_put(self, filename, group)

    def get_group(self: Any, filename: str) -> Any:
        found = real_get(self, filename)
        _state["groups"]["get_group:" + ("found" if found else "none")] += 1
        return found

    hook.CacheManager.put_group = put_group
    hook.CacheManager.get_group = get_group


def _snapshot() -> Counter[str]:
    from kcache_client import triton as hook

    snap = Counter(_state["groups"])
    if hook._foreign is not None:
        snap.update({f"kcache:{k}": v for k, v in hook._foreign.counts.items()})
    return snap


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: Any) -> Any:
    before = _snapshot()
    yield
    delta = _snapshot()
    delta.subtract(before)
    _state["tests"][item.nodeid] = {k: v for k, v in delta.items() if v}


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    from kcache_client import triton as hook

    flushed = hook._foreign.flush(120) if hook._foreign is not None else None
    out = os.environ.get("ACCEPT_OUT")
    if out:
        tag = os.environ.get("ACCEPT_TAG", "triton")
        with open(os.path.join(out, f"{tag}.json"), "w") as f:
            json.dump(
                {"flushed": flushed, "totals": dict(_snapshot()), "tests": _state["tests"]},
                f,
                indent=1,
            )
