"""``KernelCache`` against a real ``kcache serve`` (through a counting proxy on a real socket)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from client_harness import KCACHE, Proxy, kernels, start_server
from kcache_client import (
    ClientSettings,
    DigestMismatchError,
    KernelCache,
    RemoteCompileError,
    RemoteNotFoundError,
    ServerUnavailableError,
)

from kcache import Recipe
from kcache.elf import cubin_sm
from tests.support import FAST


def _cache(url: str, cache_dir: Path, **kw: object) -> KernelCache:
    settings = ClientSettings.from_env(auto_target="sm_80", retry=FAST, **kw)  # type: ignore[arg-type]
    return KernelCache(url, cache_dir=cache_dir, settings=settings)


def test_second_get_makes_no_request_and_the_tier_outlives_the_server(tmp_path: Path) -> None:
    server = start_server(tmp_path / "server")
    proxy = Proxy(server.url)
    try:
        (recipe,) = kernels(1, "stop")
        with _cache(proxy.url, tmp_path / "tier", send_events=False) as cache:
            art = cache.get(recipe)
            assert hashlib.sha256(art.data).hexdigest() == art.digest
            assert cubin_sm(art.data) == 80  # a real cubin for the resolved target
            assert art.metadata.target == "sm_80"
            assert art.path.read_bytes() == art.data
            sent = proxy.count()
            assert sent >= 2 and proxy.count("POST", "/v1/resolve") == 1  # it really compiled there
            assert art.origin == "compiled" and art.outcome == "compiled"
            again = cache.get(recipe)
            assert again.origin == "memory" and again.outcome == "local_hit"
            assert again.data is art.data and again.metadata is art.metadata
            assert proxy.count() == sent  # the second get made no HTTP request at all
        server.stop()
        # A new process on the same node: memory is empty, the server is gone; the tier answers,
        # and the server's default toolchain (needed for the key) was remembered in the tier.
        with _cache(proxy.url, tmp_path / "tier", send_events=False) as offline:
            again = offline.get(recipe)
            assert again.digest == art.digest and again.data == art.data
            assert again.origin == "node" and offline.stats.node_hits == 1
            # Something the tier does not have fails clearly, naming the server and the cause.
            with pytest.raises(ServerUnavailableError) as info:
                offline.get(kernels(1, "absent")[0])
            assert proxy.url in str(info.value)
    finally:
        proxy.close()
        server.stop()


def test_a_corrupt_byte_in_the_tier_is_detected_and_the_blob_refetched(
    proxy: Proxy, tmp_path: Path
) -> None:
    (recipe,) = kernels(1, "corrupt")
    with _cache(proxy.url, tmp_path, send_events=False) as cache:
        art = cache.get(recipe)
    good = art.data
    art.path.chmod(0o644)
    damaged = bytearray(good)
    damaged[len(damaged) // 2] ^= 0x40
    art.path.write_bytes(bytes(damaged))
    before = proxy.count("GET", "/v1/recipes/")
    with _cache(proxy.url, tmp_path, send_events=False) as fresh:
        again = fresh.get(recipe)
    assert again.data == good  # nothing bad returned
    assert hashlib.sha256(again.data).hexdigest() == art.digest
    assert art.path.read_bytes() == good  # the tier holds the good blob again
    assert proxy.count("GET", "/v1/recipes/") > before  # it was refetched from the server
    assert any(p.name.startswith(art.digest) for p in (tmp_path / "quarantine").iterdir())


def test_bytes_damaged_in_transit_are_refused_and_refetched(proxy: Proxy, tmp_path: Path) -> None:
    (recipe,) = kernels(1, "transit")
    proxy.faults.corrupt = 1  # the first blob download is damaged
    with _cache(proxy.url, tmp_path, send_events=False) as cache:
        art = cache.get(recipe)
        assert hashlib.sha256(art.data).hexdigest() == art.digest
        assert cache.stats.digest_mismatches == 1
    assert proxy.count("GET", f"/v1/blobs/{art.digest}") == 2

    (other,) = kernels(1, "transit-always")
    proxy.faults.corrupt = 100  # every download is damaged: refuse, store nothing
    with (
        _cache(proxy.url, tmp_path / "t2", send_events=False) as cache,
        pytest.raises(DigestMismatchError),
    ):
        cache.get(other)
    blobs = [p for p in (tmp_path / "t2" / "blobs").rglob("*") if p.is_file()]
    assert not blobs, blobs  # no blob, and no staging file left behind either


def test_overload_is_retried_honouring_retry_after(proxy: Proxy, tmp_path: Path) -> None:
    proxy.faults.busy, proxy.faults.retry_after = 2, "0"
    (recipe,) = kernels(1, "busy")
    with _cache(proxy.url, tmp_path, send_events=False) as cache:
        art = cache.get(recipe)
    assert art.data[:4] == b"\x7fELF"
    assert proxy.faults.busy == 0  # both 503s were answered and retried past


def test_compile_errors_and_missing_artifacts_are_typed(proxy: Proxy, tmp_path: Path) -> None:
    broken = Recipe(source='extern "C" __global__ void broken(float* x) { x[0] = undeclared; }\n')
    with _cache(proxy.url, tmp_path, send_events=False) as cache:
        with pytest.raises(RemoteCompileError) as info:
            cache.get(broken)
        assert "undeclared" in info.value.log
        assert info.value.recipe_key == cache.key(broken)
        with pytest.raises(RemoteCompileError) as again:  # the server's negative entry answers
            cache.get(broken)
        assert "undeclared" in again.value.log
        assert (
            proxy.count("POST", "/v1/resolve") == 1
        )  # the repeat is answered by the cached failure
        with pytest.raises(RemoteNotFoundError):
            cache.get(kernels(1, "nocompile")[0], compile=False)


def test_tier_hits_are_reported_as_audit_events(proxy: Proxy, tmp_path: Path) -> None:
    (recipe,) = kernels(1, "events")
    with _cache(proxy.url, tmp_path, job_id="job-42") as cache:
        art = cache.get(recipe)
        cache.get(recipe)  # memory hit
    with _cache(proxy.url, tmp_path, job_id="job-42") as fresh:
        fresh.get(recipe)  # node-tier hit
    events = [e for s in proxy.seen if s.path == "/v1/events" for e in s.json()["events"]]
    assert sorted(e["tier"] for e in events) == ["memory", "node"]
    for event in events:
        assert event["outcome"] == "local_hit"
        assert event["recipe_key"] == art.recipe_key and event["digest"] == art.digest
        assert event["job_id"] == "job-42" and event["host"] and event["pid"] == os.getpid()
        assert event["target"] == "sm_80" and event["latency_ms"] >= 0


def test_nodes_processes_download_each_blob_once(proxy: Proxy, tmp_path: Path) -> None:
    recipes = kernels(3, "procs", target="sm_80")
    with _cache(proxy.url, tmp_path / "seed", send_events=False) as seed:
        digests = [seed.get(r).digest for r in recipes]  # compiled on the server beforehand
        keys = [seed.key(r) for r in recipes]
    before = proxy.paths("GET", "/v1/recipes/")
    code = (
        "import sys, json; from kcache import Recipe\n"
        "from kcache_client import ClientSettings, KernelCache\n"
        "s = ClientSettings.from_env(send_events=False)\n"
        "c = KernelCache(url=sys.argv[1], cache_dir=sys.argv[2], settings=s)\n"
        "rs = [Recipe.from_dict(d) for d in json.loads(sys.argv[3])]\n"
        "print(json.dumps([c.get(r).digest for r in rs]))\n"
    )
    payload = json.dumps([r.to_dict() for r in recipes])
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, proxy.url, str(tmp_path / "node"), payload],
            stdout=subprocess.PIPE,
        )
        for _ in range(4)
    ]
    outs = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
    assert outs == [digests] * 4
    fetched = proxy.paths("GET", "/v1/recipes/") - before
    # Once per kernel per node (the tier's per-key lock), and nothing else: one round trip.
    assert fetched == {f"/v1/recipes/{key}/artifact": 1 for key in keys}


def test_single_process_warmup_then_everything_is_local(proxy: Proxy, tmp_path: Path) -> None:
    recipes = kernels(5, "solo")
    with _cache(proxy.url, tmp_path, send_events=False) as cache:
        result = cache.warmup(recipes, progress=False)
        assert result.statuses == ["compiled"] * 5 and result.union_size == 5
        assert proxy.count("POST", "/v1/resolve/batch") == 1
        sent = proxy.count()
        again = cache.warmup(recipes, progress=False)
        assert [a.digest for a in again.artifacts] == [a.digest for a in result.artifacts]
        assert again.statuses == ["local_hit"] * 5
        # A job start: the one request is the withdrawals read before its first local answer.
        assert proxy.count() == sent + 1 and proxy.count("GET", "/v1/withdrawals") == 1


def test_cli_warmup_and_compile_through_the_server(kserver: object, tmp_path: Path) -> None:
    url = kserver.url  # type: ignore[attr-defined]
    recipes = kernels(2, "cli", target="sm_80")
    listing = tmp_path / "recipes.json"
    listing.write_text(json.dumps([r.to_dict() for r in recipes]))
    env = {**os.environ, "KCACHE_CACHE_DIR": str(tmp_path / "tier")}
    run = subprocess.run(
        [str(KCACHE), "warmup", str(listing), "--server", url, "-q"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert run.returncode == 0, run.stderr
    lines = [json.loads(line) for line in run.stdout.splitlines()]
    assert [line["status"] for line in lines] == ["compiled", "compiled"]
    assert all(Path(line["path"]).read_bytes()[:4] == b"\x7fELF" for line in lines)

    one = tmp_path / "one.json"
    one.write_text(json.dumps(recipes[0].to_dict()))
    out = tmp_path / "out.cubin"
    comp = subprocess.run(
        [str(KCACHE), "compile", str(one), "--server", url, "-o", str(out)],
        capture_output=True,
        text=True,
        env=env,
    )
    assert comp.returncode == 0, comp.stderr
    line = json.loads(comp.stdout)
    assert (
        line["status"] == "hit"
        and line["digest"] == lines[0]["digest"]
        and line["path"] == str(out)
    )
    assert hashlib.sha256(out.read_bytes()).hexdigest() == line["digest"]

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"source": "__global__ void f() { nope; }", "target": "sm_80"}))
    failed = subprocess.run(
        [str(KCACHE), "compile", str(bad), "--server", url], capture_output=True, text=True, env=env
    )
    assert failed.returncode == 1 and "nope" in failed.stderr


def test_cli_get_reads_the_tier_then_the_server_and_compiles_only_when_allowed(
    kserver: object, tmp_path: Path
) -> None:
    url = kserver.url  # type: ignore[attr-defined]
    known, unknown = kernels(2, "cli-get", target="sm_80")
    env = {**os.environ, "KCACHE_CACHE_DIR": str(tmp_path / "tier")}
    files = []
    for i, recipe in enumerate((known, unknown)):
        files.append(tmp_path / f"r{i}.json")
        files[-1].write_text(json.dumps(recipe.to_dict()))
    with KernelCache(url, cache_dir=tmp_path / "other-node") as cache:
        digest = cache.get(known).digest  # compiled on the server, not in this node's tier

    def get(path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(KCACHE), "get", str(path), "--server", url, *extra],
            capture_output=True,
            text=True,
            env=env,
        )

    fetched = get(files[0], "-o", str(tmp_path / "k.cubin"))
    assert fetched.returncode == 0, fetched.stderr
    assert json.loads(fetched.stdout)["status"] == "hit"
    assert hashlib.sha256((tmp_path / "k.cubin").read_bytes()).hexdigest() == digest
    again = get(files[0])
    assert json.loads(again.stdout)["status"] == "local_hit"  # from this node's tier now
    missing = get(files[1], "--no-compile")
    assert missing.returncode == 1 and json.loads(missing.stdout or "{}") == {}
    assert "--no-compile" in missing.stderr and "Traceback" not in missing.stderr
    compiled = get(files[1])  # compile on a miss is the default, as in KernelCache.get
    assert compiled.returncode == 0 and json.loads(compiled.stdout)["status"] == "compiled"
