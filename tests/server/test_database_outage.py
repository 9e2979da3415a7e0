"""PostgreSQL out of reach while a replica runs: what still works, what answers 503, and recovery.

The decision (docs/design.md §9): fetches of kernels the replica holds in memory keep
being served (and audited once the database is back); whatever needs the index (a
resolve that is not in memory, a compile) answers 503 ``database_unavailable`` with
``Retry-After``, never a 500; ``/readyz`` says the database failed; the first request
after the database is back succeeds, without a restart.

The outage is real but confined to a database of this test's own: it is closed to new
connections (``ALLOW_CONNECTIONS false``) and its sessions are terminated, so the
server's pooled connections die as they would in a failover. The machine's PostgreSQL
server is never stopped.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa

from tests.support import (
    PG_ADMIN_URL,
    ServerProcess,
    pg_database,
    unique,
    upgrade,
    vector_add,
    wait_until,
)

pytestmark = pytest.mark.postgres


@dataclass
class Replica:
    """One ``kcache serve`` on a PostgreSQL database of its own."""

    server: ServerProcess
    db_url: str

    @property
    def url(self) -> str:
        return self.server.url


@contextlib.contextmanager
def database_closed(db_url: str) -> Iterator[None]:
    """Make the database at ``db_url`` unreachable (new connections refused, sessions ended)."""
    name = sa.engine.make_url(db_url).database
    admin = sa.create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
    try:
        with admin.connect() as conn:
            conn.execute(sa.text(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false'))
            conn.execute(
                sa.text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = :name AND pid <> pg_backend_pid()"
                ),
                {"name": name},
            )
        yield
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true'))
        admin.dispose()


@pytest.fixture(scope="module")
def replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Replica]:
    with pg_database("kcache_outage") as db_url:
        upgrade(db_url)
        root: Path = tmp_path_factory.mktemp("outage")
        env = {**os.environ, "KCACHE_COMPILE_WORKERS": "1", "KCACHE_AUDIT_FLUSH_S": "0.1"}
        with ServerProcess(root / "data", db_url=db_url, env=env) as server:
            server.allow_tracebacks(
                "kcache_server.errors.DatabaseUnavailableError",
                reason="the test stops the database on purpose, and a 503 of an outage leaves "
                "the driver's error in the log",
            )
            yield Replica(server, db_url)


def _compile(url: str, tag: str) -> tuple[str, str]:
    answer = httpx.post(f"{url}/v1/resolve", json={"recipe": vector_add(unique(tag))}, timeout=120)
    assert answer.status_code == 200, answer.text
    return answer.json()["recipe_key"], answer.json()["artifact"]["digest"]


def _hits(url: str) -> int:
    """Server-side hits so far, raw events and the fast path's roll-ups together."""
    answer = httpx.get(f"{url}/v1/stats", timeout=30)
    assert answer.status_code == 200, answer.text
    return int(answer.json()["totals"].get("hit", 0))


def test_warm_fetches_survive_an_outage_and_the_rest_answers_503_until_it_ends(
    replica: Replica,
) -> None:
    url = replica.url
    warm_key, warm_digest = _compile(url, "warm")
    warm = httpx.get(f"{url}/v1/recipes/{warm_key}/artifact", timeout=30)  # now in memory
    assert warm.status_code == 200, warm.text
    wait_until(lambda: _hits(url) >= 1, "the warm fetch's audit row")
    hits_before = _hits(url)
    db_name = sa.engine.make_url(replica.db_url).database
    new_recipe = vector_add(unique("during"))

    with database_closed(replica.db_url):
        # Fetches of what the replica holds in memory: served, bytes intact.
        for _ in range(3):
            fetched = httpx.get(f"{url}/v1/recipes/{warm_key}/artifact", timeout=30)
            assert fetched.status_code == 200, fetched.text
            assert hashlib.sha256(fetched.content).hexdigest() == warm_digest
        # What needs the index: 503 database_unavailable with Retry-After, never a 500.
        for method, path, body in (
            ("POST", "/v1/resolve", {"recipe": new_recipe}),
            ("POST", "/v1/resolve", {"recipe": new_recipe, "compile": False}),
            ("GET", f"/v1/recipes/{'0' * 64}/artifact", None),
        ):
            answer = httpx.request(method, f"{url}{path}", json=body, timeout=60)
            assert answer.status_code == 503, (path, answer.status_code, answer.text)
            assert answer.json()["error"] == "database_unavailable", answer.text
            assert int(answer.headers["retry-after"]) >= 1
            for leak in ("127.0.0.1", "5432", db_name, "psycopg", "FATAL"):
                assert leak not in answer.text, (leak, answer.text)
        ready = httpx.get(f"{url}/readyz", timeout=30)
        assert ready.status_code == 503, ready.text
        assert ready.json()["checks"]["database"].startswith("failed: database unreachable")
        assert httpx.get(f"{url}/healthz", timeout=10).status_code == 200  # alive: no restart
    # What the callers were not told is in the log, for the operator.
    assert "is not currently accepting connections" in replica.server.log_tail(50_000)

    # Back without a restart: ready again, the refused compile goes through, and the
    # fetches served during the outage were kept by the audit writer and written now.
    wait_until(lambda: httpx.get(f"{url}/readyz", timeout=10).status_code == 200, "readiness")
    after = httpx.post(f"{url}/v1/resolve", json={"recipe": new_recipe}, timeout=120)
    assert after.status_code == 200 and after.json()["status"] == "compiled", after.text
    wait_until(lambda: _hits(url) >= hits_before + 3, "the outage's fetches in the audit table")
