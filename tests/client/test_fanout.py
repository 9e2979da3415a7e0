"""A job's bundle crosses the network once (issue 48 item 1), with real processes on gloo.

Three or four ranks on simulated nodes (a host name and a tier directory each; in the
first test ``a`` holds ranks 0 and 1, ``b`` rank 2, ``c`` rank 3) warm up with a manifest
of kernels the session's server compiled. The node leaders that lack the manifest meet in a gloo group
of their own; the lowest asks the server for the bundle once and broadcasts it; each
other leader checks it as the server's answer and keeps it; the node's other ranks read
the tier. What is checked, per case: every rank ends with the manifest's kernels in its
node tier (digests and bytes) or with a typed error, within the timeout (the ranks are
killed past it: a hang fails the test), and how many bundle requests the server saw.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from client_harness import KcacheServer, Proxy, kernels
from kcache_client import ClientSettings, KernelCache
from kcache_client._foreign import ForeignCache

from kcache.foreign import ForeignName
from kcache.job_manifest import JobManifest
from tests.support import FAST, free_port

dist = pytest.importorskip("torch.distributed")

WORKER = Path(__file__).with_name("fanout_worker.py")
HOSTS = ["a", "a", "b", "c"]
RETRY = {"attempts": 3, "base_s": 0.05, "cap_s": 0.2, "budget_s": 2.0, "deadline_s": 10.0}
TIMEOUT = 12.0
KILL_TIMEOUT = 8.0


@pytest.fixture(scope="module")
def manifest(kserver: KcacheServer, tmp_path_factory: pytest.TempPathFactory) -> JobManifest:
    """Six kernels compiled once for the module, as the manifest of a previous run."""
    home = tmp_path_factory.mktemp("fanout-job")
    settings = ClientSettings.from_env(retry=FAST, send_events=False, job_id="fanout-test")
    with KernelCache(kserver.url, cache_dir=home / "tier", settings=settings) as cache:
        results = cache.get_many([cache.prepare(r) for r in kernels(6, "fan", target="sm_80")])
        assert all(not isinstance(r, Exception) for r in results), results
        return cache.manifest()


def run_ranks(
    tmp_path: Path,
    url: str,
    manifest: JobManifest,
    *,
    hosts: list[str] = HOSTS,
    fault: dict[str, Any] | None = None,
    timeout: float = TIMEOUT,
    api: str = "warmup",
) -> list[dict[str, Any]]:
    """One process per rank (the test hosts the store), waited for (bounded); their reports."""
    world = len(hosts)
    out = tmp_path / "ranks"
    out.mkdir()
    cfg = {
        "world": world,
        "port": free_port(),
        "url": url,
        "hosts": hosts,
        "cache_dirs": [str(tmp_path / f"node-{h}") for h in hosts],
        "manifest": manifest.to_dict(),
        "timeout": timeout,
        "retry": RETRY,
        "chunk": 4096,
        "fault": fault,
        "api": api,
        "out": str(out),
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    store = dist.TCPStore(
        "127.0.0.1",
        cfg["port"],
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=timeout * 2),
    )
    logs = [tmp_path / f"rank{rank}.log" for rank in range(world)]
    procs = []
    for rank in range(world):
        with logs[rank].open("wb") as log:
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(WORKER), str(tmp_path / "config.json"), str(rank)],
                    stderr=log,
                    env={**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world)},
                )
            )
    # Generous: process start (torch's import) on a loaded machine, the warmup's own
    # timeout, and its fallback; a hang is far longer.
    deadline = time.monotonic() + 4 * timeout + 60
    hung = []
    try:
        for proc in procs:
            proc.wait(max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for rank, proc in enumerate(procs):
            if proc.poll() is None:
                hung.append(rank)
                proc.kill()
                proc.wait()
    del store
    errors = [log.read_text(errors="replace")[-3000:] for log in logs]
    assert not hung, f"ranks {hung} hung:\n" + "\n".join(errors[r] for r in hung)
    reports = []
    for rank in range(world):
        path = out / f"{rank}.json"
        if path.exists():
            reports.append({**json.loads(path.read_text()), "exit": procs[rank].returncode})
        else:
            reports.append({"rank": rank, "exit": procs[rank].returncode, "log": errors[rank]})
    return reports


def bundles(proxy: Proxy) -> int:
    return proxy.count("POST", "/v1/bundle")


def test_one_request_per_job_and_a_complete_node_is_skipped(
    proxy: Proxy, manifest: JobManifest, tmp_path: Path
) -> None:
    # Node b already holds the manifest (its completeness marker): it takes no part.
    settings = dataclasses.replace(ClientSettings.from_env(retry=FAST, send_events=False))
    with KernelCache(proxy.url, cache_dir=tmp_path / "node-b", settings=settings) as cache:
        assert cache.prefetch(manifest).requests == 1
    assert bundles(proxy) == 1
    reports = run_ranks(tmp_path, proxy.url, manifest)
    assert all(r.get("ok") and r["right"] for r in reports), reports
    assert bundles(proxy) == 2  # the one above, and the job's one
    assert [r["fanout_sent"] for r in reports] == [1, 0, 0, 0]  # rank 0 leads node a
    assert [r["fanout_received"] for r in reports] == [0, 0, 0, 1]  # node c, by the group
    assert [r["bundle_requests"] for r in reports] == [1, 0, 0, 0]
    assert all(r["fanout_failures"] == 0 for r in reports)
    assert max(r["seconds"] for r in reports) < 10 * TIMEOUT


@pytest.mark.parametrize("fault", [None, "corrupt_foreign"])
def test_a_jobs_foreign_groups_cross_the_network_once_with_its_kernels(
    kserver: KcacheServer,
    proxy: Proxy,
    manifest: JobManifest,
    tmp_path: Path,
    fault: str | None,
) -> None:
    """A version 2 manifest: its foreign groups travel in the one bundle the source asks for
    and forwards; a group damaged on the way is refused whole and the node asks the server."""
    settings = ClientSettings.from_env(retry=FAST, send_events=False)
    with KernelCache(kserver.url, cache_dir=tmp_path / "writer", settings=settings) as cache:
        hooks = ForeignCache(cache)
        for i in range(2):
            name = ForeignName("cupy", "14.2.0", "sm_80", "nvrtc-13.0", secrets.token_hex(8))
            hooks.put(name, {"payload": os.urandom(3000 + i)})
        assert hooks.flush(30) and hooks.counts["published"] == 2
        with_groups = JobManifest.of(manifest.kernels, foreign=cache.manifest().foreign)
    assert with_groups.version == 2 and len(with_groups.foreign) == 2
    spec = {"kind": fault, "rank": 0} if fault else None
    reports = run_ranks(tmp_path, proxy.url, with_groups, hosts=["a", "b", "c"], fault=spec)
    assert all(r.get("ok") and r["right"] and r["foreign_right"] for r in reports), reports
    if fault is None:
        assert bundles(proxy) == 1
        assert [r["fanout_received"] for r in reports] == [0, 1, 1]
    else:  # each receiving leader refused the damaged group and asked the server itself
        assert [r["fanout_failures"] for r in reports] == [0, 1, 1]
        assert [r["bundle_requests"] for r in reports] == [1, 1, 1]
        assert bundles(proxy) == 3


@pytest.mark.parametrize("kind", ["corrupt", "forge"])
def test_a_damaged_or_foreign_pack_from_a_peer_is_refused_and_the_node_asks_the_server(
    proxy: Proxy, manifest: JobManifest, tmp_path: Path, kind: str
) -> None:
    """The source damages a byte of what it forwards, or signs it with a key of its own:
    each receiving leader refuses it as it would the server's answer and asks the server.
    Three nodes of one rank each; the forged case through ``prefetch(manifest, group)``."""
    fault = {"kind": kind, "rank": 0}
    api = "prefetch" if kind == "forge" else "warmup"
    reports = run_ranks(tmp_path, proxy.url, manifest, hosts=["a", "b", "c"], fault=fault, api=api)
    assert all(r.get("ok") and r["right"] for r in reports), reports
    assert [r["fanout_failures"] for r in reports] == [0, 1, 1]
    assert [r["fanout_received"] for r in reports] == [0, 0, 0]
    # The source's request, then one per node that refused what it was sent.
    assert [r["bundle_requests"] for r in reports] == [1, 1, 1]
    assert bundles(proxy) == 3


def test_the_source_killed_mid_broadcast_fails_every_survivor_alike_within_the_timeout(
    proxy: Proxy, manifest: JobManifest, tmp_path: Path
) -> None:
    """Rank 0 (node a's leader, the source) dies after 3 pieces of the broadcast: the other
    leaders' broadcast fails and they ask the server; the warmup cannot finish without
    rank 0, so every survivor (rank 1 on its node, node b's leader) raises the same
    WarmupTimeoutError naming it."""
    fault = {"kind": "kill", "rank": 0, "after": 3}
    # A shorter timeout: the survivors wait it out (the ranks arrive within moments of each
    # other, having joined the job's process group first).
    reports = run_ranks(
        tmp_path, proxy.url, manifest, hosts=["a", "a", "b"], fault=fault, timeout=KILL_TIMEOUT
    )
    assert reports[0]["exit"] == -9, reports[0]
    survivors = reports[1:]
    assert all(r.get("ok") is False and r["timeout_error"] for r in survivors), survivors
    assert all(r["missing_ranks"] == [0] for r in survivors), survivors
    assert len({r["message"] for r in survivors}) == 1, survivors
    assert all(r["seconds"] < 10 * KILL_TIMEOUT for r in survivors)
    # Node b fell back to its own request (its tier holds the kernels now).
    assert [r["bundle_requests"] for r in survivors] == [0, 1]
