"""Explain knows a hit (issue 45, item 3): ``POST /v1/explain``, ``GET /v1/recipes/{key}/explain``
and ``kcache explain`` say first whether the server holds the recipe and how.

A recipe served as ``hit`` used to be explained as a miss against the nearest *other*
recipe (``target sm_89 -> sm_90``), and ``kcache explain e629d63b...`` (the 16 digits
``kcache cache ls`` and the dashboard print) was read as a file name. Here: held by its
exact key, held through a dependency-aware (manifest) match without the explanation
recording an alias, seen before (evicted), a remembered failed compile, and key
prefixes (whole, unknown, ambiguous, malformed), by the API and the real command.

One real server (uvicorn, NVRTC, SQLite) for the module.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kcache.recipe import Recipe
from tests.support import KCACHE, ServerThread, unique


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    from kcache_server import Settings
    from kcache_server.settings import AuditSettings

    settings = Settings(
        data_dir=tmp_path_factory.mktemp("explain-held") / "data",
        compile_workers=1,
        audit=AuditSettings(flush_s=0.05),
        auth_cache_s=0.0,
    )
    running = ServerThread(settings)
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def http(server: ServerThread) -> Iterator[httpx.Client]:
    with server.client() as client:
        yield client


def kernel(name: str, **fields: Any) -> dict[str, Any]:
    recipe: dict[str, Any] = {
        "source": (
            f'extern "C" __global__ void {name}(float* x, int n) {{\n'
            "  int i = blockIdx.x * blockDim.x + threadIdx.x;\n"
            "  if (i < n) x[i] *= 2.0f;\n"
            "}\n"
        ),
        "name": "k.cu",
        "target": "sm_90",
    }
    recipe.update(fields)
    return recipe


def _key(server: ServerThread, recipe: dict[str, Any]) -> str:
    return str(server.state.backends.engine.prepare(Recipe.from_dict(recipe)).key())


def _resolve(http: httpx.Client, recipe: dict[str, Any], compile: bool = True) -> dict[str, Any]:
    r = http.post("/v1/resolve", json={"recipe": recipe, "compile": compile})
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def _explain(server: ServerThread, tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [KCACHE, "explain", *args, "--server", server.url],
        capture_output=True,
        text=True,
        check=False,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )


def test_a_recipe_served_as_hit_is_held_by_its_key(
    server: ServerThread, http: httpx.Client, tmp_path: Path
) -> None:
    """The issue's case: a recipe near another (sm_89) and served as hit is not a miss."""
    name = f"k_{unique().replace('-', '_')}"
    other, recipe = kernel(name, target="sm_89"), kernel(name)
    assert _resolve(http, other)["status"] == "compiled"
    compiled = _resolve(http, recipe)
    assert compiled["status"] == "compiled"
    for _ in range(3):
        assert _resolve(http, recipe)["status"] == "hit"
    key, digest = compiled["recipe_key"], compiled["artifact"]["digest"]
    held_line = f"held by its exact key: artifact {digest[:16]}"

    by_body = http.post("/v1/explain", json={"recipe": recipe}).json()
    by_key = http.get(f"/v1/recipes/{key}/explain").json()
    by_prefix = http.get(f"/v1/recipes/{key[:16]}/explain").json()
    for body in (by_body, by_key, by_prefix):
        assert body["recipe_key"] == key
        assert body["held"] == "key" and body["digest"] == digest, body
        assert body["text"] == held_line
        assert body["failure"] is None and body["seen_before"] is False
        # What set it apart from the nearest other recipe is still there, for --json.
        assert body["nearest_key"] == _key(server, other)

    path = tmp_path / "recipe.json"
    path.write_text(json.dumps(recipe))
    for given in (key[:16], key, str(path)):
        result = _explain(server, tmp_path, given)
        assert result.returncode == 0, result.stderr
        assert result.stdout.splitlines() == [held_line], result.stdout
        assert "sm_89" not in result.stdout + result.stderr
    assert f"recipe {key}" in _explain(server, tmp_path, key[:16]).stderr


def test_a_dependency_aware_match_is_held_through_the_manifest(
    server: ServerThread, http: httpx.Client
) -> None:
    """Another recipe of the kernel whose compile never read the differing header."""
    name = f"k_{unique().replace('-', '_')}"
    first = kernel(name, headers={"unused.h": "// 1\n"})
    compiled = _resolve(http, first)
    assert compiled["status"] == "compiled"
    second = kernel(name, headers={"unused.h": "// 2\n"})
    second_key = _key(server, second)

    body = http.post("/v1/explain", json={"recipe": second}).json()
    assert body["held"] == "manifest", body
    assert body["digest"] == compiled["artifact"]["digest"]
    assert body["text"].startswith("held through a dependency-aware match: artifact ")
    assert body["recipe_key"] == second_key
    # Asking wrote nothing: no alias for the second recipe until a resolve finds the match.
    assert server.state.backends.index.lookup(second_key) is None
    hit = _resolve(http, second, compile=False)
    assert hit["status"] == "hit" and hit["artifact"]["digest"] == compiled["artifact"]["digest"]


