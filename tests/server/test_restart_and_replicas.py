"""Persistence across restarts, and one compile per recipe across two replicas sharing PostgreSQL."""

from __future__ import annotations

import os
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support import ServerProcess, audit_rows, unique, upgrade, vector_add


def _restart_keeps_everything(make_settings: Any, serve: Any, **db: Any) -> None:
    settings = make_settings(**db)
    recipe = vector_add(unique())
    first = serve(settings)
    with first.client() as client:
        compiled = client.post("/v1/resolve", json={"recipe": recipe}).json()
    assert compiled["status"] == "compiled"
    first.stop()
    second = serve(settings)
    with second.client() as client:
        again = client.post("/v1/resolve", json={"recipe": recipe, "compile": False})
        assert again.status_code == 200 and again.json()["status"] == "hit"
        assert again.json()["artifact"]["digest"] == compiled["artifact"]["digest"]
        data = client.get(f"/v1/recipes/{compiled['recipe_key']}/artifact").content
        assert len(data) == compiled["artifact"]["size"]


def test_restart_keeps_everything_on_sqlite(make_settings: Any, serve: Any) -> None:
    _restart_keeps_everything(make_settings, serve)


@pytest.mark.postgres
def test_restart_keeps_everything_on_postgres(make_settings: Any, pg_url: str, serve: Any) -> None:
    # pg_url before serve: its database is dropped after the servers stop, not under them
    upgrade(pg_url)
    _restart_keeps_everything(make_settings, serve, db_url=pg_url)


def _two_replicas_compile_each_recipe_once(data_dir: Path, db_url: str) -> None:
    upgrade(db_url)
    env = {**os.environ, "KCACHE_COMPILE_WORKERS": "2", "KCACHE_AUDIT_FLUSH_S": "0.1"}
    replicas = [ServerProcess(data_dir, db_url=db_url, env=env) for _ in range(2)]
    try:
        for replica in replicas:
            replica.launch()
        for replica in replicas:
            replica.wait_ready(ready="/readyz")
        urls = [replica.url for replica in replicas]
        tag = unique()
        recipes = [vector_add(f"{tag}-{i}") for i in range(20)]
        jobs = [
            (url, i) for i in range(20) for url in urls
        ]  # every recipe to both replicas at once

        def ask(job: tuple[str, int]) -> tuple[int, httpx.Response]:
            url, i = job
            return i, httpx.post(f"{url}/v1/resolve", json={"recipe": recipes[i]}, timeout=120)

        with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
            answers = list(pool.map(ask, jobs))
        assert all(r.status_code == 200 for _, r in answers), [
            r.text for _, r in answers if r.status_code != 200
        ]
        compiled = Counter(i for i, r in answers if r.json()["status"] == "compiled")
        assert compiled == Counter(range(20)), compiled  # exactly one compile per recipe, overall
        digests = {
            i: {r.json()["artifact"]["digest"] for j, r in answers if j == i} for i in range(20)
        }
        assert all(len(d) == 1 for d in digests.values())
    finally:
        for replica in replicas:
            replica.stop()
    # The audit trail (flushed on shutdown) agrees: 20 compiles, 40 answers, no errors.
    rows = audit_rows(db_url)
    keys = {r.recipe_key for r in rows if r.outcome == "compiled"}
    assert len([r for r in rows if r.outcome == "compiled"]) == 20 and len(keys) == 20
    assert sum(r.count for r in rows) == 40 and not [r for r in rows if r.outcome == "error"]


@pytest.mark.postgres
def test_two_replicas_sharing_postgres_compile_each_recipe_once(
    tmp_path: Path, pg_url: str
) -> None:
    _two_replicas_compile_each_recipe_once(tmp_path / "shared-data", pg_url)


def test_two_processes_sharing_sqlite_compile_each_recipe_once(tmp_path: Path) -> None:
    """On the embedded default the cooperating-writer lock is a file lock in the data dir."""
    data_dir = tmp_path / "shared-data"
    data_dir.mkdir()
    _two_replicas_compile_each_recipe_once(data_dir, f"sqlite:///{data_dir / 'kcache.db'}")
