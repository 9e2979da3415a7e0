"""Jobs, not kernels (issue 34): manifests from a job, bundles in one request, bundle files, layers.

One real server (a thread, real NVRTC and SQLite) behind a counting proxy; a job
compiles three kernels through ``get_many`` (its batch resolves name the job), and the
tests replay that job onto fresh node tiers.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from client_harness import Proxy, job_cache, kernels
from kcache_client._bundle import load_bundle_file, write_bundle_file
from kcache_client._tier import NodeTier
from kcache_client._trust import Trust
from kcache_server.settings import Settings

from kcache import Recipe
from kcache.bundle_format import BundleError, BundleReader, entry_head
from kcache.errors import KCacheError
from kcache.job_manifest import JobManifest, ManifestError, diff_manifests
from kcache.signing import BundleDigest, SigningKey
from tests.cli_harness import kcache, user_env
from tests.support import ServerThread

JOB = "job-34"


@dataclasses.dataclass
class Job:
    server: ServerThread
    known: Path
    recipes: list[Recipe]  # concrete: target and toolchain named, so no toolchain request
    keys: list[str]
    digests: list[str]
    public_key: str


def _asked(proxy: Proxy) -> int:
    """Requests the proxy saw but the withdrawals reads (kcache_client._withdrawals: one before
    a process's first answer from its tiers, another process's within a moment shared)."""
    return proxy.count() - proxy.count("GET", "/v1/withdrawals")


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Job]:
    home = tmp_path_factory.mktemp("job")
    server = ServerThread(
        Settings(data_dir=home / "data", compile_workers=2, audit={"flush_s": 0.05})
    )
    known = home / "known.json"
    try:
        with job_cache(server.url, home / "tier", known, job_id=JOB) as cache:
            recipes = [cache.prepare(r) for r in kernels(3, "job", target="sm_80")]
            arts = cache.get_many(recipes)
        assert all(not isinstance(a, Exception) for a in arts), arts
        public = server.client().get("/v1/keys").json()["keys"][0]["public_key"]
        yield Job(
            server,
            known,
            recipes,
            [a.recipe_key for a in arts],  # type: ignore[union-attr]
            [a.digest for a in arts],  # type: ignore[union-attr]
            public,
        )
    finally:
        server.stop()


def run_kcache(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``kcache ARGS`` as a user with no settings but ``env``."""
    return kcache(*args, env=user_env(Path(tempfile.mkdtemp()), **(env or {})))


@pytest.fixture(scope="module")
def manifest(job: Job, tmp_path_factory: pytest.TempPathFactory) -> JobManifest:
    with job_cache(job.server.url, tmp_path_factory.mktemp("m"), job.known) as cache:
        return cache.job_manifest(JOB)


def test_the_server_records_a_jobs_manifest_and_it_saves_and_diffs(
    job: Job, manifest: JobManifest, tmp_path: Path
) -> None:
    assert manifest.job_id == JOB and manifest.version == 1
    assert manifest.recipe_keys == sorted(job.keys)
    by_key = {k.recipe_key: k for k in manifest.kernels}
    assert [by_key[k].digest for k in job.keys] == job.digests
    assert all(k.target == "sm_80" and k.kind == "cubin" and k.size > 0 for k in manifest.kernels)
    assert all(k.kernel.startswith("kjob_") for k in manifest.kernels)
    # Saved and read back: the same manifest, the same digest; a later version is refused.
    saved = manifest.save(tmp_path / "m.json")
    again = JobManifest.load(saved)
    assert again.digest == manifest.digest and again.kernels == manifest.kernels
    body = json.loads(saved.read_text())
    with pytest.raises(ManifestError, match="version 3"):
        JobManifest.from_dict({**body, "version": 3})
    with pytest.raises(ManifestError, match="edited by hand"):
        JobManifest.from_dict({**body, "kernels": body["kernels"][1:]})
    # Diff: one kernel dropped, one recompiled to other bytes, one new recipe of a kernel.
    first, second, third = manifest.kernels
    b = JobManifest.of(
        [
            dataclasses.replace(second, digest="0" * 64),
            dataclasses.replace(third, recipe_key="f" * 64),
        ]
    )
    diff = diff_manifests(manifest, b)
    assert [k.recipe_key for k in diff.removed] == [first.recipe_key]
    assert diff.added == ()
    assert {(a.recipe_key, b.recipe_key) for a, b in diff.changed} == {
        (second.recipe_key, second.recipe_key),
        (third.recipe_key, "f" * 64),
    }
    assert diff_manifests(manifest, again).same
    # The CLI says the same (exit 1: they differ).
    b.save(tmp_path / "b.json")
    out = run_kcache("manifest", "diff", str(saved), str(tmp_path / "b.json"), "--json")
    assert out.returncode == 1, out.stderr
    assert {c["why"] for c in json.loads(out.stdout)["changed"]} == {"artifact", "recipe"}


