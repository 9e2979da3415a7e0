"""The node tier and the client without a reachable server: keying, local compiles, clear errors."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from kcache_client import (
    ClientSettings,
    KernelCache,
    NodeTier,
    NoDeviceError,
    ServerUnavailableError,
    auto_target,
)

from kcache import Recipe, load_toolchain
from kcache.artifact import ArtifactMeta
from tests.support import FAST, free_port


def _recipe(tag: str, **kw: object) -> Recipe:
    src = f'extern "C" __global__ void k_{tag}(float* x) {{ x[threadIdx.x] += 1.0f; }}\n'
    return Recipe(source=src, **kw)  # type: ignore[arg-type]


def _dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}"


def _settings(**kw: object) -> ClientSettings:
    return ClientSettings.from_env(retry=FAST, **kw)  # type: ignore[arg-type]


def test_a_corrupt_tier_blob_is_quarantined_and_reads_as_absent(tmp_path: Path) -> None:
    tier = NodeTier(tmp_path)
    data = b"\x7fELF" + bytes(range(200))
    digest = hashlib.sha256(data).hexdigest()
    meta = ArtifactMeta(digest=digest, size=len(data), kind="cubin", target="sm_80", toolchain="t")
    key, base = "a" * 64, "b" * 64
    path = tier.publish(key, base, meta, data)
    assert tier.lookup(key) == (tier.index.lookup(key), data)
    path.chmod(0o644)
    raw = bytearray(path.read_bytes())
    raw[10] ^= 0x01  # one flipped bit on disk
    path.write_bytes(bytes(raw))
    assert tier.lookup(key) is None  # never handed out
    assert not path.exists()
    assert [p.name.split(".")[0] for p in (tmp_path / "quarantine").iterdir()] == [digest]
    assert tier.index.lookup(key) is None  # the alias went with it, so the next get refetches


def test_auto_target_without_a_gpu_is_a_clear_error(tmp_path: Path) -> None:
    try:
        auto_target()
    except NoDeviceError:
        pass
    else:
        pytest.skip("this machine has a GPU")
    cache = KernelCache(url=_dead_url(), cache_dir=tmp_path, settings=_settings())
    with pytest.raises(NoDeviceError, match=r"GPU|device"):
        cache.key(_recipe("auto", toolchain="tc-1"))
    cache.close()


def test_auto_target_override_keys_like_an_explicit_target(tmp_path: Path) -> None:
    cache = KernelCache(_dead_url(), cache_dir=tmp_path, settings=_settings(auto_target="sm_80"))
    assert (
        cache.key(_recipe("x", toolchain="tc-1"))
        == _recipe("x", target="sm_80", toolchain="tc-1").key()
    )
    assert (
        cache.key(_recipe("x", toolchain="tc-1"))
        != _recipe("x", target="sm_90", toolchain="tc-1").key()
    )
    cache.close()


def test_unreachable_server_without_local_compile_names_url_and_cause(tmp_path: Path) -> None:
    url = _dead_url()
    cache = KernelCache(url, cache_dir=tmp_path, settings=_settings(local_compile=False))
    with pytest.raises(ServerUnavailableError) as info:
        cache.get(_recipe("nolocal", target="sm_80", toolchain="tc-1"))
    text = str(info.value)
    assert url in text and "ConnectError" in text and "local compiles are off" in text
    # Without a toolchain the key cannot even be computed offline; the error says why.
    with pytest.raises(ServerUnavailableError, match="default is not known"):
        cache.get(_recipe("nolocal", target="sm_80"))
    cache.close()


def test_offline_local_compile_fills_the_tier_for_every_later_process(tmp_path: Path) -> None:
    toolchain = load_toolchain().id
    url = _dead_url()
    recipe = _recipe("local", target="sm_80")
    with KernelCache(url, cache_dir=tmp_path, settings=_settings(local_compile=True)) as first:
        art = first.get(recipe)  # no toolchain in the recipe: the local NVRTC's id is used
        assert first.stats.local_compiles == 1 and art.origin == "local_compile"
        assert art.metadata.toolchain == toolchain
        assert art.data[:4] == b"\x7fELF" and hashlib.sha256(art.data).hexdigest() == art.digest
        assert art.path.read_bytes() == art.data
        again = first.get(recipe)
        assert again.origin == "memory" and again.data is art.data
        assert first.stats.memory_hits == 1
    # Another process (a fresh cache on the same directory), local compiles off: the tier answers.
    with KernelCache(url, cache_dir=tmp_path, settings=_settings(local_compile=False)) as second:
        again = second.get(recipe.with_defaults(toolchain=toolchain))
        assert again.digest == art.digest and again.data == art.data
        assert second.stats.node_hits == 1 and second.stats.local_compiles == 0
