"""The v1 API against a real uvicorn with real NVRTC and SQLite."""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

import httpx

from tests.support import audit_rows, unique, vector_add

BROKEN = {"source": "__global__ void broken() { this is not cuda; }", "target": "sm_80"}


def test_compiled_then_hit_and_both_artifact_routes_serve_the_digest(
    make_settings: Any, serve: Any
) -> None:
    server = serve(make_settings())
    recipe = vector_add(unique())
    with server.client() as client:
        first = client.post("/v1/resolve", json={"recipe": recipe})
        assert first.status_code == 200, first.text
        body = first.json()
        assert body["status"] == "compiled"
        digest = body["artifact"]["digest"]
        key = body["recipe_key"]
        assert body["artifact"]["kind"] == "cubin" and body["artifact"]["target"] == "sm_80"

        second = client.post("/v1/resolve", json={"recipe": recipe})
        assert second.status_code == 200
        assert second.json()["status"] == "hit"
        assert second.json()["artifact"]["digest"] == digest

        by_recipe = client.get(f"/v1/recipes/{key}/artifact")
        assert by_recipe.status_code == 200
        assert hashlib.sha256(by_recipe.content).hexdigest() == digest
        assert by_recipe.content.startswith(b"\x7fELF")
        assert by_recipe.headers["etag"] == f'"{digest}"'
        assert by_recipe.headers["x-kcache-digest"] == digest
        # A key's answer ends with a withdrawal: caches ask again before each use (304
        # while the key names the digest); the bytes by digest never change.
        assert by_recipe.headers["cache-control"] == "no-cache"
        assert by_recipe.headers["content-type"] == "application/octet-stream"

        by_digest = client.get(f"/v1/blobs/{digest}")
        assert by_digest.status_code == 200
        assert hashlib.sha256(by_digest.content).hexdigest() == digest
        assert by_digest.headers["etag"] == f'"{digest}"'
        assert "immutable" in by_digest.headers["cache-control"]

        head = client.head(f"/v1/blobs/{digest}")
        assert head.status_code == 200 and head.content == b""
        assert int(head.headers["content-length"]) == len(by_digest.content)

        for path in (f"/v1/blobs/{digest}", f"/v1/recipes/{key}/artifact"):
            cached = client.get(path, headers={"If-None-Match": f'"{digest}"'})
            assert cached.status_code == 304 and cached.content == b""

        meta = client.get(f"/v1/recipes/{key}")
        assert meta.status_code == 200
        assert meta.json()["digest"] == digest and meta.json()["size"] == len(by_digest.content)


def test_miss_without_compile_is_404_then_hit_after_compiling(
    make_settings: Any, serve: Any
) -> None:
    server = serve(make_settings())
    recipe = vector_add(unique())
    with server.client() as client:
        miss = client.post("/v1/resolve", json={"recipe": recipe, "compile": False})
        assert miss.status_code == 404
        assert miss.json()["error"] == "not_found" and "compile is false" in miss.json()["detail"]
        assert client.post("/v1/resolve", json={"recipe": recipe}).json()["status"] == "compiled"
        hit = client.post("/v1/resolve", json={"recipe": recipe, "compile": False})
        assert hit.status_code == 200 and hit.json()["status"] == "hit"
        unknown = "0" * 64
        assert client.get(f"/v1/recipes/{unknown}").status_code == 404
        assert client.get(f"/v1/recipes/{unknown}/artifact").json()["error"] == "not_found"
        assert client.get(f"/v1/blobs/{unknown}").status_code == 404
        assert client.head(f"/v1/blobs/{unknown}").status_code == 404


def test_broken_recipe_is_422_with_the_log_and_is_not_compiled_again(
    make_settings: Any, serve: Any
) -> None:
    settings = make_settings()
    server = serve(settings)
    recipe = {**BROKEN, "source": BROKEN["source"] + f"\n// {unique()}"}
    with server.client() as client:
        first = client.post("/v1/resolve", json={"recipe": recipe})
        assert first.status_code == 422
        body = first.json()
        assert body["error"] == "compile_error"
        assert "error" in body["log"] and "kernel.cu" in body["log"]
        assert body["cached"] is False and len(body["recipe_key"]) == 64

        second = client.post("/v1/resolve", json={"recipe": recipe})
        assert second.status_code == 422
        assert second.json()["cached"] is True  # served from the negative entry, no compile
        assert second.json()["log"] == body["log"]
        assert client.get(f"/v1/recipes/{body['recipe_key']}").json()["error"] == "compile_error"
    server.state.audit.flush()
    errors = audit_rows(settings.database_url, recipe_key=body["recipe_key"])
    assert [r.outcome for r in errors] == ["error", "error"]


