"""``kcache_server.recipe_records`` on a real database: record, read back, explain, fail softly.

No server and no NVRTC: recipes are recorded directly, as the audit writer's thread
records them, on SQLite and on PostgreSQL.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from kcache.recipe import Recipe
from tests.support import upgrade

SOURCE = '#include "add.cuh"\nextern "C" __global__ void add(float* x) { x[0] = ADD; }\n'


def _recipe(**fields: Any) -> Recipe:
    base: dict[str, Any] = {
        "source": SOURCE,
        "name": "add.cu",
        "headers": {"add.cuh": "#define ADD 1\n"},
        "flags": ["-DA"],
        "target": "sm_80",
        "toolchain": "nvrtc-test",
    }
    base.update(fields)
    return Recipe(**base)


@pytest.fixture(
    scope="module", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def database(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[sa.Engine]:
    """An upgraded database of each kind, for the module."""
    from tests.support import pg_database

    with contextlib.ExitStack() as stack:
        if request.param == "sqlite":
            url = f"sqlite:///{tmp_path_factory.mktemp('records') / 'kcache.db'}"
        else:
            url = stack.enter_context(pg_database())
        upgrade(url)
        db = sa.create_engine(url)
        stack.callback(db.dispose)
        yield db


@pytest.fixture
def engine(database: sa.Engine) -> sa.Engine:
    """The module's database, with no recipe recorded."""
    with database.begin() as conn:
        conn.execute(sa.text("DELETE FROM recipe_records"))
    return database


def test_a_recorded_recipe_reads_back_whole(engine: sa.Engine) -> None:
    from kcache_server.recipe_records import RecipeRecords

    records = RecipeRecords(engine)
    recipe = _recipe(specialization={"N": 4}, name_expressions=["add"])
    records.record(recipe)
    records.record(recipe)  # idempotent
    back = records.recipe(recipe.key())
    assert back is not None and back == recipe and back.to_dict() == recipe.to_dict()
    assert records.recipe("0" * 64) is None
    with engine.connect() as conn:
        row = conn.execute(sa.text("SELECT * FROM recipe_records")).one()
    assert row.base_key == recipe.base_key() and row.name == "add.cu"
    assert row.created_at == row.last_seen_at
    assert records.failures == {}


def test_a_recipe_too_large_keeps_its_fingerprint_only(engine: sa.Engine) -> None:
    from kcache_server.recipe_records import MAX_BODY_BYTES, RecipeRecords

    noise = random.Random(7).randbytes(MAX_BODY_BYTES).hex()  # incompressible
    big = _recipe(headers={"add.cuh": "#define ADD 1\n", "big.h": f"// {noise}\n"})
    records = RecipeRecords(engine)
    records.record(big)
    assert records.recipe(big.key()) is None
    small = _recipe(headers={"add.cuh": "#define ADD 1\n", "big.h": "// small\n"})
    # Explained from the fingerprint all the same.
    got = records.nearest(small)
    assert got.nearest_key == big.key()
    assert [line.split(" (")[0] for line in got.differences] == ["header big.h changed"]


def test_nearest_is_the_fewest_differences_among_the_recent_recipes(engine: sa.Engine) -> None:
    from kcache_server.recipe_records import RecipeRecords

    records = RecipeRecords(engine)
    assert records.nearest(_recipe()).text == "never seen"
    far = _recipe(flags=["-DA", "-lineinfo"], target="sm_90")
    near = _recipe(flags=["-DA", "-lineinfo"])
    for recipe in (far, near):
        records.record(recipe)
    got = records.nearest(_recipe())
    assert got.nearest_key == near.key() and got.differences == ["flag -lineinfo removed"]
    assert got.text == f"nearest {near.key()[:16]}: flag -lineinfo removed"
    # A recipe is never its own nearest; by key, from the stored fingerprint.
    by_key = records.nearest_to_key(near.key())
    assert by_key is not None and by_key.nearest_key == far.key()
    assert by_key.differences == ["target sm_90 -> sm_80"]
    assert records.nearest_to_key("1" * 64) is None
    # Another kernel (other source, other base key) is never near.
    other = _recipe(source=SOURCE + "// other\n")
    assert records.nearest(other).text == "never seen"


def test_candidates_are_bounded_and_the_most_recent(
    engine: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kcache_server.recipe_records import CANDIDATES, RecipeRecords

    from kcache.recipe_diff import explain as real

    records = RecipeRecords(engine)
    many = [_recipe(flags=["-DA", f"-DV={i}"]) for i in range(CANDIDATES + 5)]
    for recipe in many:
        records.record(recipe)
    seen: list[int] = []

    def counting(new: Any, candidates: Any, **options: Any) -> Any:
        listed = list(candidates)
        seen.append(len(listed))
        return real(new, listed, **options)

    monkeypatch.setattr("kcache_server.recipe_records.explain", counting)
    got = records.nearest(_recipe(flags=["-DA", "-DV=x"]))
    assert seen == [CANDIDATES]  # both ways find the same rows: no more than the bound
    # Every candidate differs by one flag added and one removed: the most recent wins.
    assert got.nearest_key == many[-1].key()


def test_prepare_explains_misses_in_order_then_records(engine: sa.Engine) -> None:
    from kcache_server.auditing.writer import AuditRecord
    from kcache_server.recipe_records import SEEN_BEFORE, RecipeRecords

    records = RecipeRecords(engine)
    first, second = _recipe(), _recipe(target="sm_90")
    rows = [AuditRecord("compiled", "resolve", 1.0) for _ in range(3)]
    records.note(first, rows[0], keep=True)
    records.note(second, rows[1], keep=True)
    records.note(first, rows[2], keep=True)  # compiled again: its artifact went away
    records.prepare(rows)
    assert rows[0].miss_reason == "never seen"
    assert rows[1].miss_reason == f"nearest {first.key()[:16]}: target sm_80 -> sm_90"
    assert rows[2].miss_reason == SEEN_BEFORE
    assert records.recipe(first.key()) == first and records.recipe(second.key()) == second


def test_a_database_error_is_counted_never_raised(tmp_path: Path) -> None:
    from kcache_server.auditing.writer import AuditRecord
    from kcache_server.recipe_records import RecipeRecords

    # A database without the table: every statement fails.
    db = sa.create_engine(f"sqlite:///{tmp_path / 'empty.db'}")
    try:
        records = RecipeRecords(db)
        failed: list[str] = []
        records.failure_listeners.append(failed.append)
        row = AuditRecord("miss", "resolve", 1.0)
        records.note(_recipe(), row, keep=True)
        records.prepare([row])
        assert row.miss_reason is None
        assert failed == ["explain", "record"]
        records.record(_recipe())
        assert records.failures == {"explain": 1, "record": 2}
    finally:
        db.dispose()


def test_a_full_queue_drops_and_counts() -> None:
    from kcache_server.recipe_records import RecipeRecords

    records = RecipeRecords(sa.create_engine("sqlite://"), max_queued=1)
    records.note(_recipe(), keep=True)
    records.note(_recipe(), keep=True)
    assert records.failures == {"queue_full": 1}
