"""``ClientSettings``: one object for everything a ``KernelCache`` is told, and how it is read."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from kcache_client import ClientSettings, KernelCache, RetryPolicy

from kcache.errors import KCacheError


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("KCACHE_URL", "KCACHE_TOKEN", "KCACHE_LOCAL_COMPILE", "KCACHE_CACHE_MAX_BYTES"):
        monkeypatch.delenv(name, raising=False)


def test_arguments_override_the_environment_which_overrides_defaults(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("KCACHE_URL", "http://env:1")
    monkeypatch.setenv("KCACHE_CACHE_DIR", str(tmp_path / "env-tier"))
    monkeypatch.setenv("KCACHE_CACHE_MAX_BYTES", "2MiB")
    env = ClientSettings.from_env()
    assert (env.url, env.cache_dir, env.cache_max_bytes) == (
        "http://env:1",
        tmp_path / "env-tier",
        2 << 20,
    )
    given = ClientSettings.from_env(url=" http://arg:2 ", cache_max_bytes="1KiB", device=3)
    assert (given.url, given.cache_max_bytes, given.device) == ("http://arg:2", 1024, 3)
    assert given.retry == RetryPolicy() and given.timeout.connect == 5.0


def test_local_compiles_default_to_on_exactly_without_a_server(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert ClientSettings.from_env().compiles_locally
    assert not ClientSettings.from_env(url="http://x:1").compiles_locally
    # The default follows the server the settings end up with, not the one they started with.
    assert not ClientSettings.from_env().located(url="http://x:1").compiles_locally
    assert ClientSettings.from_env(url="http://x:1", local_compile=True).compiles_locally
    monkeypatch.setenv("KCACHE_LOCAL_COMPILE", "0")
    assert not ClientSettings.from_env().compiles_locally
    monkeypatch.setenv("KCACHE_LOCAL_COMPILE", "ture")
    with pytest.raises(KCacheError, match="KCACHE_LOCAL_COMPILE"):
        ClientSettings.from_env()


@pytest.mark.parametrize(
    ("fields", "word"),
    [
        ({"memory_entries": 0}, "memory_entries"),
        ({"lock_timeout_s": 0.0}, "lock_timeout_s"),
        ({"cache_max_bytes": -1}, "cache_max_bytes"),
    ],
)
def test_impossible_values_are_refused_by_name(fields: dict[str, object], word: str) -> None:
    with pytest.raises(KCacheError, match=word):
        ClientSettings(**fields)  # type: ignore[arg-type]


def test_kernel_cache_takes_its_settings_and_the_shorthands_override_them(
    tmp_path: Path,
) -> None:
    settings = ClientSettings.from_env(
        url="http://settings:1",
        auto_target="sm_86",
        send_events=False,
        timeout=httpx.Timeout(7.0),
    )
    with KernelCache("http://given:2", cache_dir=tmp_path, settings=settings) as cache:
        assert cache.url == cache.settings.url == "http://given:2"
        assert cache.tier.root == tmp_path and cache.events is None
        assert cache.auto_target() == "sm_86" and cache.settings.timeout.read == 7.0
    with KernelCache(cache_dir=tmp_path, settings=settings) as kept:
        assert kept.url == "http://settings:1"
