"""``KCACHE_OFFLINE=1``: a cache that sends nothing, answering from its node tier as the
server would have (as ``HF_HUB_OFFLINE`` does for the Hugging Face hub).

Before, the only way to run without the server was for the server to be down: 2.6-2.9 s
of retries per process before the tier answered. Offline, the same recipes (with no
explicit toolchain: keyed with the server's default the tier remembers) are answered from
the tier with not one request sent, the one line that says the server was not asked is
logged, and a kernel the tier lacks is an error naming the setting, at once.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from client_harness import KcacheServer, Proxy
from kcache_client import ClientSettings, KernelCache, ServerUnavailableError

from kcache import Recipe
from tests.support import FAST, unique


def _recipe(tag: str) -> Recipe:
    return Recipe(
        source=f'extern "C" __global__ void k_{tag}(float* x) {{ x[threadIdx.x] += 2.0f; }}\n',
        target="sm_90",
    )


def test_offline_answers_from_the_tier_without_a_request(
    proxy: Proxy, kserver: KcacheServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tag = unique("off").replace("-", "_")
    held, absent = _recipe(tag), _recipe(tag + "_absent")
    online = ClientSettings.from_env(retry=FAST, send_events=False)
    with KernelCache(proxy.url, cache_dir=tmp_path, settings=online) as cache:
        filled = cache.get(held)
    sent = proxy.count()
    assert sent > 0

    offline = ClientSettings.from_env(retry=FAST, offline=True, local_compile=False)
    caplog.set_level(logging.INFO, logger="kcache_client")
    with KernelCache(proxy.url, cache_dir=tmp_path, settings=offline) as cache:
        answered = cache.get(held)
        with pytest.raises(ServerUnavailableError, match="KCACHE_OFFLINE"):
            cache.get(absent)
    assert answered.digest == filled.digest and answered.origin == "node"
    assert proxy.count() == sent  # not one request, not even the withdrawal feed or events
    said = [r for r in caplog.records if "KCACHE_OFFLINE" in r.getMessage()]
    assert said and all(r.levelno == logging.INFO for r in said)  # as configured: no warning


def test_a_server_out_of_reach_is_one_warning_when_the_tier_answers(
    kserver: KcacheServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The tier answered a process whose server was down, after its retries, without a word."""
    held = _recipe(unique("down").replace("-", "_"))
    proxy = Proxy(kserver.url)
    settings = ClientSettings.from_env(retry=FAST, send_events=False, local_compile=False)
    with KernelCache(proxy.url, cache_dir=tmp_path, settings=settings) as cache:
        filled = cache.get(held)
    proxy.close()  # the server's URL now refuses connections
    caplog.set_level(logging.INFO, logger="kcache_client")
    with KernelCache(proxy.url, cache_dir=tmp_path, settings=settings) as cache:
        assert cache.get(held).digest == filled.digest
        assert cache.get(held).digest == filled.digest
    warned = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1 and proxy.url in warned[0].getMessage(), warned


def test_the_environment_turns_it_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KCACHE_OFFLINE", "1")
    assert ClientSettings.from_env().offline is True
    monkeypatch.setenv("KCACHE_OFFLINE", "maybe")
    with pytest.raises(Exception, match="KCACHE_OFFLINE"):
        ClientSettings.from_env()
