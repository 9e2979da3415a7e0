"""Portable tiers and one verdict (issue 44, items 2 and 3, client side).

A tier or a bundle file made on one machine (through a real server, its key pinned there)
is used on another machine with a fresh home that trusts the same fleet key
(``KCACHE_TRUSTED_KEYS``) and nothing else; ``get`` never returns what ``load()``/``check()``
refuses, and ``check()`` relies on the verdict ``get`` made (one verification per file).
A process without given keys but with a server meets a shared tier's entries signed by a
key it has not pinned yet: it asks the server (first contact) before refusing, and a refusal
for want of a pin is not kept. A prefetch is complete only with entries its process can use,
and a 1777 tier stays usable by every other user after the first one's prefetch (real other
uids, real processes). Real servers, real NVRTC compiles (the server's), real processes.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from client_harness import CountingVerifier, Proxy, artifact_meta, kernels
from kcache_client import (
    ClientSettings,
    KernelCache,
    LateCompileError,
    UntrustedArtifactError,
    _tier_reads,
)
from kcache_client._bundle import write_bundle_file
from kcache_client._tier import NodeTier
from kcache_client._trust import KnownServers, Trust
from kcache_server.settings import Settings

from kcache import signing
from kcache.signing import SigningKey, TrustedKeys
from tests.support import FAST, ServerThread

HERE = Path(__file__).parent


def _server(data: Path, key: Path) -> ServerThread:
    return ServerThread(
        Settings(data_dir=data, compile_workers=1, signing_key_file=key, audit={"flush_s": 0.05})
    )


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerThread, SigningKey]]:
    """A server signing with the fleet's key (what every replica of the fleet signs with)."""
    home = tmp_path_factory.mktemp("fleet")
    key = SigningKey.load_or_create(home / "fleet.pem")
    server = _server(home / "data", home / "fleet.pem")
    yield server, key
    server.stop()


def _settings(
    home: Path, *, trusted: str | None = None, local_compile: bool | None = False, **more: object
) -> ClientSettings:
    """A user's settings on a machine whose home is ``home`` (its own pin file)."""
    return dataclasses.replace(
        ClientSettings.from_env(auto_target="sm_80", retry=FAST, send_events=False, **more),  # type: ignore[arg-type]
        trusted_keys=trusted,
        known_servers=home / "known_servers.json",
        local_compile=local_compile,
    )


def _shared_dir() -> Path:
    """A directory a team shares (sticky, writable by all), where other uids can reach it."""
    shared = Path(tempfile.mkdtemp(prefix="kcache-shared-tier-"))
    os.chmod(shared, 0o1777)
    return shared


@pytest.fixture
def built(
    tmp_path: Path, fleet: tuple[ServerThread, SigningKey]
) -> tuple[Path, Path, list[object], object]:
    """Machine A: a tier filled through the server (its key pinned on first contact, no key
    given) and a bundle file of the same kernels; (tier, bundle file, recipes, manifest)."""
    server, _ = fleet
    recipes = kernels(3, "portable", target="sm_80")
    home_a = tmp_path / "home-a"
    with KernelCache(
        server.url, cache_dir=tmp_path / "tier-a", settings=_settings(home_a)
    ) as cache:
        for recipe in recipes:
            assert cache.get(recipe).origin in ("compiled", "server")
        manifest = cache.manifest("portable")
        assert write_bundle_file(cache, manifest, tmp_path / "job.kcb") == 3
        concrete = [cache.prepare(r) for r in recipes]  # as a job ships them (B7's recipe.json)
    return tmp_path / "tier-a", tmp_path / "job.kcb", concrete, manifest


def _copy_tier(source: Path, target: Path, mode: int | None = None) -> Path:
    shutil.copytree(source, target, symlinks=True)
    if mode is not None:
        os.chmod(target, mode)
    return target


