"""A bucket that does not exist (a typo in ``KCACHE_STORE_URL``) reads as missing, not healthy.

Before: ``/readyz`` said ``"bucket": "ok"`` (its probe, a HEAD of one object, took the
bucket's bodiless 404 for "no such object"), and every compile answered ``404
not_found: no artifact for recipe ... (and compile is false)`` with compile true (the
PUT's ``NoSuchBucket`` became "no such blob"). Now readiness lists the bucket and says it
does not exist, naming the setting; a compile answers 503 ``store_unavailable`` naming
the bucket; an existing bucket still reads ``ok``.

Real parts: ``kcache serve`` on SQLite with ``KCACHE_STORE_URL`` and the session's moto S3
server.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kcache.errors import StoreUnavailableError
from kcache.store.s3 import S3ArtifactStore
from tests.s3_server import S3Server, s3_server
from tests.support import VECTOR_ADD, ServerProcess

MISSING = "kcache-no-such-bucket"


@pytest.fixture(scope="module")
def s3() -> S3Server:
    return s3_server()


@pytest.fixture(scope="module")
def replica(s3: S3Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    env = {
        **os.environ,
        **s3.env,
        "KCACHE_STORE_URL": f"s3://{MISSING}/kcache",
        "KCACHE_COMPILE_WORKERS": "1",
        "KCACHE_VERIFY_ENABLED": "false",
    }
    root = Path(tmp_path_factory.mktemp("missing-bucket"))
    with ServerProcess(root / "data", env=env) as server:
        yield server


def _store(s3: S3Server, bucket: str) -> S3ArtifactStore:
    return S3ArtifactStore.from_url(
        f"s3://{bucket}/kcache",
        endpoint_url=s3.endpoint,
        access_key_id=s3.env["AWS_ACCESS_KEY_ID"],
        secret_access_key=s3.env["AWS_SECRET_ACCESS_KEY"],
    )


def test_the_probe_tells_a_missing_bucket_from_an_empty_one(s3: S3Server) -> None:
    _store(s3, s3.new_bucket("exists")).probe()  # empty, reachable: no error
    with pytest.raises(
        StoreUnavailableError, match=f"'{MISSING}' does not exist.*KCACHE_STORE_URL"
    ):
        _store(s3, MISSING).probe()


def test_a_write_into_a_missing_bucket_is_unavailable_not_not_found(s3: S3Server) -> None:
    with pytest.raises(StoreUnavailableError, match="does not exist"):
        _store(s3, MISSING).put(b"a blob")


def test_readiness_names_the_missing_bucket(replica: ServerProcess) -> None:
    response = httpx.get(f"{replica.url}/readyz", timeout=60)
    assert response.status_code == 503, response.text
    checks = response.json()["checks"]
    assert checks["bucket"].startswith("failed: the bucket")
    assert MISSING in checks["bucket"] and "KCACHE_STORE_URL" in checks["bucket"]


def test_a_compile_answers_503_naming_the_bucket(replica: ServerProcess) -> None:
    body = {"recipe": {"source": VECTOR_ADD + "\n// missing bucket\n", "target": "sm_90"}}
    response = httpx.post(f"{replica.url}/v1/resolve", json={**body, "compile": True}, timeout=120)
    assert response.status_code == 503, response.text
    error = response.json()
    assert error["error"] == "store_unavailable"
    assert MISSING in error["detail"] and "does not exist" in error["detail"]
