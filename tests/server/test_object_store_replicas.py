"""Replicas that share no filesystem: blobs in a bucket, metadata and single flight on PostgreSQL.

Real parts: ``kcache serve`` processes, each with its own empty data directory, the
machine's PostgreSQL, and an S3 bucket on moto's HTTP server (:mod:`tests.s3_server`).
"""

from __future__ import annotations

import hashlib
import os
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from kcache.store.s3 import S3ArtifactStore
from tests.s3_server import S3Server, s3_server
from tests.support import ServerProcess, pg_database, unique, upgrade, vector_add

pytestmark = pytest.mark.postgres


def _distinct_kernel(tag: str) -> dict[str, Any]:
    """A recipe whose cubin differs from every other test's (vector_add's bytes do not)."""
    bias = int.from_bytes(os.urandom(3), "little")
    return {
        "source": (
            f'extern "C" __global__ void vbias(float* out, const float* a, int n) {{\n'
            f"  int i = blockIdx.x * blockDim.x + threadIdx.x;  // {tag}\n"
            f"  if (i < n) out[i] = a[i] + {bias}.0f;\n}}\n"
        ),
        "target": "sm_80",
    }


class Cluster:
    """Two replicas on one PostgreSQL database and one bucket, each with its own data dir."""

    def __init__(self, root: Path, db_url: str, server: S3Server, store_url: str) -> None:
        self.root = root
        self.db_url = db_url
        self.store_url = store_url
        self.env = {
            **os.environ,
            **server.env,
            "KCACHE_STORE_URL": store_url,
            "KCACHE_COMPILE_WORKERS": "1",
            "KCACHE_AUDIT_FLUSH_S": "0.1",
        }
        # Credentials always given: without them obstore would ask an instance metadata service.
        self.bucket = S3ArtifactStore.from_url(
            store_url,
            endpoint_url=server.endpoint,
            access_key_id=server.env["AWS_ACCESS_KEY_ID"],
            secret_access_key=server.env["AWS_SECRET_ACCESS_KEY"],
        )
        self.replicas: list[ServerProcess] = []

    def replica(self, name: str, **env: str) -> ServerProcess:
        """Start a replica with a fresh data directory of its own."""
        proc = ServerProcess(self.root / name, db_url=self.db_url, env={**self.env, **env})
        self.replicas.append(proc)
        proc.start(ready="/healthz")
        return proc

    def stop(self) -> None:
        for proc in self.replicas:
            proc.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    server = s3_server()
    with pg_database() as db_url:
        upgrade(db_url)
        root = tmp_path_factory.mktemp("replicas")
        cluster = Cluster(root, db_url, server, f"s3://{server.new_bucket()}/kcache")
        try:
            cluster.replica("a")
            cluster.replica("b")
            yield cluster
        finally:
            cluster.stop()


def _local_blobs(data_dir: Path) -> set[str]:
    return {p.name for p in (data_dir / "blobs").glob("*/*/*") if len(p.name) == 64}


def test_a_kernel_compiled_through_one_replica_is_fetched_from_the_other(cluster: Cluster) -> None:
    a, b = cluster.replicas[:2]
    recipe = vector_add(unique("ab"))
    answer = httpx.post(f"{a.url}/v1/resolve", json={"recipe": recipe}, timeout=120)
    assert answer.status_code == 200 and answer.json()["status"] == "compiled", answer.text
    key, digest = answer.json()["recipe_key"], answer.json()["artifact"]["digest"]
    assert digest in set(cluster.bucket.digests())  # published to the bucket ...
    assert digest not in _local_blobs(b.data_dir)  # ... and B shares no directory with A
    fetched = httpx.get(f"{b.url}/v1/recipes/{key}/artifact", timeout=30)
    assert fetched.status_code == 200, fetched.text
    assert hashlib.sha256(fetched.content).hexdigest() == digest
    assert fetched.content == cluster.bucket.get(digest)
    assert digest in _local_blobs(b.data_dir)  # B keeps a local copy for the next fetch
    head = httpx.head(f"{b.url}/v1/blobs/{digest}", timeout=30)
    assert head.status_code == 200 and int(head.headers["content-length"]) == len(fetched.content)


def test_identical_misses_across_replicas_compile_once_and_upload_one_object(
    cluster: Cluster,
) -> None:
    a, b = cluster.replicas[:2]
    before = set(cluster.bucket.digests())
    recipe = _distinct_kernel(unique("flight"))
    urls = [a.url, b.url] * 8  # 16 identical misses, split across the replicas

    def ask(url: str) -> httpx.Response:
        return httpx.post(f"{url}/v1/resolve", json={"recipe": recipe}, timeout=120)

    with ThreadPoolExecutor(max_workers=len(urls)) as pool:
        answers = list(pool.map(ask, urls))
    assert all(r.status_code == 200 for r in answers), [r.text for r in answers]
    statuses = Counter(r.json()["status"] for r in answers)
    assert statuses["compiled"] == 1, statuses  # single flight across replicas (advisory lock)
    assert {r.json()["artifact"]["digest"] for r in answers} == set(
        cluster.bucket.digests()
    ) - before


def test_a_replica_with_an_empty_data_dir_serves_every_existing_recipe(cluster: Cluster) -> None:
    a = cluster.replicas[0]
    recipes = [_distinct_kernel(unique(f"cold-{i}")) for i in range(3)]
    keys = {}
    for recipe in recipes:
        answer = httpx.post(f"{a.url}/v1/resolve", json={"recipe": recipe}, timeout=120)
        assert answer.status_code == 200, answer.text
        keys[answer.json()["recipe_key"]] = answer.json()["artifact"]["digest"]
    cold = cluster.replica("cold")
    assert not _local_blobs(cold.data_dir)
    for key, digest in keys.items():
        fetched = httpx.get(f"{cold.url}/v1/recipes/{key}/artifact", timeout=30)
        assert fetched.status_code == 200, fetched.text
        assert hashlib.sha256(fetched.content).hexdigest() == digest
    assert set(keys.values()) <= _local_blobs(cold.data_dir)


def test_bucket_down_is_503_with_retry_after_and_nothing_half_written(cluster: Cluster) -> None:
    """A replica whose bucket is unreachable answers 503 + Retry-After; nothing is indexed."""
    a = cluster.replicas[0]
    known = httpx.post(
        f"{a.url}/v1/resolve", json={"recipe": vector_add(unique("known"))}, timeout=120
    ).json()
    down = cluster.replica("down", AWS_ENDPOINT_URL="http://127.0.0.1:9")
    fetch = httpx.get(f"{down.url}/v1/recipes/{known['recipe_key']}/artifact", timeout=60)
    assert fetch.status_code == 503 and fetch.json()["error"] == "store_unavailable", fetch.text
    assert int(fetch.headers["retry-after"]) >= 1
    assert "127.0.0.1:9" not in fetch.text  # the endpoint stays in the log
    recipe = vector_add(unique("down"))
    compile_ = httpx.post(f"{down.url}/v1/resolve", json={"recipe": recipe}, timeout=120)
    assert compile_.status_code == 503 and "retry-after" in compile_.headers, compile_.text
    assert compile_.json()["error"] == "store_unavailable"
    # Nothing was indexed: a healthy replica compiles it afresh.
    again = httpx.post(f"{a.url}/v1/resolve", json={"recipe": recipe}, timeout=120)
    assert again.status_code == 200 and again.json()["status"] == "compiled", again.text
