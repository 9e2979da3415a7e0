"""A stored blob that fails verification is a miss with a reason, never a 500 (issue 29, item 2).

Before, with one byte of a stored blob flipped, ``POST /v1/resolve`` (``compile: false``)
said ``hit`` and ``GET /v1/recipes/{key}/artifact`` then answered 500 ``corrupt_artifact``.
Now the fetch answers as for an evicted artifact (404 ``not_found``, its detail saying the
stored copy failed its check and was set aside), resolve never says ``hit`` for bytes
it cannot serve (a miss without ``compile``, a fresh compile with it), and the next
compile repairs the store. Once per module per store: the data directory (local) and a
bucket on moto's S3 server behind the replica's local copies (corrupted in the bucket,
the local copy removed, so the bucket's bytes are the ones read). The servers keep no
blob bytes in memory (``blob_cache_bytes=0``), so every answer reads the store, as a
replica that never served the blob does.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support import ServerThread, unique


@dataclass
class Deployment:
    """A server and how to damage a blob it stores, behind its back."""

    server: ServerThread
    corrupt: Callable[[str], None]


def distinct(tag: str) -> dict[str, Any]:
    """A small kernel whose cubin holds ``tag``'s hash: bytes (and a digest) of its own."""
    seed = hashlib.sha256(tag.encode()).hexdigest()
    return {
        "source": (
            f'extern "C" __device__ const char kc_tag[65] = "{seed}";\n'
            'extern "C" __global__ void vtag(float* out, const float* a, int n) {\n'
            "  int i = blockIdx.x * blockDim.x + threadIdx.x;\n"
            "  if (i < n) out[i] = a[i] + kc_tag[i % 64];\n"
            "}\n"
        ),
        "target": "sm_80",
    }


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    os.chmod(path, 0o644)
    with path.open("r+b") as f:  # in place: same inode, same size
        f.write(bytes(data))


def _settings(data_dir: Path, **extra: Any) -> Any:
    from kcache_server import Settings

    return Settings(
        data_dir=data_dir,
        compile_workers=1,
        audit={"flush_s": 0.05},
        auth_cache_s=0.0,
        blob_cache_bytes=0,
        **extra,
    )


@pytest.fixture(scope="module", params=["local", "s3"])
def deployment(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Deployment]:
    """One server per store for the module."""
    data = tmp_path_factory.mktemp(f"corrupt-{request.param}") / "data"
    if request.param == "local":
        server = ServerThread(_settings(data))

        def corrupt_local(digest: str) -> None:
            _flip_a_byte(server.state.backends.store.path(digest))

        yield Deployment(server, corrupt_local)
        server.stop()
        return

    import obstore

    from kcache.store.s3 import S3ArtifactStore
    from tests.s3_server import s3_server

    bucket_server = s3_server()
    with pytest.MonkeyPatch.context() as patch:
        for name, value in bucket_server.env.items():
            patch.setenv(name, value)
        store_url = f"s3://{bucket_server.new_bucket()}/kcache"
        bucket = S3ArtifactStore.from_url(store_url)
        server = ServerThread(_settings(data, store_url=store_url))

        def corrupt_in_bucket(digest: str) -> None:
            raw = bucket._store  # the obstore client: written behind the server's back
            good = bytearray(bucket.get(digest))
            good[len(good) // 2] ^= 0x01
            obstore.put(raw, bucket.key(digest), bytes(good))
            server.state.backends.store.path_local(digest).unlink()  # the bucket's copy is read

        try:
            yield Deployment(server, corrupt_in_bucket)
        finally:
            server.stop()


def _compiled(client: httpx.Client, recipe: dict[str, Any]) -> tuple[str, str]:
    answer = client.post("/v1/resolve", json={"recipe": recipe})
    assert answer.status_code == 200 and answer.json()["status"] == "compiled", answer.text
    return answer.json()["recipe_key"], answer.json()["artifact"]["digest"]


def _set_aside(answer: httpx.Response) -> None:
    """404 ``not_found``, as for an evicted artifact, saying why."""
    assert answer.status_code == 404, answer.text
    body = answer.json()
    assert body["error"] == "not_found", body
    assert "failed its integrity check" in body["detail"] and "set aside" in body["detail"], body
    assert "quarantine" not in body["detail"]  # no server path in the answer


def _repaired(client: httpx.Client, recipe: dict[str, Any], key: str, digest: str) -> None:
    """A resolve that may compile compiles afresh (never ``hit``); the fetch then serves good bytes."""
    again = client.post("/v1/resolve", json={"recipe": recipe})
    assert again.status_code == 200 and again.json()["status"] == "compiled", again.text
    assert again.json()["artifact"]["digest"] == digest
    fetched = client.get(f"/v1/recipes/{key}/artifact")
    assert fetched.status_code == 200, fetched.text
    assert hashlib.sha256(fetched.content).hexdigest() == digest
    hit = client.post("/v1/resolve", json={"recipe": recipe, "compile": False})
    assert hit.status_code == 200 and hit.json()["status"] == "hit", hit.text


def test_resolve_without_compile_is_a_miss_not_a_hit(deployment: Deployment) -> None:
    recipe = distinct(unique("corrupt-resolve"))
    with deployment.server.client() as client:
        key, digest = _compiled(client, recipe)
        deployment.corrupt(digest)
        _set_aside(client.post("/v1/resolve", json={"recipe": recipe, "compile": False}))
        _set_aside(client.get(f"/v1/recipes/{key}/artifact"))  # the same answer on the fetch
        _repaired(client, recipe, key, digest)


def test_the_fetch_by_key_is_a_404_with_a_reason(deployment: Deployment) -> None:
    recipe = distinct(unique("corrupt-fetch"))
    with deployment.server.client() as client:
        key, digest = _compiled(client, recipe)
        deployment.corrupt(digest)
        _set_aside(client.get(f"/v1/recipes/{key}/artifact"))
        _set_aside(client.get(f"/v1/recipes/{key}/artifact"))  # still saying why
        _set_aside(client.get(f"/v1/blobs/{digest}"))
        _repaired(client, recipe, key, digest)


def test_a_batch_without_compile_says_not_found_for_that_recipe(deployment: Deployment) -> None:
    tag = unique("corrupt-batch")
    recipes = [distinct(f"{tag}-good"), distinct(f"{tag}-bad")]
    with deployment.server.client() as client:
        _compiled(client, recipes[0])
        key, digest = _compiled(client, recipes[1])
        deployment.corrupt(digest)
        answer = client.post("/v1/resolve/batch", json={"recipes": recipes, "compile": False})
        assert answer.status_code == 200, answer.text
        good, bad = answer.json()["results"]
        assert good["status"] == "hit", good
        assert bad["status"] == "error" and bad["error"] == "not_found", bad
        assert "failed its integrity check" in bad["detail"], bad
        _repaired(client, recipes[1], key, digest)


def test_a_verified_blob_damaged_later_is_checked_again(deployment: Deployment) -> None:
    """A blob verified once is trusted while its file is unchanged, and read again once it changes."""
    recipe = distinct(unique("corrupt-later"))
    with deployment.server.client() as client:
        key, digest = _compiled(client, recipe)
        time.sleep(2.2)  # older than the window in which a file's change may not show in its times
        for _ in range(3):  # verified once, then trusted from memory
            hit = client.post("/v1/resolve", json={"recipe": recipe, "compile": False})
            assert hit.status_code == 200 and hit.json()["status"] == "hit", hit.text
        deployment.corrupt(digest)
        _set_aside(client.post("/v1/resolve", json={"recipe": recipe, "compile": False}))
        _repaired(client, recipe, key, digest)
