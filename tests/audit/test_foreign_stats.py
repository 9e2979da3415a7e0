"""``GET /v1/stats``' ``foreign_by_library`` after real foreign publishes and lookups.

One real server per database kind (SQLite, PostgreSQL) for the module runs the scripted
workload of :mod:`tests.audit.foreign_workload` through the real routes: each library's
lookups, hits, misses and hit rate must be what the script counted, under the window
and filters of the rest of the answer, read in one statement.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from tests.audit.foreign_workload import ForeignWorkload, run_foreign_workload
from tests.support import ServerThread, pg_database


@contextmanager
def _database(kind: str, data: Path) -> Iterator[str]:
    """The URL of a new database of ``kind``, migrated to the head revision."""
    from kcache_server import migrate

    if kind == "postgres":
        with pg_database() as url:
            migrate.upgrade(url)
            yield url
    else:
        data.mkdir(parents=True)
        url = f"sqlite:///{data / 'kcache.db'}"
        migrate.upgrade(url)
        yield url


@pytest.fixture(
    scope="module", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def foreign(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ForeignWorkload]:
    """A real server on a database of each kind after the foreign workload."""
    from kcache_server import Settings

    data = tmp_path_factory.mktemp("foreign-stats") / "data"
    with _database(request.param, data) as url:
        settings = Settings(
            data_dir=data, db_url=url, compile_workers=1, audit={"flush_s": 0.05}, auth_cache_s=0.0
        )
        server = ServerThread(settings)
        try:
            yield run_foreign_workload(server)
        finally:
            server.stop()


def _stats(w: ForeignWorkload, **params: str) -> dict[str, Any]:
    with w.server.client() as http:
        r = http.get("/v1/stats", params=params)
    assert r.status_code == 200, r.text
    return r.json()


def test_each_library_has_its_lookups_hits_and_rate(foreign: ForeignWorkload) -> None:
    stats = _stats(foreign)
    assert stats["foreign_by_library"] == foreign.expected()
    # What the script says on its own: cupy 3 + 1 hits of two published names and a miss,
    # triton a hit and two misses; the reported library compile is no foreign lookup.
    assert foreign.expected() == [
        {"library": "cupy", "lookups": 5, "hits": 4, "misses": 1, "hit_rate": 0.8},
        {"library": "triton", "lookups": 3, "hits": 1, "misses": 2, "hit_rate": 1 / 3},
    ]
    # They are kernel lookups like the others (each its own: none names a process), so
    # the headline counts them, with the reported compile (a process's: one more lookup).
    assert (stats["kernel_lookups"], stats["kernel_hits"]) == (9, 5)


def test_the_window_and_filters_of_the_answer_apply(foreign: ForeignWorkload) -> None:
    assert _stats(foreign, until="1000")["foreign_by_library"] == []
    assert _stats(foreign, target="sm_80")["foreign_by_library"] == []
    assert _stats(foreign, job_id="job-a")["foreign_by_library"] == []  # lookups name no job
    (only,) = _stats(foreign, kernel="foreign:cupy:vadd.cubin")["foreign_by_library"]
    assert only == {"library": "cupy", "lookups": 3, "hits": 3, "misses": 0, "hit_rate": 1.0}
    (triton,) = _stats(foreign, kernel="foreign:triton:softmax_kernel")["foreign_by_library"]
    assert (triton["library"], triton["lookups"], triton["hit_rate"]) == ("triton", 1, 0.0)


def test_one_statement_reads_every_library(foreign: ForeignWorkload) -> None:
    """One ``GROUP BY`` for all libraries, not a query per library."""
    db: sa.Engine = foreign.server.state.backends.db
    parse = "split_part" if db.dialect.name == "postgresql" else "instr"
    statements: list[str] = []
    lock = threading.Lock()

    def seen(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if "audit_lookups" in statement and parse in statement:
            with lock:
                statements.append(statement)

    sa.event.listen(db, "before_cursor_execute", seen)
    try:
        libraries = [row["library"] for row in _stats(foreign)["foreign_by_library"]]
    finally:
        sa.event.remove(db, "before_cursor_execute", seen)
    assert libraries == ["cupy", "triton"]
    assert len(statements) == 1, statements
