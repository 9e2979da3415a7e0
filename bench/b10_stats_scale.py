"""B10: ``GET /v1/stats`` over many audit events, on SQLite and PostgreSQL.

One SQL statement fills ``audit_events`` with ``--events`` rows (default 1M;
``--events 10000000`` for the issue's figure; PostgreSQL ``generate_series``, SQLite a
recursive CTE) spread the way a busy cluster would: 3,000 kernels with a long tail, 800
jobs of 8 ranks, every outcome and tier, over the last five days (inside the retention
window, so every row stays raw). Rank divergence as it happens: in one (job, recipe) pair
in a thousand, rank 7 got other bytes every time. The counts are then built in bulk
(:func:`kcache_server.auditing.counts.rebuild`). A real ``kcache serve`` then answers ``/v1/stats``
(no grouping, and each ``group_by``); each figure is the median of ``--rounds`` calls,
and the dashboard's first paint in headless Chromium the median of ``--rounds`` loads,
with the page's own timeline of that load (when its script could run, when it asked
for and got its first answer).

Anchor: one ``SELECT count(*), sum(count) FROM audit_events`` on the same database, the
floor of anything that reads every event once. Goal: < 1 s on PostgreSQL, < 2 s on SQLite
at 10M events.

Filling 10M events takes minutes (SQLite ~15, PostgreSQL ~8 on two cores), so
``--sqlite-file PATH`` and ``--pg-database NAME`` keep the database: the first run fills
it, later runs migrate it to head and reuse it as it is (its events keep the times of
that fill). The windows of a reused database end at its last event, and the dashboard's
clock reads that time, so every run asks what the run that filled it asked (a window
ending now would hold fewer events as the database ages, and no current hour). ``--shapes``
times only some shapes, ``--no-paint`` skips the dashboard.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _harness
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support
from _harness import emit

from tests.support import PG_ADMIN_URL, ServerProcess, upgrade

# Hashes of the row number i (0 <= h < 1000003): the same row in SQLite and PostgreSQL,
# and every column of one row derived from i alone (SQLite may evaluate random() once
# per reference, which would let a row's tier disagree with its outcome).
_P = 1000003


def _h(mult: int) -> str:
    return f"((i * {mult}) % {_P})"


def _fill_sql(dialect: str, n: int) -> str:
    """One INSERT ... SELECT that writes ``n`` events (see the module docstring for their shape)."""
    k3 = f"({_h(2654435761)} * {_h(2654435761)} / {_P} * {_h(2654435761)} / {_P} * 3000 / {_P})"
    kernel = f"(CASE WHEN {_h(40503)} % 10 < 7 THEN {k3} ELSE {_h(97)} % 3000 END)"
    job, rank = f"({_h(7919)} % 800)", "(i % 8)"
    o = f"({_h(31337)} % 100)"
    outcome = (
        f"(CASE WHEN {o} < 60 THEN 'hit' WHEN {o} < 85 THEN 'local_hit' "
        f"WHEN {o} < 91 THEN 'compiled' WHEN {o} < 94 THEN 'waited' "
        f"WHEN {o} < 98 THEN 'miss' ELSE 'error' END)"
    )
    variant, target = f"({job} % 3)", f"(({job} / 3) % 3)"
    # One recipe in a thousand (job, kernel) pairs diverges: rank 7 got other bytes.
    diverged = f"(({job} * 31 + {kernel}) % 1000 = 0 AND {rank} = 7)"
    # Ids in time order, as a server writes them: row i lies (n - 1 - i) / n of five days back.
    offset_s, micros = f"(({n - 1} - i) * 432000 / {n})", f"({_h(1299709)})"
    if dialect == "postgresql":
        pad = "lpad(({x})::text, 64, '0')"
        text = "({x})::text"
        at = f"(now() - make_interval(secs => {offset_s} + {micros} / 1e6))"
        rows = f"generate_series(0::bigint, {n - 1}) AS s(i)"
        head = ""
    else:
        pad = "printf('%064d', {x})"
        text = "CAST(({x}) AS TEXT)"
        at = (
            f"(strftime('%Y-%m-%d %H:%M:%S', 'now', '-' || {offset_s} || ' seconds') "
            f"|| printf('.%06d', {micros}))"
        )
        rows = "s"
        head = f"WITH RECURSIVE s(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM s WHERE i < {n - 1}) "
    digest = (
        f"(CASE WHEN {outcome} IN ('miss', 'error') THEN NULL "
        f"WHEN {diverged} THEN {pad.format(x=f'{kernel} * 100 + {variant} * 10 + {target} + 99')} "
        f"ELSE {pad.format(x=f'{kernel} * 100 + {variant} * 10 + {target}')} END)"
    )
    values = {
        "at": at,
        "outcome": outcome,
        "tier": f"(CASE WHEN {outcome} = 'local_hit' THEN 'node' ELSE 'server' END)",
        "route": f"(CASE WHEN {outcome} = 'local_hit' THEN 'events' ELSE 'resolve' END)",
        "recipe_key": pad.format(x=f"{kernel} * 10 + {variant}"),
        "base_key": pad.format(x=kernel),
        "digest": digest,
        "kernel": "'kernel_' || " + text.format(x=kernel),
        "target": f"(CASE {target} WHEN 0 THEN 'sm_80' WHEN 1 THEN 'sm_90' ELSE 'sm_100' END)",
        "toolchain": "'nvrtc-13.0'",
        "error": f"(CASE WHEN {outcome} = 'error' THEN 'compile_error' END)",
        "client_id": "'job-' || " + text.format(x=job) + " || '-r' || " + text.format(x=rank),
        "host": "'node-' || " + text.format(x=f"{_h(613)} % 200"),
        "pid": _h(17),
        "job_id": "'job-' || " + text.format(x=job),
        "rank": rank,
        "world_size": "8",
        "latency_ms": f"({_h(3)} * 3.0 / {_P})",
        "compile_seconds_saved": (
            f"(CASE WHEN {outcome} IN ('hit', 'local_hit') THEN {_h(5)} * 2.0 / {_P} ELSE 0 END)"
        ),
        "count": "1",
    }
    return (
        f"INSERT INTO audit_events ({', '.join(values)}) {head}"
        f"SELECT {', '.join(values.values())} FROM {rows}"
    )


def fill(url: str, n: int) -> tuple[float, float]:
    """Insert ``n`` events into the database at ``url`` and build their counts; seconds of each.

    The events are generated in SQL (no row crosses the wire) with the secondary
    indexes of ``audit_events`` dropped and built again after (a sort instead of ten
    million random index inserts); the counts are built by
    :func:`kcache_server.auditing.counts.rebuild`, the bulk statements of migration 0007's
    backfill, which tests/audit/test_counts.py proves equal to what the writer keeps.
    Durability is off during the fill only, as for any bulk load: SQLite without a
    journal or fsync (WAL again after), PostgreSQL's audit tables ``UNLOGGED`` (they
    stay so: the bench's database is dropped after, and reads do not depend on it).
    """
    from kcache_server.auditing.counts import rebuild
    from kcache_server.models import (
        audit_counts_table,
        audit_digests_table,
        audit_divergences_table,
        audit_events_table,
    )

    tables = [audit_events_table, audit_counts_table, audit_digests_table, audit_divergences_table]
    indexes = sorted(audit_events_table.indexes, key=lambda i: str(i.name))
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    pg = engine.dialect.name == "postgresql"
    if not pg:

        @sa.event.listens_for(engine, "connect")
        def _fast(dbapi_connection: Any, _record: Any) -> None:
            cursor = dbapi_connection.cursor()
            # Per connection: only WAL persists in the file, OFF lasts a connection.
            cursor.execute("PRAGMA journal_mode = OFF")
            cursor.execute("PRAGMA synchronous = OFF")
            cursor.execute("PRAGMA cache_size = -1000000")  # 1 GB
            cursor.close()

    try:
        with engine.begin() as conn:
            if pg:
                for table in tables:
                    conn.exec_driver_sql(f"ALTER TABLE {table.name} SET UNLOGGED")
        started = time.perf_counter()
        with engine.begin() as conn:
            if pg:
                conn.exec_driver_sql("SET LOCAL maintenance_work_mem = '1GB'")
                conn.exec_driver_sql("SET LOCAL work_mem = '1GB'")
            for index in indexes:
                index.drop(conn)
            conn.execute(sa.text(_fill_sql(engine.dialect.name, n)))
            for index in indexes:
                index.create(conn)
        events_s = time.perf_counter() - started
        started = time.perf_counter()
        with engine.begin() as conn:
            if pg:  # one sort to build the primary key beats millions of inserts into it
                conn.exec_driver_sql("SET LOCAL work_mem = '1GB'")
                conn.exec_driver_sql("SET LOCAL maintenance_work_mem = '1GB'")
                conn.exec_driver_sql("ALTER TABLE audit_counts DROP CONSTRAINT pk_audit_counts")
            rebuild(conn)
            if pg:
                conn.exec_driver_sql(
                    "ALTER TABLE audit_counts ADD CONSTRAINT pk_audit_counts PRIMARY KEY "
                    "(dim, level, bucket, key, key2, outcome, tier)"
                )
        counts_s = time.perf_counter() - started
        if pg:
            settle(engine)
        else:
            with engine.connect() as conn:
                conn.exec_driver_sql("PRAGMA journal_mode = WAL")
                conn.exec_driver_sql("ANALYZE")
    finally:
        engine.dispose()
    return events_s, counts_s


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
def database(kind: str, tmp: Path, kept: str | None = None) -> Iterator[str]:
    """A migrated database of ``kind`` (sqlite or postgresql).

    Without ``kept``, a fresh one dropped afterwards; with it, the SQLite file or
    PostgreSQL database of that name, created if missing and kept afterwards.
    """
    if kind == "sqlite":
        url = f"sqlite:///{Path(kept).resolve() if kept else tmp / 'kcache.db'}"
        upgrade(url)
        yield url
        return
    admin = sa.create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
    name = kept or f"kcache_bench_{os.getpid()}_{int(time.time())}"
    with admin.connect() as conn:
        exists = conn.exec_driver_sql(
            "SELECT 1 FROM pg_database WHERE datname = %(name)s", {"name": name}
        ).first()
        if not exists:
            conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    url = sa.engine.make_url(PG_ADMIN_URL).set(database=name).render_as_string(hide_password=False)
    try:
        upgrade(url)
        yield url
    finally:
        if not kept:
            with admin.connect() as conn:
                conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()


def kept_signing_key(kind: str, kept: str) -> Path:
    """The signing key of the servers on a kept database, kept for its next runs.

    A database records the key its servers sign with and refuses another one
    (kcache_server.signing_keys): a run's server must sign with the key of the first run.
    """
    from kcache.signing import SigningKey

    if kind == "sqlite":
        path = Path(kept).resolve().with_name(Path(kept).name + ".signing-key.pem")
    else:
        path = Path.home() / ".cache" / "kcache-bench" / f"{kept}.signing-key.pem"
    SigningKey.load_or_create(path)
    return path


def events_in(url: str) -> tuple[int, float | None]:
    """How many events the database at ``url`` holds, and the unix time of its last (None: none).

    A kept database may be filled already; its last event is when it was filled.
    """
    from kcache_server.models import AuditEvent

    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            held = int(conn.exec_driver_sql("SELECT count(*) FROM audit_events").scalar_one())
            last = conn.execute(sa.select(sa.func.max(AuditEvent.at))).scalar_one()
    finally:
        engine.dispose()
    return held, None if last is None else last.timestamp()


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


#: What the page's own clock says of one load: when its script could run
#: (DOMContentLoaded) and when it asked for and got its first ``/v1/stats`` answer.
#: Playwright's fixed clock replaces ``performance``; the page keeps the real one first.
_KEEP_PERFORMANCE_JS = "window.realPerformance = performance;"
_TIMELINE_JS = """() => {
  const perf = window.realPerformance;
  const nav = perf.getEntriesByType("navigation")[0];
  const stats = perf.getEntriesByType("resource").find((r) => r.name.includes("/v1/stats"));
  return {
    page_ready_s: nav.domContentLoadedEventEnd / 1000,
    stats_asked_s: stats ? stats.startTime / 1000 : null,
    stats_answered_s: stats ? stats.responseEnd / 1000 : null,
  };
}"""


def dashboard_paint_s(
    url: str, loads: int, as_of: float
) -> tuple[float, float, dict[str, float]] | None:
    """Median seconds from opening ``/dashboard`` in headless Chromium to its first paint and to its whole page.

    None where Chromium or Playwright is missing. The page draws progressively
    (``dashboard.js``): it asks ``/v1/stats`` for the window without ``group_by`` and
    draws that answer (hit rate, lookups, savings, errors, divergence, the chart, tiers,
    top missed kernels, the store), then asks with ``group_by=job`` and draws the jobs.
    First paint is the page's own signal ``document.body.dataset.paints >= 1``, set
    once the first answer's panels are on screen; the whole page is
    ``document.body.dataset.loads >= 1``, set once the jobs answer is drawn too (what
    tests/audit/test_dashboard.py waits for). Both include starting the page and its
    script, not Chromium's launch. Each of ``loads`` loads is a new page, opened once
    the last one's jobs are drawn; the third value is the page's own timeline of the
    load whose first paint is the median (:data:`_TIMELINE_JS`): what it waited for.
    The page's clock reads ``as_of`` (``Date.now()``, which its window ends at).
    """
    chromium = os.environ.get("KCACHE_TEST_CHROMIUM", "/usr/bin/chromium")
    if not os.path.exists(chromium):
        return None
    os.environ.setdefault("PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD", "1")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        return None
    seen: list[tuple[float, float, dict[str, float]]] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=chromium, args=["--no-sandbox", "--disable-gpu"], headless=True
        )
        try:
            for _ in range(loads):
                page = browser.new_page(viewport={"width": 1440, "height": 1100})
                page.add_init_script(_KEEP_PERFORMANCE_JS)
                page.clock.set_fixed_time(as_of)
                started = time.perf_counter()
                page.goto(f"{url}/dashboard")
                page.wait_for_function(
                    "() => Number(document.body.dataset.paints || 0) >= 1",
                    timeout=600_000,
                    polling=10,
                )
                first = time.perf_counter() - started
                page.wait_for_function(
                    "() => Number(document.body.dataset.loads || 0) >= 1",
                    timeout=600_000,
                    polling=10,
                )
                whole = time.perf_counter() - started
                seen.append((first, whole, page.evaluate(_TIMELINE_JS)))
                page.close()
        finally:
            browser.close()
    seen.sort(key=lambda load: load[0])
    first, _, timeline = seen[len(seen) // 2]
    return first, statistics.median(load[1] for load in seen), timeline


def run(
    kind: str,
    events: int,
    rounds: int,
    kept: str | None = None,
    only: set[str] | None = None,
    paint: bool = True,
) -> None:
    """Fill one database of ``kind`` (or reuse ``kept``), serve it, time the shapes of ``/v1/stats``."""
    goal = "< 1 s at 10M" if kind == "postgresql" else "< 2 s at 10M"
    with (
        tempfile.TemporaryDirectory(prefix="kcache-b10-") as tmp,
        database(kind, Path(tmp), kept) as url,
    ):
        held, last = events_in(url)
        if held == 0:
            events_s, counts_s = fill(url, events)
            as_of = time.time()
        elif held == events and last is not None:
            events_s = counts_s = 0.0  # reused: filled by an earlier run
            as_of = last + 1.0  # the windows end as they did when it was filled
        else:
            raise SystemExit(f"{kept} holds {held} events, not --events {events}")
        fill_s = events_s + counts_s
        floor = floor_scan_s(url, rounds)
        env = {**os.environ, "KCACHE_AUDIT_RETENTION_DAYS": "0"}  # keep every row raw
        if kept:  # the server of a reused database signs with the key it recorded there
            env["KCACHE_SIGNING_KEY_FILE"] = str(kept_signing_key(kind, kept))
        with ServerProcess(Path(tmp) / "data", db_url=url, workers=1, env=env) as server:
            now = as_of
            shapes: dict[str, dict[str, str]] = {
                group or "all": {"group_by": group} if group else {}
                for group in ("", "kernel", "job", "client", "target", "rank")
            }
            # What the dashboard asks on opening: the last 24 h (edges mid-hour), 60 buckets,
            # first without group_by (its first paint), then by job (the jobs table).
            day = {
                "since": f"{now - 86400:.3f}",
                "until": f"{now:.3f}",
                "buckets": "60",
                "top": "10",
            }
            shapes["dashboard_24h_first"] = day
            shapes["dashboard_24h"] = {**day, "group_by": "job"}
            # How many count rows a 24 h window reads depends on where its whole hours
            # fall in UTC days (windows._days_less_hours): ending now, today is its day's row
            # less the current hour. The same query ending at the last 12:20 UTC, a day
            # back, is the other extreme: every whole hour read as itself.
            noon = (now - 86400) // 86400 * 86400 + 12 * 3600 + 1200
            shapes["dashboard_24h_noon"] = {
                **day,
                "since": f"{noon - 86400:.3f}",
                "until": f"{noon:.3f}",
                "group_by": "job",
            }
            for shape, params in shapes.items():
                if only is not None and shape not in only:
                    continue
                seconds, body = time_stats(server.url, params, rounds)
                assert "since" in params or body["lookups"] == events, body["lookups"]
                emit(
                    f"B10.stats.{kind}.{shape}_s",
                    seconds,
                    floor,
                    "s",
                    anchor_is="one full scan of audit_events",
                    events=events,
                    fill_s=round(fill_s, 1),
                    reused=held == events,
                    as_of=round(as_of, 3),
                    fill_events_s=round(events_s, 1),
                    fill_counts_s=round(counts_s, 1),
                    groups=len(body["groups"]),
                    top_missed=len(body["top_missed"]),
                    divergence=len(body["divergence"]),
                    goal=goal,
                )
            painted = dashboard_paint_s(server.url, rounds, as_of) if paint else None
            if painted is not None:
                first, whole, timeline = painted
                emit(
                    f"B10.dashboard.{kind}.first_paint_s",
                    first,
                    None,
                    "s",
                    events=events,
                    loads=rounds,
                    drawn="the first /v1/stats answer (no group_by): every panel but jobs",
                    **{k: None if v is None else round(v, 3) for k, v in timeline.items()},
                    goal="< 2 s at 10M",
                )
                emit(
                    f"B10.dashboard.{kind}.whole_page_s",
                    whole,
                    None,
                    "s",
                    events=events,
                    loads=rounds,
                    drawn="the group_by=job answer too: jobs and their ranks",
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--db", choices=("sqlite", "postgresql", "both"), default="both")
    parser.add_argument("--sqlite-file", help="keep (or reuse) the SQLite database in this file")
    parser.add_argument(
        "--pg-database", help="keep (or reuse) the PostgreSQL database of this name"
    )
    parser.add_argument("--shapes", help="comma-separated shapes to time (default: all)")
    parser.add_argument("--no-paint", action="store_true", help="skip the dashboard in Chromium")
    args = parser.parse_args()
    only = set(args.shapes.split(",")) if args.shapes else None
    for kind in ("sqlite", "postgresql") if args.db == "both" else (args.db,):
        kept = args.sqlite_file if kind == "sqlite" else args.pg_database
        run(kind, args.events, args.rounds, kept, only, not args.no_paint)


if __name__ == "__main__":
    main()
