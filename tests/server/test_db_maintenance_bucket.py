"""``kcache db verify`` and ``kcache db gc`` on a server whose blobs are in a bucket.

Before: both looked at the data directory only. After the bucket lost objects,
``db verify`` re-hashed the replica's local copies and reported nothing missing; orphan
objects in the bucket (a compile that stored its object and died before its row) were
never collected. Now both work on the configured store, the bucket itself: verify
fetches and hashes every object (or ``--sample N`` rows' objects) and lists every row
whose object is gone; gc deletes unnamed objects older than the grace, keeps younger
ones and named ones, and ``--dry-run`` deletes nothing.

Real parts: ``kcache serve`` on SQLite with ``KCACHE_STORE_URL`` (its data directory
keeps local copies of every blob it compiled), the commands as a user runs them, and
a bucket on moto's S3 server.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

import kcache.store.s3 as s3_module
from kcache.store.s3 import S3ArtifactStore
from tests.s3_server import S3Server, s3_server
from tests.support import KCACHE, ServerProcess, unique, vector_add

ROWS = 4


@dataclass
class Stored:
    """A server's data directory, its bucket, and the digests its rows name."""

    data_dir: Path
    env: dict[str, str]
    bucket: S3ArtifactStore
    digests: list[str]

    def kcache(self, *args: str) -> tuple[int, dict[str, Any], str]:
        done = subprocess.run(
            [KCACHE, "db", *args, "--data-dir", str(self.data_dir)],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        report = json.loads(done.stdout) if done.stdout.strip() else {}
        return done.returncode, report, done.stderr

    def local_copies(self) -> set[str]:
        return {p.name for p in (self.data_dir / "blobs").glob("*/*/*") if len(p.name) == 64}


def _client(server: S3Server, store_url: str) -> S3ArtifactStore:
    return S3ArtifactStore.from_url(
        store_url,
        endpoint_url=server.endpoint,
        access_key_id=server.env["AWS_ACCESS_KEY_ID"],
        secret_access_key=server.env["AWS_SECRET_ACCESS_KEY"],
    )


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stored]:
    """A server that compiled ``ROWS`` distinct kernels into a fresh bucket, then stopped."""
    server = s3_server()
    store_url = f"s3://{server.new_bucket('maint')}/kcache"
    data_dir = Path(tmp_path_factory.mktemp("maint")) / "data"
    env = {
        **os.environ,
        **server.env,
        "KCACHE_STORE_URL": store_url,
        "KCACHE_COMPILE_WORKERS": "1",
        "KCACHE_VERIFY_ENABLED": "false",
    }
    digests = []
    with ServerProcess(data_dir, env=env) as replica:
        for i in range(ROWS):
            recipe = vector_add(unique(f"maint-{i}"))  # other code, so other bytes:
            recipe["source"] = recipe["source"].replace("+ b[i]", f"+ b[i] * {i + 2}.0f")
            answer = httpx.post(f"{replica.url}/v1/resolve", json={"recipe": recipe}, timeout=120)
            assert answer.status_code == 200, answer.text
            digests.append(answer.json()["artifact"]["digest"])
    assert len(set(digests)) == ROWS
    yield Stored(data_dir, env, _client(server, store_url), digests)


def test_verify_checks_the_bucket_not_the_local_copies(stored: Stored) -> None:
    code, report, err = stored.kcache("verify")
    assert code == 0, (report, err)
    assert report["store"] == stored.bucket.url and report["rows"] == ROWS
    assert report["checked"] >= ROWS and report["missing"] == report["corrupt"] == []
    lost = stored.digests[:2]
    for digest in lost:
        assert stored.bucket.delete(digest)
    assert set(stored.digests) <= stored.local_copies()  # the replica still holds every copy
    code, report, _ = stored.kcache("verify")
    assert code == 1 and report["missing"] == sorted(lost) and report["sampled"] is None
    # A sample of every row finds the same; a sample of one checks one.
    code, report, _ = stored.kcache("verify", "--sample", "100")
    assert code == 1 and report["missing"] == sorted(lost) and report["sampled"] == ROWS
    code, report, _ = stored.kcache("verify", "--sample", "1")
    assert report["checked"] == report["sampled"] == 1
    for digest in lost:  # put back for the tests after this one
        stored.bucket.put(
            (stored.data_dir / "blobs" / digest[:2] / digest[2:4] / digest).read_bytes()
        )
    assert stored.kcache("verify")[0] == 0


def _flipped(data: bytes) -> bytes:
    middle = len(data) // 2
    return data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1 :]


def test_verify_finds_an_object_whose_bytes_changed(stored: Stored) -> None:
    import obstore

    digest = stored.digests[-1]
    good = stored.bucket.get(digest)
    obstore.put(stored.bucket._store, stored.bucket.key(digest), _flipped(good))
    code, report, _ = stored.kcache("verify", "--sample", str(ROWS))
    assert code == 1 and report["corrupt"] == [digest] and report["missing"] == []
    assert not stored.bucket.has(digest)  # quarantined, as a local store's verify does
    stored.bucket.put(good)
    assert stored.kcache("verify")[0] == 0


def test_gc_collects_old_orphan_objects_keeps_young_and_named_ones(stored: Stored) -> None:
    grace = 6.0
    old = [stored.bucket.put(os.urandom(2000)) for _ in range(3)]  # stored, never recorded
    time.sleep(grace + 2)
    young = [stored.bucket.put(os.urandom(1000)) for _ in range(2)]
    gc = ("gc", "--grace", str(grace), "--force")
    code, report, err = stored.kcache(*gc, "--dry-run")
    assert code == 0, err
    assert report == {"temp_files": 0, "blobs": 3, "bytes_freed": 6000, "dry_run": True}
    listed = set(stored.bucket.digests())
    assert set(old) | set(young) | set(stored.digests) <= listed  # nothing was deleted
    code, report, err = stored.kcache(*gc)
    assert code == 0, err
    assert (report["blobs"], report["bytes_freed"], report["dry_run"]) == (3, 6000, False)
    listed = set(stored.bucket.digests())
    assert not set(old) & listed
    assert set(young) | set(stored.digests) <= listed
    assert stored.kcache("verify")[0] == 0  # every row's object is still there


def test_gc_refuses_a_grace_below_the_safe_minimum(stored: Stored) -> None:
    code, _, err = stored.kcache("gc", "--grace", "5")
    assert code == 2 and "--force" in err


def test_storing_bytes_already_there_renews_an_old_objects_age(
    stored: Stored, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reused orphan gets the collector's full grace again (a local store touches the file)."""
    data = os.urandom(500)
    digest = stored.bucket.put(data)
    first = stored.bucket.blob_info(digest)
    assert first is not None
    time.sleep(1.2)  # Last-Modified has whole seconds
    stored.bucket.put(data)  # young: not written again
    assert stored.bucket.blob_info(digest) == first
    monkeypatch.setattr(s3_module, "REFRESH_AFTER_S", 0.5)  # "old" now
    stored.bucket.put(data)
    renewed = stored.bucket.blob_info(digest)
    assert renewed is not None and renewed[1] > first[1] and stored.bucket.get(digest) == data
