"""Verified hits: planted wrong answers are found, withdrawn and replaced by the fresh compile.

Two ways a cache answers with the wrong kernel, planted in a real server's database: a
recipe key whose alias names another kernel's bytes, and a manifest entry that lacks a
header the compile reads (what a spoiled NVRTC trace once recorded). The verifier,
sampling every hit here, must find both within a bounded time, stop serving them, give
the next request the right kernel, and say so in the metrics and /v1/verification.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from tests.support import ServerThread

ADMIN = "verification-admin-token"


def _kernel(tag: str, value: int, header: str = "") -> dict[str, Any]:
    return {
        "source": f'{header}// {tag}\nextern "C" __global__ void k(int* o) {{ o[0] = {value}; }}\n',
        "target": "sm_90",
    }


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    from kcache_server import Settings
    from kcache_server.auth import TokenStore
    from kcache_server.backends import open_settings_database
    from kcache_server.migrate import prepare_database

    root: Path = tmp_path_factory.mktemp("verification")
    settings = Settings(
        data_dir=root / "data",
        compile_workers=1,
        audit={"flush_s": 0.05},
        auth_cache_s=0.0,
        verify={"sample_rate": 1.0, "cpu_share": 1.0, "period_s": 3600},
    )
    db = open_settings_database(settings)
    prepare_database(settings, db)
    TokenStore(db, 0).create("admin", ["admin"], token=ADMIN)
    db.dispose()
    started = ServerThread(settings)
    yield started
    started.stop()


def _resolve(client: httpx.Client, recipe: dict[str, Any], compile: bool = True) -> dict[str, Any]:
    answer = client.post("/v1/resolve", json={"recipe": recipe, "compile": compile})
    assert answer.status_code == 200, answer.text
    body: dict[str, Any] = answer.json()
    return body


def _divergence(client: httpx.Client, recipe_key: str, timeout: float = 90.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        report = client.get("/v1/verification").raise_for_status().json()
        for item in report["divergences"]:
            if item["recipe_key"] == recipe_key:
                return dict(item)
        time.sleep(0.2)
    raise AssertionError(f"no divergence for {recipe_key} within {timeout}s: {report}")


def test_a_key_planted_on_another_kernels_bytes_is_found_and_replaced(
    server: ServerThread,
) -> None:
    from kcache_server.models import RecipeAlias

    with server.client(ADMIN) as client:
        right = _resolve(client, _kernel("planted-right", 1))
        other = _resolve(client, _kernel("planted-other", 2))
        key = right["recipe_key"]
        with server.state.backends.db.begin() as conn:  # the under-keyed row
            conn.execute(
                sa.update(RecipeAlias)
                .where(RecipeAlias.recipe_key == key)
                .values(digest=other["artifact"]["digest"])
            )
        server.state.resolver.forget(key)  # memory must not hide it
        served = _resolve(client, _kernel("planted-right", 1), compile=False)
        assert served["artifact"]["digest"] == other["artifact"]["digest"]  # the wrong kernel

        found = _divergence(client, key)
        assert found["via"] == "key"
        assert found["stored_digest"] == other["artifact"]["digest"]
        assert found["fresh_digest"] == right["artifact"]["digest"]
        assert any(line.startswith("code:") for line in found["differences"]), found
        again = _resolve(client, _kernel("planted-right", 1), compile=False)
        assert again["artifact"]["digest"] == right["artifact"]["digest"]


def test_a_manifest_entry_missing_a_header_is_found_and_replaced(server: ServerThread) -> None:
    from kcache_server.models import ManifestRow

    headers = {"a.cuh": "#define A 1\n", "b.cuh": "#define B 10\n"}
    source = (
        '#include <a.cuh>\n#include <b.cuh>\n// manifest\nextern "C" __global__ void k(int* o) '
        "{ o[0] = A + B; }\n"
    )
    recipe = {"source": source, "headers": headers, "target": "sm_90"}
    with server.client(ADMIN) as client:
        first = _resolve(client, recipe)
        short = [d for d in first["artifact"]["dependencies"] if d["name"] == "a.cuh"]
        with server.state.backends.db.begin() as conn:  # as a spoiled trace recorded it
            conn.execute(
                sa.update(ManifestRow)
                .where(ManifestRow.base_key == first["base_key"])
                .values(dependencies=short)
            )
        edited = {**recipe, "headers": {**headers, "b.cuh": "#define B 20\n"}}
        wrong = _resolve(client, edited, compile=False)
        assert wrong["status"] == "hit"
        assert wrong["artifact"]["digest"] == first["artifact"]["digest"]  # the stale kernel

        found = _divergence(client, wrong["recipe_key"])
        assert found["via"] == "manifest"
        assert any("b.cuh" in line and "not recorded" in line for line in found["differences"])
        fixed = _resolve(client, edited, compile=False)
        assert fixed["artifact"]["digest"] == found["fresh_digest"] != first["artifact"]["digest"]
        assert "b.cuh" in {d["name"] for d in fixed["artifact"]["dependencies"]}

        metrics = client.get("/metrics").text
        assert _value(metrics, "kcache_verification_divergences_total") >= 2
        assert _value(metrics, 'kcache_verified_total{result="diverged"}') >= 2


def test_a_right_hit_verifies_as_the_same_bytes(server: ServerThread) -> None:
    with server.client(ADMIN) as client:
        recipe = _kernel("plain-hit", 3)
        _resolve(client, recipe)
        key = _resolve(client, recipe)["recipe_key"]  # a hit: a candidate
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with server.state.backends.db.connect() as conn:
                rows = conn.execute(
                    sa.text("SELECT result FROM verification_events WHERE recipe_key = :k"),
                    {"k": key},
                ).all()
            if rows:
                break
            time.sleep(0.2)
        assert [r.result for r in rows] == ["same_bytes"]
        report = client.get("/v1/verification").json()
        assert report["verified"]["same_bytes"] >= 1
        assert report["verified_recipes"] >= 1 and report["coverage"] > 0


def _results(server: ServerThread, key: str, timeout: float = 60.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with server.state.backends.db.connect() as conn:
            rows = conn.execute(
                sa.text("SELECT result FROM verification_events WHERE recipe_key = :k"),
                {"k": key},
            ).all()
        if rows:
            return [r.result for r in rows]
        time.sleep(0.2)
    raise AssertionError(f"{key} was never verified within {timeout}s")


def test_a_kernel_met_first_as_a_compile_and_then_served_from_memory_is_sampled(
    server: ServerThread,
) -> None:
    """A warm server answers hits from memory, which the engine never sees: the compile is
    the first sighting (B13 found no verification at all before), and memory hits count."""
    with server.client(ADMIN) as client:
        compiled = _resolve(client, _kernel("compiled-first", 6))
        assert compiled["status"] == "compiled"
        for _ in range(3):
            client.get(f"/v1/recipes/{compiled['recipe_key']}/artifact").raise_for_status()
    assert _results(server, compiled["recipe_key"]) == ["same_bytes"]


def test_ltoir_with_randomly_tagged_names_verifies_as_the_same_bytes(server: ServerThread) -> None:
    """A template kernel's internal names drew a random tag (and the pid) in every compile
    before compiles were seeded, so LTO-IR (scrambled) could not be verified at all; now
    the verification worker, another process, compiles the same bytes."""
    source = (
        "// ltoir random tags\nnamespace { __device__ int n; }\n"
        "template <int N> __global__ void k(int* o) { o[0] = N + n++; }\n"
        "template __global__ void k<3>(int*);\n"
    )
    recipe = {"source": source, "target": "sm_90", "output": "ltoir"}
    with server.client(ADMIN) as client:
        first = _resolve(client, recipe)
        assert _results(server, first["recipe_key"]) == ["same_bytes"]
        again = _resolve(client, recipe, compile=False)
        assert again["artifact"]["digest"] == first["artifact"]["digest"]  # still served


def test_padded_twins_with_the_same_bytes_never_withdraw_anything(server: ServerThread) -> None:
    """The attack: the victim's source with an in-memory header of comments on top makes
    the same bytes, so the same artifact row, whose dependency list is the victim's. The
    twin read a header that row does not list: the same bytes are no divergence, and the
    twin's list is learned into the manifest under its base key."""
    from kcache_server.models import ManifestRow, VerificationEvent

    victim = _kernel("twins-victim", 8)
    twins = [
        {
            **victim,
            "source": f'#include "pad{i % 2}.cuh"\n' + victim["source"],
            "headers": {f"pad{i % 2}.cuh": f"// padding {i}\n"},
        }
        for i in range(5)
    ]
    with server.client(ADMIN) as client:
        right = _resolve(client, victim)
        digest = right["artifact"]["digest"]
        answered = [_resolve(client, twin) for twin in twins]
        assert {a["artifact"]["digest"] for a in answered} == {digest}  # one row for all six
        for answer in [right, *answered]:
            assert _results(server, answer["recipe_key"]) == ["same_bytes"]
        with server.state.backends.db.connect() as conn:
            notes = (
                conn.execute(
                    sa.select(VerificationEvent.differences).where(
                        VerificationEvent.recipe_key == answered[0]["recipe_key"]
                    )
                )
                .scalars()
                .one()
            )
            learned = (
                conn.execute(
                    sa.select(ManifestRow.dependencies).where(
                        ManifestRow.base_key == answered[0]["base_key"],
                        ManifestRow.digest == digest,
                    )
                )
                .scalars()
                .all()
            )
        assert any("pad0.cuh" in line and "read but not recorded" in line for line in notes)
        assert any("pad0.cuh" in {d["name"] for d in deps} for deps in learned)
        report = client.get("/v1/verification").raise_for_status().json()
        keys = {a["recipe_key"] for a in [right, *answered]}
        assert not [d for d in report["divergences"] if d["recipe_key"] in keys]
        for recipe in [victim, *twins]:
            served = _resolve(client, recipe, compile=False)  # nothing was withdrawn
            assert served["status"] == "hit"
            assert served["artifact"]["digest"] == digest


