"""No JIT after the barrier (issue 34): a frozen cache reports or refuses a late lookup.

A real server (a thread: real NVRTC, SQLite) behind a counting proxy; the multi-rank
case runs two real processes on gloo sharing one node tier, warmed up from a job's
manifest: one bundle request for the node, then a late lookup refused on every rank.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from client_harness import Proxy, kernels
from kcache_client import ClientSettings, KernelCache, LateCompileError
from kcache_client._freeze import after_warmup_mode
from kcache_server.settings import Settings

from kcache.errors import KCacheError
from tests.support import FAST, ServerThread, free_port

WORKER = Path(__file__).with_name("job_worker.py")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    home = tmp_path_factory.mktemp("freeze")
    server = ServerThread(
        Settings(data_dir=home / "data", compile_workers=2, audit={"flush_s": 0.05})
    )
    yield server
    server.stop()


def _cache(url: str, tier: Path, known: Path, **kw: Any) -> KernelCache:
    settings = ClientSettings.from_env(auto_target="sm_80", retry=FAST, known_servers=known, **kw)
    return KernelCache(url, cache_dir=tier, settings=settings)


def _late_of_job(server: ServerThread, job: str) -> int:
    server.state.audit.flush()
    stats = server.client().get("/v1/stats", params={"group_by": "job", "job_id": job}).json()
    groups = [g for g in stats["groups"] if g["key"] == job]
    return int(groups[0]["outcomes"].get("late", 0)) if groups else 0


def test_a_frozen_cache_refuses_a_late_lookup_before_any_request(
    server: ServerThread, tmp_path: Path
) -> None:
    covered, late = kernels(2, "frz", target="sm_80"), kernels(1, "late", target="sm_80")[0]
    proxy = Proxy(server.url)
    try:
        with _cache(proxy.url, tmp_path / "tier", tmp_path / "known", job_id="job-frz") as cache:
            cache.warmup(covered, then="error")
            assert cache.frozen == "error"

            def sent() -> int:  # audit events are posted in the background: not lookups
                return proxy.count() - proxy.count("POST", "/v1/events")

            before = sent()
            assert [cache.get(r).origin for r in covered] == ["memory"] * 2
            with pytest.raises(LateCompileError) as refused:
                cache.get(late)
            assert refused.value.recipe_key == cache.key(late)
            assert refused.value.kernel.startswith("klate_") and "frozen" in str(refused.value)
            many = cache.get_many([covered[0], late])
            assert not isinstance(many[0], Exception) and isinstance(many[1], LateCompileError)
            assert sent() == before  # refused here: nothing asked of the server
            assert cache.stats.late_lookups == 2
            cache.freeze("allow")  # thawed: the same lookup compiles
            assert cache.get(late).origin == "compiled"
        assert _late_of_job(server, "job-frz") == 2  # its own outcome, per job
    finally:
        proxy.close()


def test_warn_mode_reports_once_per_recipe_and_goes_on(
    server: ServerThread, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    covered, late = kernels(1, "wrn", target="sm_80"), kernels(1, "wlate", target="sm_80")[0]
    with _cache(server.url, tmp_path / "tier", tmp_path / "known", job_id="job-wrn") as cache:
        cache.warmup(covered, then="freeze")  # the configured mode, else warn
        assert cache.frozen == "warn"
        with caplog.at_level(logging.WARNING, logger="kcache_client"):
            assert cache.get(late).origin == "compiled"
            cache.forget_memory()
            cache.tier.remove([cache.key(late)])
            assert cache.get(late).origin == "server"  # late again: reported, not warned again
        told = [r for r in caplog.records if "late lookup" in r.getMessage()]
        assert len(told) == 1 and cache.key(late) in told[0].getMessage()
        assert cache.stats.late_lookups == 2
    assert _late_of_job(server, "job-wrn") == 2


def test_the_operator_setting_decides_what_a_warmup_leaves(
    server: ServerThread, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert after_warmup_mode(None, None) is None
    assert after_warmup_mode("freeze", None) == "warn"
    assert after_warmup_mode("freeze", "error") == "error"
    assert after_warmup_mode(None, "error") == "error"
    assert after_warmup_mode("error", "allow") == "allow"  # the escape hatch
    with pytest.raises(KCacheError, match="then must be"):
        after_warmup_mode("later", None)
    monkeypatch.setenv("KCACHE_AFTER_WARMUP", "error")
    assert ClientSettings.from_env().after_warmup == "error"
    with _cache(server.url, tmp_path / "tier", tmp_path / "known", send_events=False) as cache:
        cache.warmup(kernels(1, "env", target="sm_80"))
        assert cache.frozen == "error"
        with pytest.raises(LateCompileError):
            cache.get(kernels(1, "env2", target="sm_80")[0])
    monkeypatch.setenv("KCACHE_AFTER_WARMUP", "sometimes")
    with pytest.raises(KCacheError, match="KCACHE_AFTER_WARMUP"):
        ClientSettings.from_env()


def test_ranks_prefetch_a_manifest_once_per_node_then_refuse_late_compiles(
    server: ServerThread, tmp_path: Path
) -> None:
    job = "job-ranks"
    known = tmp_path / "known.json"
    with _cache(server.url, tmp_path / "first", known, job_id=job, send_events=False) as cache:
        covered = [cache.prepare(r) for r in kernels(3, "rk", target="sm_80")]
        late = cache.prepare(kernels(1, "rklate", target="sm_80")[0])
        assert all(not isinstance(a, Exception) for a in cache.get_many(covered))
        cache.job_manifest(job).save(tmp_path / "m.json")
    proxy = Proxy(server.url)
    out = tmp_path / "out"
    out.mkdir()
    cfg = {
        "world": 2,
        "port": free_port(),
        "url": proxy.url,
        "job": job,
        "known": str(known),
        "tier": str(tmp_path / "node"),
        "manifest": str(tmp_path / "m.json"),
        "covered": [r.to_dict() for r in covered],
        "late": late.to_dict(),
        "out": str(out),
    }
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    logs = [tmp_path / f"rank{r}.log" for r in range(2)]
    procs = []
    try:
        for rank in range(2):
            with logs[rank].open("wb") as log:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, str(WORKER), str(tmp_path / "cfg.json"), str(rank)],
                        stderr=log,
                        env={**os.environ, "RANK": str(rank), "WORLD_SIZE": "2"},
                    )
                )
        deadline = time.monotonic() + 120
        for proc in procs:
            proc.wait(max(1.0, deadline - time.monotonic()))
        reports = [json.loads((out / f"{r}.json").read_text()) for r in range(2)]
    except (subprocess.TimeoutExpired, FileNotFoundError):
        tails = "\n".join(log.read_text(errors="replace")[-2000:] for log in logs)
        pytest.fail(f"a rank failed or hung:\n{tails}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        proxy.close()
    assert proxy.count("POST", "/v1/bundle") == 1  # one request for the node
    assert sorted(r["bundle_requests"] for r in reports) == [0, 1]
    assert proxy.count("POST", "/v1/resolve") == 0 and proxy.count("GET", "/v1/recipes") == 0
    for report in reports:
        assert report["frozen"] == "error"
        assert report["origins"] == ["node"] * 3
        assert report["late"] == {"class": "LateCompileError", "recipe_key": late.key()}
        assert report["late_lookups"] == 1
    assert _late_of_job(server, job) == 2  # one per rank, in the job's stats


def test_settings_read_the_layers_variable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KCACHE_CACHE_LAYERS", f"{tmp_path / 'a'}{os.pathsep}{tmp_path / 'b.kcb'}")
    assert ClientSettings.from_env().layers == (tmp_path / "a", tmp_path / "b.kcb")
    assert dataclasses.replace(ClientSettings.from_env(layers=[]), layers=()).layers == ()
