"""What an operator's Prometheus reads besides the counters: the release, readiness, workers.

- ``/readyz`` names the release (``version``), and ``kcache_build_info{version,toolchain}``
  says the same with the default toolchain's id;
- ``kcache_ready`` and ``kcache_readiness_check{check}`` say what ``/readyz`` would answer at
  every scrape, whether or not anything probes ``/readyz``, so the ``KcacheReplicaNotReady``
  alert sees a replica that is not ready, and stays quiet on a healthy one nothing probes;
- with several uvicorn workers every sample carries ``worker`` (the process id): a scrape
  reaches one process, and without it two processes' counters would read as one counter
  that keeps resetting.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kcache._version import __version__
from tests.support import ServerProcess, wait_until


def _samples(text: str) -> list[Any]:
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def _value(text: str, name: str, **labels: str) -> float:
    (found,) = [
        s.value
        for s in _samples(text)
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    return float(found)


def test_readyz_and_build_info_name_the_release_and_toolchain(
    make_settings: Callable[..., Any], serve: Callable[[Any], Any]
) -> None:
    server = serve(make_settings())
    with server.client() as client:
        toolchain = client.get("/v1/toolchains").json()["default"]
        ready = client.get("/readyz")
        assert ready.status_code == 200 and ready.json()["version"] == __version__
        text = client.get("/metrics").text
    assert _value(text, "kcache_build_info", version=__version__, toolchain=toolchain) == 1
    assert _value(text, "kcache_ready") == 1
    assert _value(text, "kcache_readiness_check", check="store") == 1
    assert _value(text, "kcache_readiness_check", check="database") == 1
    assert not [s for s in _samples(text) if "worker" in s.labels]  # one process: no label


def test_a_replica_that_is_not_ready_says_so_in_its_metrics(
    make_settings: Callable[..., Any], serve: Callable[[Any], Any]
) -> None:
    settings = make_settings()
    server = serve(settings)
    with server.client() as client:
        assert client.get("/readyz").status_code == 200
        shutil.rmtree(server.app.state.kcache.backends.store.blobs)  # the store is gone
        not_ready = client.get("/readyz")
        assert not_ready.status_code == 503 and not_ready.json()["version"] == __version__
        text = client.get("/metrics").text
    assert _value(text, "kcache_ready") == 0
    assert _value(text, "kcache_readiness_check", check="store") == 0
    assert _value(text, "kcache_readiness_check", check="database") == 1


def test_a_database_whose_schema_went_is_not_ready(
    make_settings: Callable[..., Any], serve: Callable[[Any], Any]
) -> None:
    """A database that answers ``SELECT 1`` but lost its schema (dropped and recreated
    empty, restored from another release's backup) fails the check: every request would."""
    import sqlalchemy as sa

    server = serve(make_settings())
    db = server.app.state.kcache.backends.db
    with server.client() as client:
        assert client.get("/readyz").status_code == 200
        with db.begin() as conn:
            conn.execute(sa.text("UPDATE alembic_version SET version_num = '0001'"))
        wait_until(lambda: client.get("/readyz").status_code == 503, "readiness to fail")
        said = client.get("/readyz").json()["checks"]["database"]
        assert "revision 0001" in said and "kcache db upgrade" in said, said
        with db.begin() as conn:
            conn.execute(sa.text("DROP TABLE alembic_version"))
        wait_until(
            lambda: "no kcache schema" in client.get("/readyz").json()["checks"]["database"],
            "readiness to name the missing schema",
        )
        assert _value(client.get("/metrics").text, "kcache_readiness_check", check="database") == 0


def test_readiness_gauges_are_current_without_a_probe(
    make_settings: Callable[..., Any], serve: Callable[[Any], Any]
) -> None:
    """A healthy server nothing probes reads ready (it read 0 until a /readyz came); a broken
    one reads not ready at the next scrape, with no /readyz asked at all."""
    server = serve(make_settings())
    with server.client() as client:
        # The workers report their confinement as they start: ready from then on.
        wait_until(
            lambda: _value(client.get("/metrics").text, "kcache_ready") == 1,
            "kcache_ready to read 1 without a /readyz",
        )
        text = client.get("/metrics").text
        assert _value(text, "kcache_readiness_check", check="store") == 1
        shutil.rmtree(server.app.state.kcache.backends.store.blobs)  # the store is gone
        text = client.get("/metrics").text
    assert _value(text, "kcache_ready") == 0
    assert _value(text, "kcache_readiness_check", check="store") == 0
    assert _value(text, "kcache_readiness_check", check="database") == 1
    counted = [
        s for s in _samples(text) if s.name == "kcache_http_requests_total" and "readyz" in str(s)
    ]
    assert counted == []  # nothing asked /readyz


def test_each_uvicorn_worker_labels_its_samples(tmp_path: Path) -> None:
    env = {**os.environ, "KCACHE_COMPILE_WORKERS": "1"}
    with ServerProcess(tmp_path / "data", workers=2, env=env) as server:
        seen: dict[str, list[Any]] = {}
        deadline = time.monotonic() + 60
        while len(seen) < 2:  # a scrape reaches whichever worker accepts it
            assert time.monotonic() < deadline, f"only workers {sorted(seen)} answered"
            with httpx.Client(base_url=server.url, timeout=10) as client:
                samples = _samples(client.get("/metrics").text)
            workers = {s.labels.get("worker") for s in samples}
            assert len(workers) == 1 and None not in workers, workers  # every sample, one worker
            seen[workers.pop()] = samples
    assert all(worker.isdigit() for worker in seen)  # process ids
    for samples in seen.values():
        assert [s.labels["version"] for s in samples if s.name == "kcache_build_info"] == [
            __version__
        ]