def test_a_client_records_what_it_was_served(job: Job, tmp_path: Path) -> None:
    with job_cache(job.server.url, tmp_path / "tier", job.known) as cache:
        for recipe in job.recipes[:2]:
            cache.get(recipe)
        mine = cache.manifest()
    assert mine.recipe_keys == sorted(job.keys[:2])


def test_a_bundle_fills_an_empty_tier_in_one_request_and_a_complete_tier_makes_none(
    job: Job, manifest: JobManifest, tmp_path: Path
) -> None:
    proxy = Proxy(job.server.url)
    try:
        with job_cache(proxy.url, tmp_path / "tier", job.known) as cache:
            done = cache.prefetch(manifest)
            assert (done.requests, done.fetched, done.held, done.missing) == (1, 3, 0, ())
            assert _asked(proxy) == 1 and proxy.count("POST", "/v1/bundle") == 1
            arts = [cache.get(r, compile=False) for r in job.recipes]
            assert [a.origin for a in arts] == ["node"] * 3
            assert [a.digest for a in arts] == job.digests
            assert all(a.signature is not None for a in arts)
            assert _asked(proxy) == 1  # served from the tier: no request more
        with job_cache(proxy.url, tmp_path / "tier", job.known) as cache:  # another process
            again = cache.prefetch(manifest)
        assert (again.requests, again.held, again.fetched) == (0, 3, 0)
        assert _asked(proxy) == 1
        # An entry evicted since: the marker no longer stands, and only that one is asked for.
        with job_cache(proxy.url, tmp_path / "tier", job.known) as cache:
            cache.tier.remove([job.keys[0]])
            third = cache.prefetch(manifest)
        assert (third.requests, third.held, third.fetched) == (1, 2, 1)
        assert proxy.paths("POST", "/v1/bundle") and proxy.count("POST", "/v1/bundle") == 2
        asked = [s.json()["recipe_keys"] for s in proxy.seen if s.path == "/v1/bundle"]
        assert asked[-1] == [job.keys[0]]
    finally:
        proxy.close()


def test_a_tampered_bundle_answer_is_refused_and_the_entry_not_published(
    job: Job, manifest: JobManifest, tmp_path: Path
) -> None:
    proxy = Proxy(job.server.url)
    _rewriting_bundles(proxy, _flip_in_first_entry)
    try:
        with job_cache(proxy.url, tmp_path / "tier", job.known) as cache:
            with pytest.raises(BundleError, match="do not hash"):
                cache.prefetch(manifest)
            assert cache.tier.entries() == []
    finally:
        proxy.close()


def _bundle_file(job: Job, manifest: JobManifest, tmp_path: Path) -> Path:
    with job_cache(job.server.url, tmp_path / "src", job.known) as cache:
        path = tmp_path / "kernels.kcb"
        assert write_bundle_file(cache, manifest, path) == 3
    return path


def _trusting(job: Job, *, given: bool = True) -> Trust:
    other = SigningKey.generate().public_key
    # A pin file (and the memo beside it) of its own in the job's temporary home.
    known = job.known.parent / "trusting" / "known.json"
    return Trust.from_settings(job.public_key if given else other, known)


def _flip_in_first_entry(whole: bytes) -> bytes:
    """One byte of the first entry's artifact flipped."""
    header, head, rest = whole.split(b"\n", 2)
    data = bytearray(rest)
    data[10] ^= 0xFF
    return b"\n".join([header, head, bytes(data)])


