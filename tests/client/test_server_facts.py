"""The server's default toolchain kept in the node tier, signed (kcache_client._server_facts).

A warm node's processes key recipes without a toolchain with no request, while the
server's signed word is young; a forged, old or foreign word is not taken: the server is
asked, as before.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from client_harness import KcacheServer, Proxy
from kcache_client import ClientSettings, KernelCache
from kcache_client._server_facts import MAX_AGE_S, kept_default, signed_default
from kcache_client._trust import KnownServers, Trust

from kcache import Recipe
from kcache.signing import DefaultToolchain, SigningKey, TrustedKeys
from tests.support import FAST, unique


def _recipe(tag: str) -> Recipe:
    """No toolchain: keyed with the server's default."""
    return Recipe(
        source=f'extern "C" __global__ void k_{tag}(float* x) {{ x[threadIdx.x] *= 3.0f; }}\n',
        target="sm_90",
    )


def _settings(tmp_path: Path) -> ClientSettings:
    return ClientSettings.from_env(
        retry=FAST, send_events=False, known_servers=tmp_path / "known.json", local_compile=False
    )


def test_a_warm_node_keys_without_asking_and_a_forged_word_is_asked_again(
    proxy: Proxy, kserver: KcacheServer, tmp_path: Path
) -> None:
    recipe = _recipe(unique("facts").replace("-", "_"))
    settings = _settings(tmp_path)
    with KernelCache(proxy.url, cache_dir=tmp_path / "tier", settings=settings) as cache:
        first = cache.get(recipe)
        facts = cache.tier.load_server_facts(proxy.url)
    assert proxy.count("GET", "/v1/toolchains") == 1
    assert facts is not None and facts["default_signature"]["key_id"]

    with KernelCache(proxy.url, cache_dir=tmp_path / "tier", settings=settings) as cache:
        again = cache.get(recipe)  # another process on the node
    assert again.recipe_key == first.recipe_key and again.origin == "node"
    assert proxy.count("GET", "/v1/toolchains") == 1  # the tier's signed word was used

    # Another user of a shared tier names another default: the signature does not cover it.
    with KernelCache(proxy.url, cache_dir=tmp_path / "tier", settings=settings) as cache:
        cache.tier.save_server_facts(proxy.url, {**facts, "default_toolchain": "nvrtc-12.0.0"})
    with KernelCache(proxy.url, cache_dir=tmp_path / "tier", settings=settings) as cache:
        assert cache.default_toolchain() == facts["default_toolchain"]  # the server's, asked
    assert proxy.count("GET", "/v1/toolchains") == 2

    # An old word (its moment moved back, so it is no longer the signed one either) is asked.
    old = {**facts, "default_issued_at": facts["default_issued_at"] - int(MAX_AGE_S) - 10}
    with KernelCache(proxy.url, cache_dir=tmp_path / "tier", settings=settings) as cache:
        cache.tier.save_server_facts(proxy.url, old)
    with KernelCache(proxy.url, cache_dir=tmp_path / "tier", settings=settings) as cache:
        assert cache.default_toolchain() == facts["default_toolchain"]
    assert proxy.count("GET", "/v1/toolchains") == 3


def test_a_word_is_taken_only_signed_by_a_trusted_key_and_young(tmp_path: Path) -> None:
    server, stranger = SigningKey.generate(), SigningKey.generate()
    trust = Trust(TrustedKeys([server.public_key]), KnownServers(tmp_path / "known.json"))
    now = time.time()

    def facts(key: SigningKey, toolchain: str, issued_at: int) -> dict[str, object]:
        signature = key.sign_default_toolchain(DefaultToolchain(toolchain, issued_at))
        body = {"default_issued_at": issued_at, "default_signature": signature.to_dict()}
        return {"default_toolchain": toolchain, **signed_default(body)}

    fresh = facts(server, "nvrtc-13.5.0", int(now) - 5)
    assert kept_default(fresh, trust, now) == "nvrtc-13.5.0"
    assert kept_default(json.loads(json.dumps(fresh)), trust, now) == "nvrtc-13.5.0"  # as kept
    assert kept_default({**fresh, "default_toolchain": "nvrtc-12.0.0"}, trust, now) is None
    assert kept_default(facts(stranger, "nvrtc-13.5.0", int(now)), trust, now) is None
    assert kept_default(facts(server, "nvrtc-13.5.0", int(now - MAX_AGE_S - 1)), trust, now) is None
    assert kept_default(facts(server, "nvrtc-13.5.0", int(now) + 3600), trust, now) is None
    assert kept_default({"default_toolchain": "nvrtc-13.5.0"}, trust, now) is None  # unsigned
    assert kept_default({**fresh, "default_signature": {"key_id": "x"}}, trust, now) is None
    assert kept_default(None, trust, now) is None
    assert signed_default({"default": "nvrtc-13.5.0"}) == {}  # a server that does not sign


def test_a_complete_tier_makes_no_request_in_a_job_s_next_processes(
    proxy: Proxy, kserver: KcacheServer, tmp_path: Path
) -> None:
    """Issue 48's warm node: a manifest the tier holds whole, recipes without a toolchain."""
    recipes = [_recipe(unique("warm").replace("-", "_") + f"_{i}") for i in range(3)]
    settings = _settings(tmp_path)
    with KernelCache(proxy.url, cache_dir=tmp_path / "seed", settings=settings) as cache:
        cache.warmup(recipes, progress=False)
        manifest = cache.manifest("warm-job")
    with KernelCache(proxy.url, cache_dir=tmp_path / "tier", settings=settings) as cache:
        cache.prefetch(manifest)  # the job's first process fills the node
        digests = [cache.get(r).digest for r in recipes]
    sent = proxy.count()
    for _ in range(2):  # the job's next processes on the node
        with KernelCache(proxy.url, cache_dir=tmp_path / "tier", settings=settings) as cache:
            assert cache.prefetch(manifest).requests == 0
            arts = [cache.get(r) for r in recipes]
        assert [a.digest for a in arts] == digests and {a.origin for a in arts} == {"node"}
    assert proxy.count() == sent, proxy.paths("GET", "/") + proxy.paths("POST", "/")