@pytest.mark.parametrize("where", ["private tier", "shared tier", "bundle layer"])
def test_a_tier_or_bundle_from_another_machine_loads_with_the_fleet_key_alone(
    tmp_path: Path,
    fleet: tuple[ServerThread, SigningKey],
    built: tuple[Path, Path, list[object], object],
    where: str,
) -> None:
    tier_a, bundle, recipes, _ = built
    _, key = fleet
    home_b = tmp_path / "home-b"  # machine B: a fresh home, no pins, no server configured
    shared = _shared_dir()
    try:
        if where == "private tier":
            tier_b, layers = _copy_tier(tier_a, tmp_path / "tier-b"), ()
        elif where == "shared tier":
            tier_b, layers = _copy_tier(tier_a, shared / "tier", 0o1777), ()
        else:
            tier_b, layers = tmp_path / "own-tier", (bundle,)
        settings = _settings(home_b, trusted=key.public_key, layers=layers)
        with KernelCache(cache_dir=tier_b, settings=settings) as cache:
            assert cache.tier.standing.kind == ("shared" if where == "shared tier" else "private")
            for recipe in recipes:
                art = cache.get(recipe)  # type: ignore[arg-type]
                assert art.origin == "node"
                art.check()  # what load() runs first: the same verdict
        assert not (home_b / "known_servers.json").exists()  # nothing pinned, nothing given by hand
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def test_get_and_load_agree_where_no_key_is_given(
    tmp_path: Path,
    built: tuple[Path, Path, list[object], object],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The issue's B7 case: a tier prepared elsewhere, no key given, no server. A private
    copy is this user's own (used as it is, and load() agrees); a shared copy's entries are
    refused by get itself, saying which setting would trust them."""
    tier_a, _, recipes, _ = built
    recipe = recipes[0]
    home = tmp_path / "home-b"
    with KernelCache(
        cache_dir=_copy_tier(tier_a, tmp_path / "mine"), settings=_settings(home)
    ) as cache:
        art = cache.get(recipe)  # type: ignore[arg-type]
        assert art.origin == "node"
        art.check()  # was: UntrustedArtifactError "... which is not trusted here (trusted: none)"
        # Altered after it was found: checked in full, and refused with the setting named.
        renamed = dataclasses.replace(
            art, metadata=dataclasses.replace(art.metadata, lowered_names={"x": "y"})
        )
        with pytest.raises(UntrustedArtifactError) as refused:
            renamed.check()
        assert str(refused.value).startswith(f"refused the artifact of recipe {art.recipe_key}:")
        assert "KCACHE_TRUSTED_KEYS" in str(refused.value)
    shared = _shared_dir()
    try:
        with (
            caplog.at_level(logging.WARNING, "kcache_client"),
            KernelCache(
                cache_dir=_copy_tier(tier_a, shared / "tier", 0o1777), settings=_settings(home)
            ) as cache,
        ):
            with pytest.raises(Exception) as missed:
                cache.get(recipe)  # type: ignore[arg-type]
            assert not isinstance(missed.value, UntrustedArtifactError)  # refused as an entry
        assert "no server is configured (KCACHE_URL)" in caplog.text
        assert "give the fleet's public key in KCACHE_TRUSTED_KEYS" in caplog.text
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def test_a_shared_entry_is_verified_once_per_file_and_load_does_not_verify_again(
    tmp_path: Path,
    fleet: tuple[ServerThread, SigningKey],
    built: tuple[Path, Path, list[object], object],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tier_a, _, recipes, _ = built
    _, key = fleet
    monkeypatch.setattr(_tier_reads, "_SETTLED_NS", 0)  # every file's identity may be known at once
    counting = CountingVerifier(signing.verifier())
    monkeypatch.setattr(signing, "_verifier", counting)
    shared = _shared_dir()
    try:
        tier = _copy_tier(tier_a, shared / "tier", 0o1777)
        settings = _settings(tmp_path / "home", trusted=key.public_key)
        with KernelCache(cache_dir=tier, settings=settings) as cache:
            art = cache.get(recipes[0])  # type: ignore[arg-type]
            assert art.origin == "node" and counting.calls == 1
            art.check()
            assert counting.calls == 1  # load() relies on get's verdict
            cache.forget_memory()
            again = cache.get(recipes[0])  # type: ignore[arg-type]
            again.check()
            assert again.origin == "node" and counting.calls == 1  # the same alias file
        counting.calls = 0
        with KernelCache(
            cache_dir=_copy_tier(tier_a, tmp_path / "private"), settings=settings
        ) as c:
            c.get(recipes[0]).check()  # type: ignore[arg-type]
        assert counting.calls == 0  # a private tier's entries are used as they are
    finally:
        shutil.rmtree(shared, ignore_errors=True)


_FRESH_PROCESS = """
import json, sys
from kcache import Recipe
from kcache_client import ClientSettings, KernelCache
import kcache.signing as signing
cfg = json.loads(sys.argv[1])
settings = ClientSettings.from_env(send_events=False, trusted_keys=cfg["trusted"])
with KernelCache(cache_dir=cfg["tier"], settings=settings) as cache:
    art = cache.get(Recipe.from_dict(cfg["recipe"]))
    art.check()
print(json.dumps({"origin": art.origin, "cryptography": "cryptography" in sys.modules,
                  "verifier": signing._verifier is not None, "tqdm": "tqdm" in sys.modules}))
"""


@pytest.mark.parametrize("standing", ["private", "shared"])
def test_a_fresh_process_imports_no_crypto_where_nothing_is_verified(
    tmp_path: Path,
    fleet: tuple[ServerThread, SigningKey],
    built: tuple[Path, Path, list[object], object],
    standing: str,
) -> None:
    tier_a, _, recipes, _ = built
    _, key = fleet
    shared = _shared_dir()
    try:
        tier = (
            _copy_tier(tier_a, tmp_path / "tier")
            if standing == "private"
            else _copy_tier(tier_a, shared / "tier", 0o1777)
        )
        cfg = {"tier": str(tier), "trusted": key.public_key, "recipe": recipes[0].to_dict()}  # type: ignore[attr-defined]
        env = {
            **os.environ,
            "KCACHE_KNOWN_SERVERS": str(tmp_path / "fresh" / "known.json"),
            "KCACHE_URL": "",
        }
        done = subprocess.run(
            [sys.executable, "-c", _FRESH_PROCESS, json.dumps(cfg)],
            env=env,
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, done.stderr
        found = json.loads(done.stdout.strip().splitlines()[-1])
        assert found["origin"] == "node"
        assert found["cryptography"] is False  # never imported: OpenSSL's own, or nothing
        assert found["verifier"] is (standing == "shared")  # a private tier verifies nothing
        assert (
            found["tqdm"] is False
        )  # a warmup's progress bar only (its objects cost a collection)
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def test_a_key_not_pinned_yet_is_asked_for_first_and_a_refusal_for_it_is_not_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shared tier's pack, signed by server X's key; this user never contacted X."""
    from kcache_client import _packs

    monkeypatch.setattr(_packs, "_TRANSIENT_S", 0.0)  # such a refusal is reused for 1 s at most
    x = SigningKey.generate()
    url = "http://x.invalid:1"
    known = KnownServers(tmp_path / "known.json")
    shared = _shared_dir()
    try:
        writer = NodeTier(shared, max_bytes=0, trust=Trust(TrustedKeys([x.public_key]), known))
        data = b"\x7fELF X's kernel" * 10
        meta = artifact_meta(data)
        key = "5e" * 32
        with writer.packs.writer() as pack:
            pack.add(key, meta, data, x.sign(key, meta))
        trust = Trust(TrustedKeys(), known, url)
        asked: list[str] = []

        def unreachable() -> object:
            asked.append("GET /v1/keys")
            raise signing.SignatureError("unreachable")  # a KCacheError, as the transport's

        trust.contact = unreachable
        tier = NodeTier(shared, max_bytes=0, trust=trust)
        assert tier.lookup(key) is None and asked == ["GET /v1/keys"]  # asked before refusing
        assert tier.lookup(key) is None and len(asked) == 1  # not again within a few seconds
        # The server answers now (its first contact pins its key): the same pack file, the
        # same process, judged again, because a refusal for want of a pin is not kept.
        trust._contact_failed = None
        trust.contact = lambda: {"keys": [{"key_id": x.key_id, "public_key": x.public_key}]}
        assert tier.lookup(key) == (meta, data)
        pinned = known.keys(url)
        assert pinned is not None and pinned.key_ids == [x.key_id]
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def test_a_prefetch_is_complete_only_with_entries_its_process_can_use(
    tmp_path: Path,
    fleet: tuple[ServerThread, SigningKey],
    built: tuple[Path, Path, list[object], object],
) -> None:
    _tier_a, _, recipes, manifest = built
    server, key = fleet
    SigningKey.load_or_create(tmp_path / "other.pem")
    other = _server(tmp_path / "other-data", tmp_path / "other.pem")  # another server, key
    shared = _shared_dir()
    try:
        tier = shared / "tier"
        tier.mkdir()
        os.chmod(tier, 0o1777)
        with KernelCache(
            server.url, cache_dir=tier, settings=_settings(tmp_path / "h1", trusted=key.public_key)
        ) as first:
            assert first.prefetch(manifest).requests == 1  # type: ignore[arg-type]
        # Through the other server, with pins only: the fleet's entries vouch for nothing here.
        with KernelCache(
            other.url, cache_dir=tmp_path / "seed", settings=_settings(tmp_path / "h2")
        ) as seed:
            for recipe in recipes:
                seed.get(recipe)  # type: ignore[arg-type]  (compiled there too)
        with KernelCache(other.url, cache_dir=tier, settings=_settings(tmp_path / "h2")) as via:
            done = via.prefetch(manifest)  # type: ignore[arg-type]
            assert done.requests == 1 and via.stats.bundle_requests == 1  # not "complete"
            via.freeze("error")
            assert [via.get(r).origin for r in recipes] == ["node"] * 3  # type: ignore[arg-type]
        # A fresh home with the fleet's server configured and no key given: the entries'
        # key is pinned at the server's first contact, and nothing is fetched again.
        proxy = Proxy(server.url)
        try:
            with KernelCache(
                proxy.url, cache_dir=tier, settings=_settings(tmp_path / "h3")
            ) as fresh:
                done = fresh.prefetch(manifest)  # type: ignore[arg-type]
                fresh.freeze("error")
                origins = [fresh.get(r).origin for r in recipes]  # type: ignore[arg-type]
            assert done.requests == 0 and origins == ["node"] * 3
            assert proxy.count("GET", "/v1/keys") == 1
            assert proxy.count("POST", "/v1/bundle") == 0
            assert proxy.count("GET", "/v1/recipes") == 0
        finally:
            proxy.close()
    finally:
        other.stop()
        shutil.rmtree(shared, ignore_errors=True)


def _as_user(uid: int, cfg: dict[str, object], tmp: Path) -> dict[str, object]:
    """Run ``other_user_worker.py`` as ``uid`` (it drops root itself); what it reports."""
    home = tmp / f"home-{uid}"
    home.mkdir(mode=0o700)
    os.chown(home, uid, uid)
    out = home / "out.json"
    config = tmp / f"cfg-{uid}.json"
    config.write_text(json.dumps({**cfg, "uid": uid, "home": str(home), "out": str(out)}))
    os.chmod(config, 0o644)
    done = subprocess.run(
        [sys.executable, str(HERE / "other_user_worker.py"), str(config)],
        capture_output=True,
        text=True,
        cwd=tmp,
        env={
            **{k: v for k, v in os.environ.items() if k != "KCACHE_TRUSTED_KEYS"},
            "PYTHONDONTWRITEBYTECODE": "1",
        },
    )
    assert done.returncode == 0, done.stderr[:1500] + done.stderr[-1500:]
    return dict(json.loads(out.read_text()))


@pytest.mark.skipif(os.geteuid() != 0, reason="other uids need root to start as (CI runs as root)")
def test_other_users_of_a_1777_tier_after_the_first_prefetch_use_every_entry(
    fleet: tuple[ServerThread, SigningKey],
    built: tuple[Path, Path, list[object], object],
) -> None:
    server, key = fleet
    _, _, recipes, manifest = built
    work = Path(tempfile.mkdtemp(prefix="kcache-users-"))  # where the other uids can reach
    os.chmod(work, 0o755)
    try:
        tier = work / "tier"
        tier.mkdir()
        os.chmod(tier, 0o1777)  # what a team shares; nothing in it yet
        manifest_path = work / "manifest.json"
        manifest.save(manifest_path)  # type: ignore[attr-defined]
        os.chmod(manifest_path, 0o644)
        cfg = {
            "url": server.url,
            "tier": str(tier),
            "manifest": str(manifest_path),
            "recipes": [r.to_dict() for r in recipes],  # type: ignore[attr-defined]
            "trusted_keys": key.public_key,
        }
        first = _as_user(65534, cfg, work)
        assert first["standing"] == "shared" and first["bundle_requests"] == 1
        assert first["origins"] == ["node"] * 3 and first["checked"] is True
        for sub in ("packs", "index/complete", "index", "blobs", "locks", "servers"):
            made = (tier / sub).stat()
            assert stat.S_IMODE(made.st_mode) == 0o1777, sub  # the tier's standing, kept
        # Another user, then another with no key given (its first contact pins the key).
        for uid, given in ((65533, key.public_key), (65532, None)):
            other = _as_user(uid, {**cfg, "trusted_keys": given}, work)
            assert other["standing"] == "shared", other
            assert other["prefetch"] == {"requests": 0, "fetched": 0}, other
            assert other["origins"] == ["node"] * 3, other  # every entry used ...
            assert other["bundle_requests"] == 0 and other["server_fetches"] == 0  # ... none again
            assert other["checked"] is True
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_a_late_kernel_is_still_refused_after_a_prefetch_it_was_not_in(
    tmp_path: Path,
    fleet: tuple[ServerThread, SigningKey],
    built: tuple[Path, Path, list[object], object],
) -> None:
    """The freeze still means what it says: a kernel the manifest lacks is late."""
    server, key = fleet
    _, _, _, manifest = built
    with KernelCache(
        server.url,
        cache_dir=tmp_path / "t",
        settings=_settings(tmp_path / "h", trusted=key.public_key),
    ) as cache:
        cache.prefetch(manifest)  # type: ignore[arg-type]
        cache.freeze("error")
        with pytest.raises(LateCompileError):
            cache.get(kernels(1, "late", target="sm_80")[0])


def test_a_prefetched_pack_in_a_shared_tier_is_judged_by_its_one_signature(
    tmp_path: Path,
    fleet: tuple[ServerThread, SigningKey],
    built: tuple[Path, Path, list[object], object],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The pack keeps the server's signature over all of its entries (the bundle's): a process
    judges it with one verification, not one per entry; without it (a pack rewritten without
    some entries), or where it does not verify, each entry's own signature decides."""
    server, key = fleet
    _, _, recipes, manifest = built
    shared = _shared_dir()
    counting = CountingVerifier(signing.verifier())
    monkeypatch.setattr(signing, "_verifier", counting)
    try:
        tier = shared / "tier"
        tier.mkdir()
        os.chmod(tier, 0o1777)
        settings = _settings(tmp_path / "h", trusted=key.public_key)
        with KernelCache(server.url, cache_dir=tier, settings=settings) as first:
            assert first.prefetch(manifest).requests == 1  # type: ignore[arg-type]
        counting.calls = 0
        with KernelCache(server.url, cache_dir=tier, settings=settings) as later:
            assert later.prefetch(manifest).requests == 0  # type: ignore[arg-type]
            assert [later.get(r).origin for r in recipes] == ["node"] * 3  # type: ignore[arg-type]
        assert counting.calls == 1  # the pack's signature, once, for its three entries

        # The trailer's signature replaced by one over other bindings: each entry's own.
        (pack,) = (tier / "packs").glob("*.kcb")
        body = pack.read_bytes()
        head, _, trailer = body.rstrip(b"\n").rpartition(b"\n")
        end = json.loads(trailer)
        other = signing.BundleDigest()
        other.add("ab" * 32, artifact_meta(b"x"))
        end["signature"] = key.sign_bundle(other).to_dict()
        pack.write_bytes(head + b"\n" + json.dumps(end).encode() + b"\n")
        counting.calls = 0
        with KernelCache(server.url, cache_dir=tier, settings=settings) as again:
            assert again.prefetch(manifest).requests == 0  # type: ignore[arg-type]
            assert [again.get(r).origin for r in recipes] == ["node"] * 3  # type: ignore[arg-type]
        assert counting.calls == 1 + 3  # the trailer refused, then each entry's own
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def test_a_private_tiers_pack_is_indexed_from_its_sidecar_and_a_shared_tiers_never(
    tmp_path: Path,
    fleet: tuple[ServerThread, SigningKey],
    built: tuple[Path, Path, list[object], object],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A prefetch into a private tier writes the pack's index beside it (``<pack>.idx``), and a
    later process indexes the pack from it, with the same entries; a sidecar that is not the
    pack's (another file, damaged) is ignored, and a shared tier's, which another user could
    have written, is never read."""
    from kcache_client import _pack_file

    server, key = fleet
    _, _, recipes, manifest = built
    parsed: list[str] = []
    real = _pack_file.index_bundle
    monkeypatch.setattr(
        _pack_file, "index_bundle", lambda *a, **k: parsed.append("pack") or real(*a, **k)
    )
    settings = _settings(tmp_path / "h", trusted=key.public_key)
    shared = _shared_dir()
    try:
        for where in (tmp_path / "private", shared / "tier"):
            where.mkdir()
            if where.parent == shared:
                os.chmod(where, 0o1777)
            with KernelCache(server.url, cache_dir=where, settings=settings) as first:
                first.prefetch(manifest)  # type: ignore[arg-type]
                expected = {r.key(): first.get(r).data for r in recipes}  # type: ignore[attr-defined]
            (pack,) = (where / "packs").glob("*.kcb")
            sidecar = Path(f"{pack}.idx")
            assert sidecar.exists() is (where.parent != shared)  # written where it is read
            if where.parent == shared:  # one that is this very pack's, as another user could write
                fd = os.open(pack, os.O_RDONLY)
                try:
                    _pack_file.write_sidecar(
                        str(pack), *_pack_file.index_file(fd, os.fstat(fd).st_size, str(pack))
                    )
                finally:
                    os.close(fd)
            parsed.clear()
            with KernelCache(server.url, cache_dir=where, settings=settings) as later:
                assert {r.key(): later.get(r).data for r in recipes} == expected  # type: ignore[attr-defined]
            assert parsed == ([] if where.parent != shared else ["pack"])
            if where.parent != shared:
                # Damaged, or another pack's: the pack itself is indexed, and answers the same.
                sidecar.write_bytes(b'{"format": "kcache-pack-index/1", "pack": [1, 2]}')
                parsed.clear()
                with KernelCache(server.url, cache_dir=where, settings=settings) as again:
                    assert {r.key(): again.get(r).data for r in recipes} == expected  # type: ignore[attr-defined]
                assert parsed == ["pack"]
    finally:
        shutil.rmtree(shared, ignore_errors=True)
