"""A fetch by key is audited with who asked, as a resolve is (issue 45).

``KernelCache.get`` asks the server by key first (``GET /v1/recipes/{key}/artifact``, the
hot path), and only a miss is resolved. A resolve's audit event carries its context
(client id, host, pid, job id, rank, world size); a fetch's had none, so a job whose
kernels the server already held showed no lookups, and no rank. The client now sends its
context in ``X-KCache-Context`` with every request; the route and the fast path in front
of it record it. Read here from the real server's audit table.
"""

from __future__ import annotations

import os
import sqlite3
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from client_harness import KcacheServer
from kcache_client import ClientSettings, KernelCache

from kcache import Recipe
from kcache.artifact_header import CONTEXT_HEADER, decode_context, encode_context
from tests.support import FAST, unique

COLUMNS = ("route", "outcome", "client_id", "host", "pid", "job_id", "rank", "world_size", "count")


def _events(server: KcacheServer, recipe_key: str, want: int) -> list[dict[str, Any]]:
    """The audit rows of ``recipe_key`` once at least ``want`` are written (they are batched)."""
    deadline = time.monotonic() + 30.0
    while True:
        with sqlite3.connect(server.data_dir / "kcache.db") as db:
            rows = db.execute(
                f"SELECT {', '.join(COLUMNS)} FROM audit_events WHERE recipe_key = ?",
                (recipe_key,),
            ).fetchall()
        if len(rows) >= want or time.monotonic() > deadline:
            return [dict(zip(COLUMNS, row, strict=True)) for row in rows]
        time.sleep(0.2)


def test_a_fetch_by_key_carries_the_job_and_the_process(
    kserver: KcacheServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tag = unique("ctx").replace("-", "_")
    recipe = Recipe(
        source=f'extern "C" __global__ void k_{tag}(float* x) {{ x[threadIdx.x] += 4.0f; }}\n',
        target="sm_90",
    )
    builder = ClientSettings.from_env(retry=FAST, send_events=False, job_id=f"build-{tag}")
    with KernelCache(kserver.url, cache_dir=tmp_path / "a", settings=builder) as cache:
        key = cache.get(recipe).recipe_key  # a miss: resolved, compiled there
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "8")
    for n in (1, 2):  # two ranks' processes of another job, each with a tier of its own
        worker = ClientSettings.from_env(
            retry=FAST, send_events=False, job_id=f"train-{tag}", client_id=f"w{n}-{tag}"
        )
        with KernelCache(kserver.url, cache_dir=tmp_path / f"w{n}", settings=worker) as cache:
            art = cache.get(recipe)
            assert art.origin == "server"  # fetched by key: the server held it
    rows = _events(kserver, key, 3)
    fetches = sorted((r for r in rows if r["route"] == "fetch"), key=lambda r: r["client_id"])
    assert [r["client_id"] for r in fetches] == [f"w1-{tag}", f"w2-{tag}"], rows
    for row in fetches:
        assert row["outcome"] == "hit" and row["job_id"] == f"train-{tag}"
        assert (row["rank"], row["world_size"], row["pid"]) == (3, 8, os.getpid())
        assert row["host"]
    (resolved,) = [r for r in rows if r["route"] != "fetch"]
    assert resolved["job_id"] == f"build-{tag}"


def test_the_route_behind_the_fast_path_records_it_too(kserver: KcacheServer) -> None:
    """A conditional fetch the fast path leaves to the route (a cold key here: unknown) and a
    malformed context: the lookup is answered, the context's good fields recorded."""
    key = unique("0").encode().hex().ljust(64, "0")[:64]
    context = encode_context({"job_id": f"route-{key[:8]}", "rank": 5, "pid": 7}) + "&rank=x"
    with httpx.Client(base_url=kserver.url, timeout=30) as client:
        answer = client.get(f"/v1/recipes/{key}/artifact", headers={CONTEXT_HEADER: context})
    assert answer.status_code == 404
    (row,) = _events(kserver, key, 1)
    assert (row["route"], row["outcome"]) == ("fetch", "miss")
    assert (row["job_id"], row["rank"], row["pid"]) == (f"route-{key[:8]}", 5, 7)


def test_the_context_header_round_trips() -> None:
    context = {"client_id": "h-1-ab", "host": "h", "pid": 12, "job_id": "job ä/&=x", "rank": 3}
    assert decode_context(encode_context({**context, "world_size": None})) == context
    assert decode_context("pid=x&rank=2&unknown=1&rank=5") == {"rank": 2}
    assert decode_context("a" * 10_000) == {}
