"""``kcache db rekey``: after a key schema change, the recipes a server recorded answer under the new keys.

One real server (a thread, real NVRTC, SQLite) compiles six small kernels (one reads a
header of a server include set) through ``POST /v1/resolve``; the server records them
whole. It stops, and the database is put back to what a schema-1 server left: each
recipe's alias, record and manifest entries are moved to a key no client computes any
more (a stand-in for its schema-1 key), and the recorded bodies name include sets
without digests, as schema-1 rows do. That is the state an upgrade meets: the server
has every recipe, but not under the key clients now compute (the blobs stay; in a real
upgrade their bytes were compiled unseeded and differ, which changes nothing here). Two
more records model what rekey cannot do: a recipe of a toolchain gone, one whose
include set was edited so that it no longer compiles, and one whose body was not kept.

The upgraded server starts on the same data directory, and ``kcache db rekey`` runs
beside it (a subprocess, as an operator runs it).

Measured once, by a script on this shape of database (100 distinct kernels of a job, a
schema-1 state made as above, a fresh node tier, ``KernelCache.get_many``): without
rekey the job pays 100 compiles (every key is new to the server); after ``kcache db
rekey`` (which compiled the 100 in 21 s with 2 workers, pool start included) it pays 0:
100 ``hit`` (origin ``server``). A node tier's schema-1 entries are never looked up again
(they leave by LRU).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from kcache_client import ClientSettings, KernelCache
from kcache_server.index import SqlIndex
from kcache_server.models import manifests_table, recipe_aliases_table, recipe_records_table
from kcache_server.recipe_records import RecipeRecords
from kcache_server.settings import AuditSettings, Settings

from kcache import Recipe
from tests.support import FAST, KCACHE, ServerThread

N = 6
GONE_TOOLCHAIN = "nvrtc12.4-nvjitlink12.4-0123456789abcdef"


def _source(i: int) -> str:
    body = "x[threadIdx.x] *= TILE;" if i == 0 else f"x[threadIdx.x] *= {i + 2}.0f;"
    head = "#include <tile.h>\n" if i == 0 else ""
    return f'{head}extern "C" __global__ void rekey_{i}(float* x) {{ {body} }}\n'


def _recipes() -> list[dict[str, Any]]:
    return [
        {"source": _source(i), "target": "sm_80", **({"include_sets": ["proj"]} if i == 0 else {})}
        for i in range(N)
    ]


def _schema1(key: str) -> str:
    """The stand-in for a key of the old schema: one no client computes."""
    return hashlib.sha256(f"schema-1:{key}".encode()).hexdigest()


def _pack(data: dict[str, Any]) -> bytes:
    return zlib.compress(json.dumps(data, separators=(",", ":")).encode())


@dataclasses.dataclass
class Upgraded:
    server: ServerThread
    settings: Settings
    home: Path
    keys: list[str]  # the schema-2 keys the six recipes have
    digests: list[str]


def _downgrade(db: sa.Engine, keys: list[str], edit_dir: Path) -> None:
    """Move what the server recorded under ``keys`` to schema-1 stand-ins; add the records rekey cannot use."""
    records = RecipeRecords(db)
    with db.begin() as conn:
        for key in keys:
            recipe = records.recipe(key)
            assert recipe is not None
            base = recipe.base_key()
            body = recipe.to_dict()
            body["include_sets"] = [s.partition("@")[0] for s in body["include_sets"]]
            conn.execute(
                sa.update(recipe_aliases_table)
                .where(recipe_aliases_table.c.recipe_key == key)
                .values(recipe_key=_schema1(key))
            )
            conn.execute(
                sa.update(manifests_table)
                .where(manifests_table.c.base_key == base)
                .values(base_key=_schema1(base))
            )
            conn.execute(
                sa.update(recipe_records_table)
                .where(recipe_records_table.c.recipe_key == key)
                .values(recipe_key=_schema1(key), base_key=_schema1(base), recipe_zlib=_pack(body))
            )
        template = (
            conn.execute(
                sa.select(recipe_records_table).where(
                    recipe_records_table.c.recipe_key == _schema1(keys[1])
                )
            )
            .one()
            ._asdict()
        )
        source = _source(1)
        gone = {"source": source + "// gone\n", "target": "sm_80", "toolchain": GONE_TOOLCHAIN}
        broken = {"source": _source(0) + "// edited\n", "target": "sm_80", "include_sets": ["edit"]}
        for tag, data in (("gone", gone), ("broken", broken), ("unkept", None)):
            conn.execute(
                sa.insert(recipe_records_table).values(
                    {
                        **template,
                        "recipe_key": _schema1(tag),
                        "base_key": _schema1(tag + "-base"),
                        "recipe_zlib": None if data is None else _pack(data),
                    }
                )
            )
    (edit_dir / "tile.h").write_text("#define TIL 2.0f\n")  # an edit that breaks the recipe


def _sets(home: Path) -> dict[str, Path]:
    for name in ("proj", "edit"):
        (home / name).mkdir()
        (home / name / "tile.h").write_text("#define TILE 2.0f\n")
    return {"proj": home / "proj", "edit": home / "edit"}


def _schema1_server(
    settings: Settings, recipes: list[dict[str, Any]]
) -> tuple[list[str], list[str]]:
    """Compile ``recipes`` on a server of ``settings``, stop it, leave its database as schema 1 left it."""
    old = ServerThread(settings)
    try:
        with old.client() as client:
            answers = [
                client.post("/v1/resolve", json={"recipe": r, "compile": True}) for r in recipes
            ]
        assert [a.status_code for a in answers] == [200] * len(recipes), [a.text for a in answers]
        assert [a.json()["status"] for a in answers] == ["compiled"] * len(recipes)
        keys = [a.json()["recipe_key"] for a in answers]
        digests = [a.json()["artifact"]["digest"] for a in answers]
        records = RecipeRecords(old.state.backends.db)
        deadline = time.monotonic() + 30
        while any(records.recipe(k) is None for k in keys):  # the audit writer records them
            assert time.monotonic() < deadline, "the compiled recipes were never recorded"
            time.sleep(0.05)
    finally:
        old.stop()
    db = sa.create_engine(settings.database_url, poolclass=sa.pool.NullPool)
    try:
        _downgrade(db, keys, settings.include_sets["edit"])
    finally:
        db.dispose()
    return keys, digests


@pytest.fixture(scope="module")
def upgraded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Upgraded]:
    home = tmp_path_factory.mktemp("rekey")
    settings = Settings(
        data_dir=home / "data",
        compile_workers=2,
        audit=AuditSettings(flush_s=0.05),
        include_sets=_sets(home),
    )
    keys, digests = _schema1_server(settings, _recipes())
    server = ServerThread(settings)  # the upgraded server, on the same data directory
    try:
        yield Upgraded(server, settings, home, keys, digests)
    finally:
        server.stop()


def _rekey(up: Upgraded | Settings, *args: str) -> tuple[int, dict[str, Any]]:
    settings = up.settings if isinstance(up, Upgraded) else up
    where = ["--db-url", settings.db_url] if settings.db_url else []
    done = subprocess.run(
        [KCACHE, "db", "rekey", "--json", "--data-dir", str(settings.data_dir), *where, *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
        env={  # the server's settings, as an operator runs it beside the server
            **os.environ,
            "KCACHE_INCLUDE_SETS": json.dumps(
                {name: str(path) for name, path in settings.include_sets.items()}
            ),
        },
    )
    assert done.stdout, done.stderr
    return done.returncode, json.loads(done.stdout)


def _failures(report: dict[str, Any]) -> dict[str, str]:
    return {f["recorded_key"]: f["error"] for f in report["failures"]}


def test_rekey_resolves_the_recorded_recipes_under_their_new_keys_and_a_job_pays_no_compile(
    upgraded: Upgraded, tmp_path: Path
) -> None:
    up = upgraded
    with up.server.client() as client:  # before: the server does not know the new keys
        missed = client.post("/v1/resolve", json={"recipe": _recipes()[1], "compile": False})
    assert missed.status_code == 404

    code, dry = _rekey(up, "--dry-run")
    assert code == 1, dry  # the toolchain gone; the broken recipe is only known broken by compiling
    assert (dry["records"], dry["missing"], dry["compiled"], dry["current"]) == (N + 3, N + 1, 0, 0)
    assert (dry["failed"], dry["no_recipe"]) == (1, 1)
    with up.server.client() as client:  # a dry run wrote nothing
        still = client.post("/v1/resolve", json={"recipe": _recipes()[1], "compile": False})
    assert still.status_code == 404

    code, report = _rekey(up)
    assert code == 1, report
    assert report["compiled"] + report["waited"] == N and report["current"] == 0, report
    assert report["no_recipe"] == 1 and report["failed"] == 2
    failures = _failures(report)
    assert "toolchain" in failures[_schema1("gone")]
    assert "compile failed" in failures[_schema1("broken")]
    assert "TILE" in failures[_schema1("broken")]

    settings = dataclasses.replace(
        ClientSettings.from_env(auto_target="sm_80", retry=FAST, send_events=False),
        known_servers=tmp_path / "known.json",
    )
    with KernelCache(up.server.url, cache_dir=tmp_path / "tier", settings=settings) as cache:
        recipes = [cache.prepare(Recipe.from_dict(r)) for r in _recipes()]
        arts = cache.get_many(recipes)
    assert all(not isinstance(a, Exception) for a in arts), arts
    assert [a.origin for a in arts] == ["server"] * N  # type: ignore[union-attr]
    assert [a.recipe_key for a in arts] == up.keys  # type: ignore[union-attr]
    assert [a.digest for a in arts] == up.digests  # type: ignore[union-attr]

    records = RecipeRecords(up.server.state.backends.db)
    assert all(records.recipe(k) is not None for k in up.keys)  # recorded under the new keys

    code, again = _rekey(up)  # once done, nothing is compiled again
    assert code == 1 and again["compiled"] == 0 and again["current"] == N, again
    assert again["records"] == N + 3 + N  # the new keys' records, as last seen when the old were


def test_rekey_counts_only_recipes_used_within_the_window(upgraded: Upgraded) -> None:
    code, report = _rekey(upgraded, "--dry-run", "--since", "1e-9")  # the last 86 microseconds
    assert code == 0 and report["records"] == 0, report


def test_rekey_on_postgresql_with_no_server_running(tmp_path: Path) -> None:
    """The same on PostgreSQL (two recipes), the command run while no server runs."""
    from tests.support import pg_database, upgrade

    with pg_database("kcache_rekey") as url:
        upgrade(url)
        settings = Settings(
            data_dir=tmp_path / "data",
            db_url=url,
            compile_workers=1,
            audit=AuditSettings(flush_s=0.05),
            include_sets=_sets(tmp_path),
        )
        recipes = _recipes()[:2]
        keys, digests = _schema1_server(settings, recipes)
        code, report = _rekey(settings)
        assert code == 1 and report["compiled"] == 2 and report["failed"] == 2, report
        db = sa.create_engine(url, poolclass=sa.pool.NullPool)
        try:
            found = [SqlIndex(db).lookup(k) for k in keys]  # what the server answers them with
        finally:
            db.dispose()
        assert [getattr(f, "digest", None) for f in found] == digests