def test_an_evicted_recipe_was_seen_before(
    server: ServerThread, http: httpx.Client, tmp_path: Path
) -> None:
    name = f"k_{unique().replace('-', '_')}"
    base, evicted = kernel(name), kernel(name, flags=["-lineinfo"])
    _resolve(http, base)
    key = _resolve(http, evicted)["recipe_key"]
    removed = http.post("/v1/cache/remove", json={"keys": [key]})
    assert removed.status_code == 200, removed.text

    for body in (
        http.get(f"/v1/recipes/{key[:12]}/explain").json(),
        http.post("/v1/explain", json={"recipe": evicted}).json(),
    ):
        assert body["held"] is None and body["seen_before"] is True, body
        assert body["nearest_key"] == _key(server, base)
        assert body["differences"] == ["flag -lineinfo added"]
        assert body["text"].startswith("seen before: its artifact was evicted")
    result = _explain(server, tmp_path, key[:16])
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "seen before: its artifact was evicted, collected or set aside since",
        "flag -lineinfo added",
    ]


def test_a_failed_compile_is_said_to_be_remembered(
    server: ServerThread, http: httpx.Client, tmp_path: Path
) -> None:
    broken = kernel(f"k_{unique().replace('-', '_')}")
    broken["source"] += "this is not CUDA;\n"
    r = http.post("/v1/resolve", json={"recipe": broken})
    assert r.status_code == 422 and r.json()["error"] == "compile_error", r.text
    key = _key(server, broken)

    for body in (
        http.post("/v1/explain", json={"recipe": broken}).json(),
        http.get(f"/v1/recipes/{key}/explain").json(),
    ):
        assert body["held"] is None and body["failure"] == "error", body
        assert body["text"].startswith("not held: its compile failed (error)")
        assert "this is not CUDA" not in json.dumps(body)  # never the log
    result = _explain(server, tmp_path, key[:16])
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("not held: its compile failed (error)")


def test_key_prefixes_unknown_ambiguous_and_malformed(
    server: ServerThread, http: httpx.Client, tmp_path: Path
) -> None:
    # Two recorded recipes whose keys begin with the same four digits.
    seen: dict[str, Recipe] = {}
    engine = server.state.backends.engine
    for i in range(100_000):
        recipe = engine.prepare(Recipe.from_dict(kernel(f"k_amb_{i}")))
        twin = seen.get(recipe.key()[:4])
        if twin is not None:
            break
        seen[recipe.key()[:4]] = recipe
    else:
        pytest.fail("no two keys share four digits")
    for each in (twin, recipe):
        server.state.recipe_records.record(each)
    prefix = recipe.key()[:4]

    r = http.get(f"/v1/recipes/{prefix}/explain")
    assert r.status_code == 400 and r.json()["error"] == "bad_request", r.text
    detail = r.json()["detail"]
    assert "ambiguous" in detail and "more of its digits" in detail
    assert twin.key()[:16] in detail and recipe.key()[:16] in detail
    result = _explain(server, tmp_path, prefix)
    assert result.returncode != 0 and "ambiguous" in result.stderr, result.stderr

    # Longer, it is one of them: recorded, not held (never compiled), nothing else near.
    longer = http.get(f"/v1/recipes/{recipe.key()[:20]}/explain").json()
    assert longer["recipe_key"] == recipe.key() and longer["held"] is None

    unknown = "f" * 15 + "0"
    while server.state.recipe_records.keys_starting(unknown):
        unknown = unknown[:-1] + format(int(unknown[-1], 16) + 1, "x")
    r = http.get(f"/v1/recipes/{unknown}/explain")
    assert r.status_code == 404 and "no recipe key this server knows begins" in r.text, r.text

    for bad in ("abc", "ABCDEF12", "g" * 16, "a" * 65):
        r = http.get(f"/v1/recipes/{bad}/explain")
        assert r.status_code == 400 and "recipe_key" in r.json()["detail"], (bad, r.text)


def test_a_held_recipe_recorded_without_its_body_is_held_by_key(
    server: ServerThread, http: httpx.Client
) -> None:
    """A recipe too large to keep whole (only its fingerprint): its key is enough to say held."""
    import os

    from kcache_server.recipe_records import MAX_BODY_BYTES

    big = kernel(
        f"k_{unique().replace('-', '_')}", headers={"big.h": os.urandom(MAX_BODY_BYTES).hex()}
    )
    compiled = _resolve(http, big)
    key = compiled["recipe_key"]
    server.state.audit.flush()
    assert server.state.recipe_records.recipe(key) is None  # not kept whole
    body = http.get(f"/v1/recipes/{key[:16]}/explain").json()
    assert body["held"] == "key" and body["digest"] == compiled["artifact"]["digest"], body
