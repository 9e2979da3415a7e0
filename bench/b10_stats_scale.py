"""B10: ``GET /v1/stats`` over many audit events, on SQLite and PostgreSQL.

A script fills ``audit_events`` with ``--events`` rows (default 1M; ``--events 10000000``
for the issue's figure) spread the way a busy cluster would: a few thousand kernels with
a long tail, hundreds of jobs of 8 ranks, every outcome and tier, a little rank
divergence, over the last few days (inside the retention window, so every row stays raw:
the worst case for the queries). A real ``kcache serve`` then answers ``/v1/stats``
(no grouping, and each ``group_by``); each figure is the median of ``--rounds`` calls.

Anchor: one ``SELECT count(*), sum(count) FROM audit_events`` on the same database, the
floor of anything that reads every event once. Goal: < 1 s on PostgreSQL, < 2 s on SQLite
at 10M events.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, cast

import httpx
import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _harness
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support
from _harness import emit

from tests.support import PG_ADMIN_URL, ServerProcess, upgrade

COLUMNS = (
    *("at", "outcome", "tier", "route", "recipe_key", "base_key", "digest", "kernel"),
    *("target", "toolchain", "error", "client_id", "host", "pid", "job_id", "rank"),
    *("world_size", "latency_ms", "compile_seconds_saved", "count"),
)
# Server-observed outcomes, then the client-reported one, with a plausible mix.
OUTCOME_WEIGHTS = {
    "hit": 60,
    "local_hit": 25,
    "compiled": 6,
    "waited": 3,
    "miss": 4,
    "error": 2,
}
TARGETS = ("sm_80", "sm_90", "sm_100")
CHUNK = 20_000


def _hex(rng: random.Random) -> str:
    return f"{rng.getrandbits(256):064x}"


def event_rows(n: int, seed: int = 13) -> Iterator[tuple[Any, ...]]:
    """``n`` audit rows in :data:`COLUMNS` order, deterministic for ``seed``."""
    rng = random.Random(seed)
    kernels = [f"kernel_{i}" for i in range(3000)]
    base = {k: _hex(rng) for k in kernels}
    variants = {k: [_hex(rng) for _ in range(3)] for k in kernels}  # recipe keys per kernel
    digests = {(key, t): _hex(rng) for vs in variants.values() for key in vs for t in TARGETS}
    jobs = [f"job-{i:04d}" for i in range(800)]
    # A job runs on one kind of GPU and one version of each kernel's headers.
    job_target = {job: rng.choice(TARGETS) for job in jobs}
    job_variant = {job: rng.randrange(3) for job in jobs}
    outcomes = list(OUTCOME_WEIGHTS)
    weights = list(OUTCOME_WEIGHTS.values())
    now = datetime.now(timezone.utc)
    span_s = 5 * 86400.0
    for _ in range(n):
        # A long tail: a few kernels take most lookups.
        kernel = kernels[min(int(rng.paretovariate(1.2)) - 1, len(kernels) - 1)]
        kernel = kernel if rng.random() < 0.7 else rng.choice(kernels)
        outcome = rng.choices(outcomes, weights)[0]
        job = rng.choice(jobs)
        key, target = variants[kernel][job_variant[job]], job_target[job]
        rank = rng.randrange(8)
        digest = None if outcome in ("miss", "error") else digests[key, target]
        if digest is not None and rng.random() < 0.0005:
            digest = _hex(rng)  # a rank that got other bytes: divergence
        yield (
            now - timedelta(seconds=rng.random() * span_s),
            outcome,
            "node" if outcome == "local_hit" else "server",
            "events" if outcome == "local_hit" else "resolve",
            key,
            base[kernel],
            digest,
            kernel,
            target,
            "nvrtc-13.0",
            "compile_error" if outcome == "error" else None,
            f"{job}-r{rank}",
            f"node-{rng.randrange(200)}",
            rng.randrange(1, 1 << 20),
            job,
            rank,
            8,
            rng.random() * 3,
            rng.random() * 2 if outcome in ("hit", "local_hit") else 0.0,
            1,
        )


def fill(url: str, n: int) -> float:
    """Insert ``n`` events into the database at ``url``; seconds taken."""
    from kcache_server.models import AuditEvent

    table = cast(sa.Table, AuditEvent.__table__)
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    started = time.perf_counter()
    try:
        if engine.dialect.name == "postgresql":
            with engine.connect() as conn:
                raw: Any = conn.connection.dbapi_connection
                with (
                    raw.cursor() as cur,
                    cur.copy(f"COPY audit_events ({', '.join(COLUMNS)}) FROM STDIN") as copy,
                ):
                    for row in event_rows(n):
                        copy.write_row(row)
                raw.commit()
            settle(engine)
        else:
            rows: list[dict[str, Any]] = []
            with engine.begin() as conn:
                for row in event_rows(n):
                    rows.append(dict(zip(COLUMNS, row, strict=True)))
                    if len(rows) == CHUNK:
                        conn.execute(sa.insert(table), rows)
                        rows.clear()
                if rows:
                    conn.execute(sa.insert(table), rows)
            with engine.connect() as conn:
                conn.exec_driver_sql("ANALYZE")
    finally:
        engine.dispose()
    return time.perf_counter() - started


def settle(engine: sa.Engine) -> None:
    """VACUUM ANALYZE a PostgreSQL database, as autovacuum would soon after a bulk load.

    Without it the visibility map is empty and every index-only scan reads the heap too,
    which a long-running server's tables do not.
    """
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.exec_driver_sql("VACUUM ANALYZE")


def floor_scan_s(url: str, rounds: int) -> float:
    """Median seconds of one full read of ``audit_events``."""
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    times = []
    try:
        with engine.connect() as conn:
            for _ in range(rounds):
                started = time.perf_counter()
                conn.exec_driver_sql("SELECT count(*), sum(count) FROM audit_events").one()
                times.append(time.perf_counter() - started)
    finally:
        engine.dispose()
    return statistics.median(times)


@contextlib.contextmanager
def database(kind: str, tmp: Path) -> Iterator[str]:
    """A fresh, migrated database of ``kind`` (sqlite or postgresql), dropped afterwards."""
    if kind == "sqlite":
        url = f"sqlite:///{tmp / 'kcache.db'}"
        upgrade(url)
        yield url
        return
    admin = sa.create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
    name = f"kcache_bench_{os.getpid()}_{int(time.time())}"
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    url = sa.engine.make_url(PG_ADMIN_URL).set(database=name).render_as_string(hide_password=False)
    try:
        upgrade(url)
        yield url
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()


def time_stats(url: str, params: dict[str, str], rounds: int) -> tuple[float, dict[str, Any]]:
    """Median seconds of ``GET /v1/stats`` with ``params``, and the last answer."""
    times = []
    body: dict[str, Any] = {}
    with httpx.Client(base_url=url, timeout=600) as http:
        for _ in range(rounds):
            started = time.perf_counter()
            r = http.get("/v1/stats", params=params)
            times.append(time.perf_counter() - started)
            r.raise_for_status()
            body = r.json()
    return statistics.median(times), body


def dashboard_paint_s(url: str) -> float | None:
    """Seconds from opening ``/dashboard`` in headless Chromium to its first drawn data.

    None where Chromium or Playwright is missing. "Drawn" is the page's own signal
    (``document.body.dataset.loads``), set once the first ``/v1/stats`` answer is on screen,
    as tests/audit/test_dashboard.py waits for it.
    """
    chromium = os.environ.get("KCACHE_TEST_CHROMIUM", "/usr/bin/chromium")
    if not os.path.exists(chromium):
        return None
    os.environ.setdefault("PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD", "1")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        return None
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=chromium, args=["--no-sandbox", "--disable-gpu"], headless=True
        )
        try:
            page = browser.new_page(viewport={"width": 1440, "height": 1100})
            started = time.perf_counter()
            page.goto(f"{url}/dashboard")
            page.wait_for_function(
                "() => Number(document.body.dataset.loads || 0) >= 1", timeout=600_000
            )
            return time.perf_counter() - started
        finally:
            browser.close()


def run(kind: str, events: int, rounds: int) -> None:
    """Fill one database of ``kind``, serve it, time every shape of ``/v1/stats``."""
    goal = "< 1 s at 10M" if kind == "postgresql" else "< 2 s at 10M"
    with tempfile.TemporaryDirectory(prefix="kcache-b10-") as tmp, database(kind, Path(tmp)) as url:
        fill_s = fill(url, events)
        floor = floor_scan_s(url, rounds)
        env = {**os.environ, "KCACHE_AUDIT_RETENTION_DAYS": "0"}  # keep every row raw
        with ServerProcess(Path(tmp) / "data", db_url=url, workers=1, env=env) as server:
            for group in ("", "kernel", "job", "client", "target", "rank"):
                params = {"group_by": group} if group else {}
                seconds, body = time_stats(server.url, params, rounds)
                assert body["lookups"] == events, body["lookups"]
                emit(
                    f"B10.stats.{kind}.{group or 'all'}_s",
                    seconds,
                    floor,
                    "s",
                    anchor_is="one full scan of audit_events",
                    events=events,
                    fill_s=round(fill_s, 1),
                    groups=len(body["groups"]),
                    top_missed=len(body["top_missed"]),
                    divergence=len(body["divergence"]),
                    goal=goal,
                )
            paint = dashboard_paint_s(server.url)
            if paint is not None:
                emit(
                    f"B10.dashboard.{kind}.first_paint_s",
                    paint,
                    None,
                    "s",
                    events=events,
                    goal="< 2 s at 10M",
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--db", choices=("sqlite", "postgresql", "both"), default="both")
    args = parser.parse_args()
    for kind in ("sqlite", "postgresql") if args.db == "both" else (args.db,):
        run(kind, args.events, args.rounds)


if __name__ == "__main__":
    main()