def test_64_concurrent_identical_requests_compile_once(make_settings: Any, serve: Any) -> None:
    settings = make_settings(compile_workers=2)
    server = serve(settings)
    recipe = vector_add(unique())

    async def burst() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as client:
            return await asyncio.gather(
                *(client.post("/v1/resolve", json={"recipe": recipe}) for _ in range(64))
            )

    responses = asyncio.run(burst())
    assert all(r.status_code == 200 for r in responses), [
        r.text for r in responses if r.status_code != 200
    ]
    statuses = [r.json()["status"] for r in responses]
    assert statuses.count("compiled") == 1
    assert set(statuses) <= {"compiled", "waited", "hit"}
    assert "waited" in statuses  # the others really joined the one compile
    assert len({r.json()["artifact"]["digest"] for r in responses}) == 1
    server.state.audit.flush()
    key = responses[0].json()["recipe_key"]
    assert len(audit_rows(settings.database_url, recipe_key=key, outcome="compiled")) == 1
    # Every request is one lookup; identical hits may share a row whose count says how many.
    assert sum(row.count for row in audit_rows(settings.database_url, recipe_key=key)) == 64


def test_batch_compiles_misses_and_reports_each_result(make_settings: Any, serve: Any) -> None:
    server = serve(make_settings(compile_workers=2))
    tag = unique()
    good = [vector_add(f"{tag}-{i}") for i in range(4)]
    with server.client() as client:
        assert client.post("/v1/resolve", json={"recipe": good[0]}).json()["status"] == "compiled"
        batch = [
            *good,
            {**BROKEN, "source": BROKEN["source"] + f"// {tag}"},
            {"source": "x", "target": "sm_1"},
        ]
        response = client.post(
            "/v1/resolve/batch", json={"recipes": batch, "context": {"job_id": tag, "rank": 0}}
        )
        assert response.status_code == 200, response.text
        results = response.json()["results"]
        assert len(results) == 6
        assert results[0]["status"] == "hit"
        assert [r["status"] for r in results[1:4]] == ["compiled"] * 3
        assert (
            results[4]["status"] == "error"
            and results[4]["error"] == "compile_error"
            and results[4]["log"]
        )
        assert results[5]["status"] == "error" and results[5]["error"] == "invalid_recipe"
        assert results[5]["field"] == "target"
        again = client.post("/v1/resolve/batch", json={"recipes": good, "compile": False}).json()[
            "results"
        ]
        assert [r["status"] for r in again] == ["hit"] * 4


def test_audit_events_carry_the_context(make_settings: Any, serve: Any) -> None:
    settings = make_settings()
    server = serve(settings)
    context = {
        "client_id": "c1",
        "host": "node7",
        "pid": 42,
        "job_id": unique("job"),
        "rank": 3,
        "world_size": 8,
    }
    with server.client() as client:
        body = client.post(
            "/v1/resolve", json={"recipe": vector_add(unique()), "context": context}
        ).json()
        client.post(
            "/v1/resolve",
            json={"recipe": vector_add(unique()), "context": context, "compile": False},
        )
        client.get(f"/v1/recipes/{body['recipe_key']}/artifact")
    server.state.audit.flush()
    rows = audit_rows(settings.database_url, job_id=context["job_id"])
    assert sorted(r.outcome for r in rows) == ["compiled", "miss"]
    compiled = next(r for r in rows if r.outcome == "compiled")
    assert (
        compiled.client_id,
        compiled.host,
        compiled.pid,
        compiled.rank,
        compiled.world_size,
    ) == ("c1", "node7", 42, 3, 8)
    assert (
        compiled.kernel == "vadd"
        and compiled.digest == body["artifact"]["digest"]
        and compiled.latency_ms > 0
    )
    fetch = audit_rows(settings.database_url, route="fetch", recipe_key=body["recipe_key"])
    assert [r.outcome for r in fetch] == ["hit"]
    assert fetch[0].compile_seconds_saved > 0


def test_toolchains_health_ready_and_openapi(make_settings: Any, serve: Any, tmp_path: Any) -> None:
    cutlass = tmp_path / "cutlass"
    cutlass.mkdir()
    server = serve(make_settings(include_sets={"cutlass": cutlass}))
    with server.client() as client:
        tc = client.get("/v1/toolchains").json()
        assert (
            tc["default"] == tc["toolchains"][0]["id"] and "sm_80" in tc["toolchains"][0]["targets"]
        )
        assert tc["include_sets"] == ["cutlass"]
        assert client.get("/healthz").json() == {"status": "ok"}
        ready = client.get("/readyz").json()
        assert ready["status"] == "ready"
        assert set(ready["checks"]) >= {"database", "store", "compile_workers", "compile_sandbox"}
        paths = client.get("/openapi.json").json()["paths"]
        for path in (
            "/v1/resolve",
            "/v1/resolve/batch",
            "/v1/recipes/{recipe_key}/artifact",
            "/v1/blobs/{digest}",
        ):
            assert path in paths