def test_the_report_needs_an_admin_token(server: ServerThread) -> None:
    with httpx.Client(base_url=server.url) as client:
        assert client.get("/v1/verification").status_code in (401, 403)


def _value(metrics: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} ([0-9.e+]+)$", metrics, re.M)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def test_db_verify_recompile_finds_and_replaces_a_planted_answer(server: ServerThread) -> None:
    """The same check offline, for a data directory (here the running server's)."""
    import json
    import subprocess

    from kcache_server.models import RecipeAlias
    from kcache_server.recipe_records import RecipeRecords

    from tests.support import KCACHE

    with server.client(ADMIN) as client:
        right = _resolve(client, _kernel("offline-right", 4))
        other = _resolve(client, _kernel("offline-other", 5))
    key = right["recipe_key"]
    records = RecipeRecords(server.state.backends.db)
    deadline = time.monotonic() + 30
    while records.recipe(key) is None:  # recorded by the audit writer's next flush
        assert time.monotonic() < deadline, "the compiled recipe was never recorded"
        time.sleep(0.1)
    # The running server verifies the compile once (then not for period_s): wait for it, or
    # it could find the answer planted below first and leave the offline check nothing.
    assert _results(server, key) == ["same_bytes"]
    with server.state.backends.db.begin() as conn:
        conn.execute(
            sa.update(RecipeAlias)
            .where(RecipeAlias.recipe_key == key)
            .values(digest=other["artifact"]["digest"])
        )
    done = subprocess.run(
        [KCACHE, "db", "verify", "--recompile", "--data-dir", str(server.settings.data_dir)],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert [d["recipe_key"] for d in report["diverged"]] == [key]
    assert report["diverged"][0]["fresh_digest"] == right["artifact"]["digest"]
    assert report["results"].get("same_bytes", 0) >= 1  # the other recorded recipes were right
    server.state.resolver.forget(key)
    with server.client(ADMIN) as client:
        fixed = _resolve(client, _kernel("offline-right", 4), compile=False)
    assert fixed["artifact"]["digest"] == right["artifact"]["digest"]