def _blobs(root: Path) -> list[Path]:
    return [p for p in (root / "blobs").rglob("*") if p.is_file()] if root.exists() else []


def test_bundle_files_that_are_truncated_tampered_or_of_an_unknown_key_write_nothing(
    job: Job, manifest: JobManifest, tmp_path: Path
) -> None:
    path = _bundle_file(job, manifest, tmp_path)
    whole = path.read_bytes()
    entries = list(BundleReader([whole], max_entry_bytes=1 << 20, where="x"))
    assert [e.recipe_key for e in entries] == manifest.recipe_keys  # type: ignore[union-attr]
    cases = {
        "truncated": (whole[: len(whole) - 40], _trusting(job), "truncated|trailer"),
        "cut in the last entry": (whole[: len(whole) // 2 + 7], _trusting(job), "truncated"),
        "tampered bytes": (_flip_in_first_entry(whole), _trusting(job), "do not hash"),
        "tampered metadata": (
            whole.replace(b'"target":"sm_80"', b'"target":"sm_90"', 1),
            _trusting(job),
            "refused.*does not verify",
        ),
        "unknown key": (whole, _trusting(job, given=False), "refused"),
    }
    for name, (data, trust, match) in cases.items():
        bad = tmp_path / f"{name}.kcb"
        bad.write_bytes(data)
        tier = NodeTier(tmp_path / f"tier-{name}", trust=trust)
        with pytest.raises(BundleError, match=match):
            load_bundle_file(tier, bad, trust, max_entry_bytes=1 << 20)
            pytest.fail(f"{name}: accepted")
        assert _blobs(tier.root) == [] and tier.entries() == [], name
    good = NodeTier(tmp_path / "tier-good", trust=_trusting(job))
    assert load_bundle_file(good, path, _trusting(job), max_entry_bytes=1 << 20) == 3
    assert len(good.entries()) == 3
    # As a layer, a refused file stops the cache at start, saying how to fix it.
    with pytest.raises(KCacheError, match="KCACHE_TRUSTED_KEYS"):
        job_cache(
            None,
            tmp_path / "w",
            job.known,
            layers=(path,),
            trusted_keys=SigningKey.generate().public_key,
        )
    assert not (tmp_path / "w" / "layers").exists() or _no_blobs_under(tmp_path / "w" / "layers")


def test_a_read_only_layer_under_a_writable_tier(
    job: Job, manifest: JobManifest, tmp_path: Path
) -> None:
    path = _bundle_file(job, manifest, tmp_path)
    layer_dir = tmp_path / "layer"
    load_bundle_file(NodeTier(layer_dir), path, _trusting(job), max_entry_bytes=1 << 20)
    before = {p: p.stat().st_mtime_ns for p in layer_dir.rglob("*") if p.is_file()}
    proxy = Proxy(job.server.url)
    try:
        with job_cache(
            proxy.url,
            tmp_path / "writable",
            job.known,
            layers=(layer_dir, path),
            trusted_keys=job.public_key,
            cache_max_bytes=1,  # every publish evicts the writable tier down to nothing
        ) as cache:
            assert [t.read_only for t in cache.layers] == [True, True]
            arts = [cache.get(r, compile=False) for r in job.recipes]
            assert [a.origin for a in arts] == ["node"] * 3 and _asked(proxy) == 0
            # A file of the checked bytes, written into the writable tier: a layer's own file
            # is not handed out (whoever owns the layer could rewrite it after the check).
            assert all(
                str(layer_dir) not in a.path.as_posix() and a.path.read_bytes() == a.data
                for a in arts
            )
            # A new kernel goes to the writable tier (and its eviction), never to a layer.
            new = cache.prepare(kernels(1, "layer", target="sm_80")[0])
            assert cache.get(new).origin == "compiled"
            cache.tier.evict()
            assert cache.layers[0].lookup(cache.key(new)) is None
            assert cache.tier.entries() == []  # evicted down to nothing
            assert [cache.get(r, compile=False).origin for r in job.recipes] == ["memory"] * 3
            cache.forget_memory()
            assert [cache.get(r, compile=False).origin for r in job.recipes] == ["node"] * 3
            done = cache.prefetch(manifest)  # the layers hold it: no request
            assert done.requests == 0
        after = {p: p.stat().st_mtime_ns for p in layer_dir.rglob("*") if p.is_file()}
        assert after == before  # nothing written, touched or removed in the layer
        out = run_kcache(
            "layers",
            "--cache-dir",
            str(tmp_path / "writable"),
            env={"KCACHE_CACHE_LAYERS": str(layer_dir), "KCACHE_TRUSTED_KEYS": job.public_key},
        )
        assert out.returncode == 0, out.stderr
        rows = [json.loads(line) for line in out.stdout.splitlines()]
        assert [(r["layer"], r["entries"]) for r in rows] == [("writable", 0), ("read-only", 3)]
        # `cache info` shows each layer beside the writable tier, a gone one with its reason.
        layers_env = {
            "KCACHE_CACHE_LAYERS": f"{layer_dir}:{path}:{tmp_path / 'gone'}",
            "KCACHE_TRUSTED_KEYS": job.public_key,
        }
        info_args = ("cache", "info", "--cache-dir", str(tmp_path / "writable"))
        info = run_kcache(*info_args, "--json", env=layers_env)
        assert info.returncode == 0, info.stderr
        shown = json.loads(info.stdout)
        assert shown["entries"] == 0 and shown["location"] == str(tmp_path / "writable")
        assert [(r["source"], r["entries"]) for r in shown["layers"]] == [
            (str(layer_dir), 3),
            (str(path), 3),
            (str(tmp_path / "gone"), 0),
        ]
        assert shown["layers"][0]["location"] == str(layer_dir)
        assert str(tmp_path / "writable" / "layers") in shown["layers"][1]["location"]
        assert [r["error"] is None for r in shown["layers"]] == [True, True, False]
        assert shown["layers"][0]["bytes_used"] == sum(k.size for k in manifest.kernels)
        text = run_kcache(*info_args, env=layers_env).stdout
        assert "(writable)" in text and "layer 2" in text and "refused" in text
    finally:
        proxy.close()


def test_the_cli_saves_a_jobs_manifest_prefetches_it_and_bundles_it(
    job: Job, tmp_path: Path
) -> None:
    env = {"KCACHE_KNOWN_SERVERS": str(job.known), "KCACHE_CACHE_DIR": str(tmp_path / "tier")}
    url = job.server.url
    saved = run_kcache(
        "manifest", "save", "--job", JOB, "-o", str(tmp_path / "m.json"), "--server", url, env=env
    )
    assert saved.returncode == 0, saved.stderr
    assert json.loads(saved.stdout)["kernels"] == 3
    pre = run_kcache("prefetch", "--manifest", str(tmp_path / "m.json"), "--server", url, env=env)
    assert pre.returncode == 0, pre.stderr
    assert json.loads(pre.stdout)["requests"] == 1
    again = run_kcache("prefetch", "--manifest", str(tmp_path / "m.json"), "--server", url, env=env)
    assert json.loads(again.stdout)["requests"] == 0
    made = run_kcache(
        "bundle",
        "create",
        "--manifest",
        str(tmp_path / "m.json"),
        "-o",
        str(tmp_path / "k.kcb"),
        "--server",
        url,
        env=env,
    )
    assert made.returncode == 0, made.stderr
    assert json.loads(made.stdout)["entries"] == 3
    # Where -o goes: a missing directory is made (as a manifest's save makes one); a
    # directory is refused by the name given (it was '.k.kcb.1234.partial: Is a directory').
    bundle = ["bundle", "create", "--manifest", str(tmp_path / "m.json"), "--server", url]
    nested = tmp_path / "new" / "dir" / "k.kcb"
    assert run_kcache(*bundle, "-o", str(nested), env=env).returncode == 0 and nested.is_file()
    for command in (bundle, ["manifest", "save", "--job", JOB, "--server", url]):
        refused = run_kcache(*command, "-o", str(tmp_path / "new"), env=env)
        assert refused.returncode != 0 and "Traceback" not in refused.stderr
        assert f"-o {tmp_path / 'new'} is a directory" in refused.stderr, refused.stderr
        assert ".partial" not in refused.stderr and ".tmp-" not in refused.stderr
    unknown = run_kcache(
        "manifest",
        "save",
        "--job",
        "no-such-job",
        "-o",
        str(tmp_path / "x"),
        "--server",
        url,
        env=env,
    )
    assert unknown.returncode == 1 and not (tmp_path / "x").exists()


def test_warmup_with_a_manifest_prefetches_it_in_one_request_then_warms_the_recipes(
    job: Job, manifest: JobManifest, tmp_path: Path
) -> None:
    manifest.save(tmp_path / "m.json")
    (tmp_path / "r.json").write_text(json.dumps([r.to_dict() for r in job.recipes]))
    env = {"KCACHE_KNOWN_SERVERS": str(job.known), "KCACHE_CACHE_DIR": str(tmp_path / "tier")}
    proxy = Proxy(job.server.url)
    try:
        first = run_kcache(
            "warmup", "--manifest", str(tmp_path / "m.json"), "-q", "--server", proxy.url, env=env
        )
        assert first.returncode == 0, first.stderr
        assert json.loads(first.stdout) == {
            "manifest": manifest.digest,
            "kernels": 3,
            "held": 0,
            "fetched": 3,
            "missing": [],
            "requests": 1,
        }
        assert proxy.count("POST", "/v1/bundle") == 1
        # Recipes beside the manifest: the prefetch line, then one line per recipe, all
        # answered from the tier the prefetch filled (no bundle request: the tier is complete).
        both = run_kcache(
            "warmup",
            str(tmp_path / "r.json"),
            "--manifest",
            str(tmp_path / "m.json"),
            "-q",
            "--no-compile",
            "--server",
            proxy.url,
            env=env,
        )
        assert both.returncode == 0, both.stderr
        lines = [json.loads(line) for line in both.stdout.splitlines()]
        assert lines[0]["requests"] == 0 and lines[0]["held"] == 3
        assert sorted(line["recipe_key"] for line in lines[1:]) == sorted(job.keys)
        assert proxy.count("POST", "/v1/bundle") == 1
    finally:
        proxy.close()
    neither = run_kcache("warmup", "--server", job.server.url, env=env)
    assert neither.returncode == 2 and "--manifest" in neither.stderr


def _no_blobs_under(root: Path) -> bool:
    return all(_blobs(d) == [] for d in root.iterdir())


# ---------------------------------------------------------------------- packs
def _packs(root: Path) -> list[Path]:
    return sorted((root / "packs").glob("*.kcb")) if (root / "packs").exists() else []


def _aliases(root: Path) -> list[Path]:
    recipes = root / "index" / "recipes"
    return [p for p in recipes.rglob("*") if p.is_file()] if recipes.exists() else []


def _rewriting_bundles(proxy: Proxy, change: Any) -> None:
    """Send every bundle answer through ``change(body) -> body``."""

    def rewrite(seen: Any, headers: dict[str, str], body: bytes) -> tuple[dict[str, str], bytes]:
        return headers, change(body) if seen.path == "/v1/bundle" else body

    proxy.faults.rewrite = rewrite


def _trailer(body: bytes) -> tuple[bytes, dict[str, Any]]:
    """A bundle's bytes before its trailer line, and the trailer."""
    rest, last = body.rstrip(b"\n").rsplit(b"\n", 1)
    return rest + b"\n", json.loads(last)


def test_a_prefetch_keeps_the_bundle_as_one_pack_that_every_process_reads(
    job: Job, manifest: JobManifest, tmp_path: Path
) -> None:
    proxy = Proxy(job.server.url)
    try:
        with job_cache(proxy.url, tmp_path / "tier", job.known) as cache:
            assert cache.prefetch(manifest).fetched == 3
        # One file, written whole: no blob, alias or record per kernel.
        assert len(_packs(tmp_path / "tier")) == 1
        assert _blobs(tmp_path / "tier") == [] and _aliases(tmp_path / "tier") == []
        with job_cache(proxy.url, tmp_path / "tier", job.known) as cache:  # another process
            assert cache.prefetch(manifest).requests == 0
            arts = [cache.get(r, compile=False) for r in job.recipes]
            assert [a.origin for a in arts] == ["node"] * 3
            assert [a.digest for a in arts] == job.digests
            assert _asked(proxy) == 1
            entries = cache.tier.entries()
            assert sorted(e.recipe_keys[0] for e in entries) == sorted(job.keys)
            assert cache.tier.usage().entries == 3
            # A caller wanting a file gets one, with the kernel's bytes.
            assert arts[0].path.read_bytes() == arts[0].data
            assert len(_blobs(tmp_path / "tier")) == 1
    finally:
        proxy.close()


def test_a_damaged_pack_reads_as_absent_and_is_replaced(
    job: Job, manifest: JobManifest, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    proxy = Proxy(job.server.url)
    tier = tmp_path / "tier"
    try:
        with job_cache(proxy.url, tier, job.known) as cache:
            cache.prefetch(manifest)
        (pack,) = _packs(tier)
        whole = pack.read_bytes()
        # One byte of one entry flipped in place (failing media): that entry alone is refused.
        pack.write_bytes(_flip_in_first_entry(whole))
        first_key = json.loads(whole.split(b"\n", 2)[1])["recipe_key"]
        with job_cache(proxy.url, tier, job.known) as cache:
            by_key = {cache.key(r): r for r in job.recipes}
            art = cache.get(by_key[first_key], compile=False)
            assert art.origin == "server" and art.digest == job.digests[job.keys.index(first_key)]
            others = [
                cache.get(r, compile=False).origin for k, r in by_key.items() if k != first_key
            ]
            assert others == ["node", "node"]
        assert "do not hash to its digest" in caplog.text
        # Cut short (a crash, a full disk): not used at all; the marker no longer stands, and
        # the next prefetch asks for what no file holds.
        pack.write_bytes(whole[: len(whole) // 2])
        with job_cache(proxy.url, tier, job.known) as cache:
            again = cache.prefetch(manifest)
            assert again.requests == 1 and again.missing == ()
            assert [cache.get(r, compile=False).origin for r in job.recipes] == ["node"] * 3
        assert "not using the pack" in caplog.text
        # The damaged file is still listed (and so evicted, cleared), without entries.
        with job_cache(None, tier, job.known) as cache:
            assert cache.tier.clear().bytes_freed > 0
        assert _packs(tier) == []
    finally:
        proxy.close()


def test_a_pack_entry_signed_by_an_unknown_key_is_not_used(
    job: Job, manifest: JobManifest, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from kcache_client._pack_file import PackWriter

    # A pack planted in the tier: the server's bytes and metadata, signed by another key.
    with job_cache(job.server.url, tmp_path / "src", job.known) as cache:
        arts = [cache.get(r, compile=False) for r in job.recipes]
    planted = tmp_path / "tier"
    attacker = SigningKey.generate()
    with PackWriter(str(planted / "packs")) as pack:
        for art in arts:
            pack.add(
                art.recipe_key, art.metadata, art.data, attacker.sign(art.recipe_key, art.metadata)
            )
    with job_cache(job.server.url, planted, job.known, trusted_keys=job.public_key) as cache:
        assert [cache.get(r, compile=False).origin for r in job.recipes] == ["server"] * 3
    assert f"signed by key {attacker.key_id}" in caplog.text


def test_pack_files_that_are_links_or_fifos_are_never_opened(
    job: Job, manifest: JobManifest, tmp_path: Path
) -> None:
    import os

    tier = tmp_path / "tier"
    (tier / "packs").mkdir(parents=True)
    os.mkfifo(tier / "packs" / f"{'a' * 32}.kcb")
    (tier / "packs" / f"{'b' * 32}.kcb").symlink_to("/dev/zero")
    with job_cache(job.server.url, tier, job.known) as cache:  # a FIFO opened would hang here
        assert cache.prefetch(manifest).fetched == 3
        assert [cache.get(r, compile=False).origin for r in job.recipes] == ["node"] * 3
        assert cache.tier.usage().entries == 3


def test_removing_one_kernel_rewrites_its_pack_without_it(
    job: Job, manifest: JobManifest, tmp_path: Path
) -> None:
    with job_cache(job.server.url, tmp_path / "tier", job.known) as cache:
        cache.prefetch(manifest)
        removal = cache.tier.remove([job.keys[1]])
        assert removal.removed == 1 and removal.unknown == ()
        (pack,) = _packs(tmp_path / "tier")
        kept = list(BundleReader([pack.read_bytes()], max_entry_bytes=1 << 20, where="pack"))
        assert sorted(e.recipe_key for e in kept) == sorted(job.keys[:1] + job.keys[2:])  # type: ignore[union-attr]
        cache.forget_memory()
        origins = [cache.get(r, compile=False).origin for r in job.recipes]
        assert origins == ["node", "server", "node"]


def test_one_signature_covers_every_entry_of_a_bundle(
    job: Job, manifest: JobManifest, tmp_path: Path
) -> None:
    proxy = Proxy(job.server.url)
    try:
        with job_cache(proxy.url, tmp_path / "t0", job.known) as cache:
            seen: list[bytes] = []
            _rewriting_bundles(proxy, lambda body: seen.append(body) or body)
            cache.prefetch(manifest)
        _, trailer = _trailer(seen[0])
        assert set(trailer) == {"end", "entries", "missing", "signature"}

        def forged(body: bytes) -> bytes:  # the trailer signed by a key nobody trusts
            rest, trailer = _trailer(body)
            other = SigningKey.generate().sign_bundle(BundleDigest())
            return rest + json.dumps({**trailer, "signature": other.to_dict()}).encode() + b"\n"

        def unsigned(body: bytes) -> bytes:  # a server that predates bundle signatures
            rest, trailer = _trailer(body)
            del trailer["signature"]
            return rest + json.dumps(trailer).encode() + b"\n"

        def retargeted(body: bytes) -> bytes:  # metadata changed under both signatures
            return unsigned(body).replace(b'"target":"sm_80"', b'"target":"sm_90"', 1)

        cases = [(forged, "refused|not trusted"), (retargeted, "does not verify")]
        for n, (change, match) in enumerate(cases, 1):
            _rewriting_bundles(proxy, change)
            with job_cache(proxy.url, tmp_path / f"t{n}", job.known) as cache:
                with pytest.raises(KCacheError, match=match):
                    cache.prefetch(manifest)
                assert cache.tier.entries() == [] and _packs(tmp_path / f"t{n}") == []
        _rewriting_bundles(proxy, unsigned)
        with job_cache(proxy.url, tmp_path / "old", job.known) as cache:
            assert cache.prefetch(manifest).fetched == 3  # each entry's own signature checked
    finally:
        proxy.close()


def test_a_cut_bundle_keeps_the_entries_that_arrived_whole(
    job: Job, manifest: JobManifest, tmp_path: Path
) -> None:
    proxy = Proxy(job.server.url)

    def cut(body: bytes) -> bytes:  # two entries whole, the third half there
        entries = list(BundleReader([body], max_entry_bytes=1 << 20, where="x"))
        third = body.index(entry_head(entries[2].recipe_key, entries[2].meta, entries[2].signature))  # type: ignore[union-attr]
        return body[: third + 100]

    _rewriting_bundles(proxy, cut)
    try:
        with job_cache(proxy.url, tmp_path / "tier", job.known) as cache:
            with pytest.raises(BundleError, match="truncated"):
                cache.prefetch(manifest)
            assert len(cache.tier.entries()) == 2
            proxy.faults.rewrite = None
            again = cache.prefetch(manifest)
            assert (again.held, again.fetched, again.requests) == (2, 1, 1)
    finally:
        proxy.close()


def test_a_pack_a_dead_writer_left_half_written_is_swept_and_a_live_ones_kept(
    job: Job, tmp_path: Path
) -> None:
    import os
    import time

    packs = tmp_path / "tier" / "packs"
    packs.mkdir(parents=True)
    dead, live = packs / f".tmp-{'d' * 32}.kcb", packs / f".tmp-{'e' * 32}.kcb"
    for partial in (dead, live):
        partial.write_bytes(b'{"format": "kcache-bundle", "version": 1}\n' + b"x" * 1000)
    hours_ago = time.time() - 2 * 3600
    os.utime(dead, (hours_ago, hours_ago))
    with job_cache(None, tmp_path / "tier", job.known) as cache:
        assert cache.tier.usage().entries == 0  # a partial is no pack
        cache.tier.evict()
    assert not dead.exists() and live.exists()
