"""``GET /v1/jobs/{job}/manifest`` and ``POST /v1/bundle`` on a real server (a thread: NVRTC, SQLite)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from kcache_server.settings import Settings

from kcache.bundle_format import BundleEntry, BundleMissing, BundleReader
from kcache.job_manifest import JobManifest
from kcache.signing import TrustedKeys
from tests.support import ServerThread, unique, vector_add


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    server = ServerThread(
        Settings(
            data_dir=tmp_path_factory.mktemp("jobs") / "data",
            compile_workers=1,
            audit={"flush_s": 0.05},
        )
    )
    yield server
    server.stop()


def _resolve(server: ServerThread, job: str, tag: str) -> dict[str, object]:
    recipe = vector_add(tag) if len(tag) != 64 else _recipes[tag]
    body = {"recipe": recipe, "context": {"job_id": job, "rank": 0}}
    answer = server.client().post("/v1/resolve", json=body)
    assert answer.status_code == 200, answer.text
    result: dict[str, object] = answer.json()
    _recipes[str(result["recipe_key"])] = recipe
    return result


_recipes: dict[str, dict[str, object]] = {}


def test_a_jobs_manifest_lists_what_it_was_served(server: ServerThread) -> None:
    job = unique("job")
    empty = server.client().get(f"/v1/jobs/{job}/manifest")
    assert empty.status_code == 200 and empty.json()["kernels"] == []
    first, second = _resolve(server, job, unique()), _resolve(server, job, unique())
    _resolve(server, job, str(first["recipe_key"]))  # the same recipe again: one kernel
    _resolve(server, unique("other"), unique())  # another job's stays out
    body = server.client().get(f"/v1/jobs/{job}/manifest").json()
    manifest = JobManifest.from_dict(body)  # what the server says parses as the shared format
    assert manifest.recipe_keys == sorted({str(first["recipe_key"]), str(second["recipe_key"])})
    kernel = next(k for k in manifest.kernels if k.recipe_key == first["recipe_key"])
    artifact = first["artifact"]
    assert isinstance(artifact, dict)
    assert (kernel.digest, kernel.size, kernel.kind) == (
        artifact["digest"],
        artifact["size"],
        "cubin",
    )
    assert body["digest"] == manifest.digest and body["version"] == 1


def test_a_bundle_streams_signed_entries_and_says_what_is_missing(
    server: ServerThread, tmp_path: Path
) -> None:
    got = _resolve(server, unique("b"), unique())
    key = str(got["recipe_key"])
    absent = "0" * 64
    job = unique("prefetching-job")
    reply = server.client().post(
        "/v1/bundle",
        json={"recipe_keys": [key, absent, key], "context": {"job_id": job}},
    )
    assert reply.status_code == 200 and reply.headers["content-type"].startswith(
        "application/x-kcache-bundle"
    )
    items = list(BundleReader([reply.content], max_entry_bytes=1 << 20, where="bundle"))
    assert [type(i) for i in items] == [BundleEntry, BundleMissing]  # each key once
    entry = items[0]
    assert isinstance(entry, BundleEntry) and entry.recipe_key == key
    published = server.client().get("/v1/keys").json()["keys"][0]["public_key"]
    TrustedKeys([published]).verify(key, entry.meta, entry.signature)
    # The bundle's lookups are the job's: its manifest lists what it prefetched.
    assert JobManifest.from_dict(
        server.client().get(f"/v1/jobs/{job}/manifest").json()
    ).recipe_keys == [key]


@pytest.mark.parametrize(
    "body",
    [
        {"recipe_keys": []},
        {"recipe_keys": ["not-a-key"]},
        {"keys": ["0" * 64]},
        {"recipe_keys": ["0" * 64] * 10_001},
    ],
)
def test_a_bad_bundle_request_is_refused(server: ServerThread, body: dict[str, object]) -> None:
    assert server.client().post("/v1/bundle", json=body).status_code == 422


def test_a_job_id_too_long_is_refused(server: ServerThread) -> None:
    assert server.client().get(f"/v1/jobs/{'j' * 257}/manifest").status_code == 422
