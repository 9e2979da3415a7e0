"""The counts ``/v1/stats`` sums agree with the raw events, however they were written.

Every check compares two independent accounts on a real database (SQLite and, where
it runs, PostgreSQL): the counts the writer kept (Python aggregation per flush, upserts)
against :func:`~kcache_server.auditing.counts.rebuild` (bulk SQL over the events), and
``compute_stats`` served from counts against the same query read from raw events only
(the path filtered queries take). Windows start and end mid-hour, so the raw edges and
the count spans must join exactly.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from kcache_server import migrate
from kcache_server.auditing import counts, window_source, windows
from kcache_server.auditing.events import ClientEvent, ingest_events
from kcache_server.auditing.retention import roll_up
from kcache_server.auditing.stats import compute_stats
from kcache_server.auditing.stats_models import StatsQuery
from kcache_server.auditing.windows import CountSpan, RawPiece
from kcache_server.auditing.writer import AuditLog, AuditRecord
from kcache_server.db import open_database

NOW = datetime.now(timezone.utc).replace(microsecond=0)
# Three days back, 17 minutes past an hour: events spread over several days and hours.
START = (NOW - timedelta(days=3)).replace(minute=17, second=0)
D = [f"{i:064x}" for i in range(1, 5)]
BASE = "b" * 64
# A UTC midnight two days back: windows inside and across whole days.
DAY0 = (NOW - timedelta(days=2)).replace(hour=0, minute=0, second=0)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The URL of an empty database of each kind."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'counts.db'}"
    value: str = request.getfixturevalue("pg_url")
    return value


@pytest.fixture
def engine(url: str) -> Iterator[sa.Engine]:
    """A database of each kind at the head revision."""
    migrate.upgrade(url)
    db = open_database(url)
    yield db
    db.dispose()


def _record(i: int) -> AuditRecord:
    """A varied server event: outcomes, kernels, jobs, ranks, a NULL here and there."""
    outcome = ("hit", "compiled", "miss", "error", "waited", "hit", "hit")[i % 7]
    return AuditRecord(
        outcome,
        "resolve",
        1.0 + i % 5,
        kernel=None if i % 11 == 0 else f"k{i % 4}",
        target=None if i % 13 == 0 else ("sm_80", "sm_90")[i % 2],
        client_id=f"c{i % 3}",
        job_id=None if i % 9 == 0 else f"j{i % 3}",
        rank=None if i % 10 == 0 else i % 4,
        world_size=4 + i % 3,
        base_key=BASE,
        recipe_key=f"{i % 6:064x}",
        digest=None if outcome in ("miss", "error") else D[(i // 17) % 2 + (i % 3 == 0)],
        error="compile_error" if outcome == "error" else None,
        compile_seconds_saved=0.25 if outcome == "hit" else 0.0,
        at=START + timedelta(minutes=23 * i),
    )


def _write_mixed(db: sa.Engine) -> None:
    """Server events, tallied warm hits (count > 1) and client reports, in several flushes."""
    log = AuditLog(db)
    for i in range(240):  # about four days, one event every 23 minutes
        log.record(_record(i))
        if i % 60 == 59:
            log.flush()
    for _ in range(5):  # one row standing for five lookups, written at flush time
        log.tally(
            "warm",
            lambda: AuditRecord("hit", "artifact", 0.1, kernel="k1", job_id="j1", rank=2),
            latency_ms=0.1,
            saved=0.5,
        )
    log.flush()
    reports = [
        ClientEvent.model_validate(
            {
                "time": (START + timedelta(hours=h, minutes=41)).timestamp(),
                "outcome": "local_hit",
                "tier": ("node", "memory")[h % 2],
                "kernel": "k2",
                "job_id": "j2",
                "rank": h % 4,
                "base_key": BASE,
                "digest": D[3] if h == 5 else D[0],
                "target": "sm_80",
                "count": 1 + h,
            }
        )
        for h in range(0, 60, 5)
    ]
    # Two reporters, and reports from before reporters were recorded (none named).
    for who in ("token:a", "token:b", None):
        mine = [r for i, r in enumerate(reports) if ("token:a", "token:b", None)[i % 3] == who]
        assert ingest_events(db, mine, reporter=who) == len(mine)


def _table(db: sa.Engine, table: str) -> list[tuple[Any, ...]]:
    with db.connect() as conn:
        rows = conn.execute(sa.text(f"SELECT * FROM {table}")).all()
    # Sums of floats may differ in the last bits between Python and SQL.
    return sorted(tuple(round(v, 9) if isinstance(v, float) else v for v in row) for row in rows)


def _answers(db: sa.Engine, query: StatsQuery) -> dict[str, Any]:
    body = compute_stats(db, query).model_dump()
    body.pop("store")
    return body


def _raw_answers(db: sa.Engine, query: StatsQuery, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The answer read from raw events and roll-ups only (what the code before counts did)."""
    with monkeypatch.context() as patch:
        patch.setattr(window_source, "counted", lambda query: False)
        return _answers(db, query)


WINDOWS = [
    {},
    {"since": START + timedelta(hours=5, minutes=31)},
    {"until": NOW - timedelta(hours=20, minutes=7)},
    {  # starts and ends mid-hour, spans a whole day in between
        "since": START + timedelta(hours=2, minutes=3, seconds=5),
        "until": START + timedelta(days=2, hours=1, minutes=50),
    },
    {
        "since": START + timedelta(hours=3, minutes=5),
        "until": START + timedelta(hours=3, minutes=50),
    },
    {"since": START + timedelta(hours=6), "until": START + timedelta(hours=30)},
    # Read as a day's row less the hours outside (_days_less_hours): most of one UTC
    # day, mid-hour edges; from early in a day to a few minutes ago (today: the day's
    # row less the current hour); the last 24 h, as the dashboard asks.
    {
        "since": DAY0 + timedelta(hours=2, minutes=10),
        "until": DAY0 + timedelta(hours=21, minutes=40),
    },
    {"since": DAY0 + timedelta(hours=1, minutes=5), "until": NOW - timedelta(minutes=7)},
    {"since": NOW - timedelta(days=1), "until": NOW},
]


def test_a_partly_covered_day_is_its_row_less_the_hours_outside() -> None:
    """The plan the windows above rely on: a day's row less hours, never for the series.

    Window 6 runs 02:10-21:40 of one day. Its first partial hour is the 02:00 row
    less the raw events of 02:00-02:10 (10 minutes outside against 50 inside), and so
    joins the whole hours; the last is read raw (20 minutes outside against 40).
    """
    inside = StatsQuery(since=WINDOWS[6]["since"], until=WINDOWS[6]["until"])
    spans, raw = windows.plan(inside, counts.LEVELS["kernel"])

    def at(hours: int, minutes: int = 0) -> datetime:
        return DAY0 + timedelta(hours=hours, minutes=minutes)

    assert spans == [
        CountSpan(86400, (DAY0, at(24))),
        CountSpan(3600, (DAY0, at(2)), -1),
        CountSpan(3600, (at(21), at(24)), -1),
    ]
    assert raw == [RawPiece((at(2), at(2, 10)), -1), RawPiece((at(21), at(21, 40)))]
    # The series keeps one row per bucket: hours, and minutes at the edges where no
    # roll-up holds their hour (raw where one does).
    spans, raw = windows.plan(inside, counts.LEVELS["all"], subtract=False)
    assert spans == [
        CountSpan(60, (at(2, 10), at(3)), unless_rolled=at(2)),
        CountSpan(60, (at(21), at(21, 40)), unless_rolled=at(21)),
        CountSpan(3600, (at(3), at(21))),
    ]
    assert raw == [
        RawPiece((at(2, 10), at(3)), if_rolled=at(2)),
        RawPiece((at(21), at(21, 40)), if_rolled=at(21)),
    ]
    # A few hours of a day are read as hours.
    short = StatsQuery(since=at(3), until=at(6))
    assert windows.plan(short, counts.LEVELS["job"]) == ([CountSpan(3600, (at(3), at(6)))], [])


def test_a_window_ending_now_reads_its_last_hour_less_nothing() -> None:
    """The hour a window ends in, up to now, is its row less the (empty) rest of the hour."""
    now = datetime.now(timezone.utc)
    hour = now.replace(minute=0, second=0, microsecond=0)
    if now == hour:
        now += timedelta(microseconds=1)
    query = StatsQuery(since=hour - timedelta(hours=3), until=now)
    _, raw = windows.plan(query, counts.LEVELS["job"])
    assert raw == [RawPiece((now, hour + timedelta(hours=1)), -1)]


def _check_against_raw(db: sa.Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    for window in WINDOWS:
        for group_by in (None, "kernel", "target", "client", "job", "rank"):
            for buckets in (60, 7, 500):
                query = StatsQuery(group_by=group_by, buckets=buckets, **window)  # type: ignore[arg-type]
                counted = _answers(db, query)
                assert counted == _raw_answers(db, query, monkeypatch), (window, group_by)
        assert _answers(db, StatsQuery(**window))["lookups"] > 0 or window  # type: ignore[arg-type]


_KEPT = ("audit_counts", "audit_digests", "audit_divergences")


def _divergence_from_events(db: sa.Engine, query: StatsQuery) -> list[dict[str, Any]]:
    """Rank divergence by grouping every raw event in Python: the definition, not the probes."""
    with db.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT id, at, job_id, base_key, target, digest, rank, kernel, tier, client_id,"
                " reporter FROM audit_events WHERE job_id IS NOT NULL AND base_key IS NOT NULL"
                " AND digest IS NOT NULL"
            )
        ).all()
    found: dict[tuple[Any, ...], list[Any]] = {}
    for row in rows:
        at = row.at if isinstance(row.at, datetime) else datetime.fromisoformat(row.at)
        at = at.replace(tzinfo=timezone.utc) if at.tzinfo is None else at
        if (query.since and at < query.since) or (query.until and at >= query.until):
            continue
        if any(
            getattr(query, name) is not None and getattr(row, name) != getattr(query, name)
            for name in ("job_id", "client_id", "kernel", "target")
        ):
            continue
        found.setdefault((row.job_id, row.base_key, row.target or ""), []).append((at, row))
    result = []

    def row_of(key: tuple[Any, ...], events: list[Any], digests: set[str], **more: Any) -> Any:
        ranks = {("-" if row.rank is None else str(row.rank)): row.digest for _, row in events}
        return {
            "job_id": key[0],
            "base_key": key[1],
            "target": key[2] or None,
            "kernel": next((row.kernel for _, row in events if row.kernel), None),
            "digests": sorted(digests),
            "ranks": dict(
                sorted(
                    ranks.items(),
                    key=lambda kv: (kv[0] == "-", int(kv[0]) if kv[0] != "-" else 0),
                )
            ),
            **more,
        }

    for key, events in sorted(found.items()):
        events.sort(key=lambda e: (e[0], e[1].id))
        # The server's row holds the server's events alone; client reports naming other
        # digests make a row of their own, with every event's word and its reporters.
        observed = [e for e in events if e[1].tier == "server"]
        server = {row.digest for _, row in observed}
        unseen = {row.digest for _, row in events if row.tier != "server"} - server
        if len(server) > 1:
            result.append(row_of(key, observed, server, reported=False, reported_by=[]))
        if unseen and len(server | unseen) > 1:
            reporters = {
                row.reporter
                for _, row in events
                if row.tier != "server" and row.digest in unseen and row.reporter
            }
            result.append(
                row_of(key, events, server | unseen, reported=True, reported_by=sorted(reporters))
            )
    return result[: query.limit]


def test_divergence_probes_equal_a_grouping_of_the_raw_events(engine: sa.Engine) -> None:
    """Candidates from audit_divergences, confirmed by index probes, give the grouped answer.

    The windows cut through runs of digests (a digest first seen before a window and
    last seen after it, but not inside it, is not in the answer), and the seeded
    recipes include NULL targets and NULL ranks, which the probes match apart.
    """
    _write_mixed(engine)
    filters: list[dict[str, Any]] = [{}, {"job_id": "j1"}, {"client_id": "c2"}]
    filters += [{"kernel": "k2"}, {"target": "sm_80"}, {"limit": 1}]
    checked, hearsay = 0, set()
    for window in WINDOWS:
        for extra in filters:
            query = StatsQuery(**window, **extra)  # type: ignore[arg-type]
            expected = _divergence_from_events(engine, query)
            assert _answers(engine, query)["divergence"] == expected, (window, extra)
            checked += len(expected)
            hearsay |= {tuple(d["reported_by"]) for d in expected if d["reported"]}
    assert checked > 20
    assert ("token:b",) in hearsay, hearsay  # a reported row, naming its reporter
    with engine.connect() as conn:
        nulls = conn.execute(
            sa.text("SELECT count(*) FROM audit_divergences WHERE target = ''")
        ).scalar_one()
    assert nulls > 0, "a recipe without a target diverges too"


def test_counts_equal_a_recount_of_the_events(
    engine: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    _write_mixed(engine)
    kept = [_table(engine, table) for table in _KEPT]
    assert kept[2], "the seeded recipes diverge"
    with engine.begin() as conn:
        counts.rebuild(conn)
    assert [_table(engine, table) for table in _KEPT] == kept
    with engine.connect() as conn:
        events = conn.execute(sa.text("SELECT sum(count) FROM audit_events")).scalar_one()
        for level in counts.LEVELS["all"]:
            counted = conn.execute(
                sa.text("SELECT sum(count) FROM audit_counts WHERE dim = 'all' AND level = :l"),
                {"l": level},
            ).scalar_one()
            assert counted == events == 240 + 5 + sum(1 + h for h in range(0, 60, 5))
    _check_against_raw(engine, monkeypatch)
    body = _answers(engine, StatsQuery(group_by="job"))
    assert body["divergence"], "the seeded recipes diverge"


def test_counts_stay_exact_after_a_roll_up(
    engine: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    _write_mixed(engine)
    before = _answers(engine, StatsQuery(group_by="job"))
    # Roll up everything older than a day and a half: counts keep it, roll-ups hold it.
    assert roll_up(engine, NOW - timedelta(hours=36)) > 0
    after = _answers(engine, StatsQuery(group_by="job"))
    for field in ("lookups", "totals", "reported", "by_tier"):
        assert after[field] == before[field], field
    # The series' requests too; its kernel lookups cover the retention window only (the
    # roll-up drops those first made before its cutoff, as it drops raw events).
    requests = ("t", "total", "reported", "outcomes")
    assert [{k: p[k] for k in requests} for p in after["series"]] == [
        {k: p[k] for k in requests} for p in before["series"]
    ]
    # Windows over rolled-up hours: counts and (raw events + roll-ups) agree. Only
    # sub-hour series steps are left out: a roll-up keeps no minutes.
    for window in WINDOWS:
        for group_by in (None, "kernel", "job", "rank"):
            query = StatsQuery(group_by=group_by, buckets=7, **window)  # type: ignore[arg-type]
            counted, raw = _answers(engine, query), _raw_answers(engine, query, monkeypatch)
            if group_by == "job":  # world_size: the counts keep what the roll-up deleted
                for group in (*counted["groups"], *raw["groups"]):
                    group["world_size"] = None
            assert counted == raw, (window, group_by)


def test_an_upgrade_from_0006_counts_the_events_already_there(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    migrate.upgrade(url, "0006")
    db = open_database(url)
    try:
        old = [{k: v for k, v in vars(_record(i)).items()} for i in range(240)]
        rollup = {
            "bucket": (START - timedelta(days=1)).replace(minute=0),
            "outcome": "compiled",
            "tier": "server",
            "kernel": "k9",
            "target": "sm_80",
            "client_id": None,
            "job_id": "j-old",
            "rank": 0,
            "count": 7,
            "latency_ms_sum": 7.0,
            "compile_seconds_saved": 0.0,
            "last_at": START - timedelta(days=1),
            "last_error": None,
        }
        with db.begin() as conn:  # 0006's tables, written as that version did
            meta = sa.MetaData()
            events = sa.Table("audit_events", meta, autoload_with=conn)
            rollups = sa.Table("audit_rollups", meta, autoload_with=conn)
            conn.execute(sa.insert(events), old)
            conn.execute(sa.insert(rollups), [rollup])
        migrate.upgrade(url)
        body = _answers(db, StatsQuery(group_by="kernel"))
        assert body["lookups"] == 240 + 7
        assert {g["key"] for g in body["groups"]} >= {"k9", "k0", None}
        _check_against_raw(db, monkeypatch)
        # And the writer adds to the backfilled counts, never beside them.
        log = AuditLog(db)
        log.record(_record(1))
        log.flush()
        assert _answers(db, StatsQuery())["lookups"] == 248
    finally:
        db.dispose()


def test_the_sibling_probe_matches_targets_and_their_absence(engine: sa.Engine) -> None:
    """ "Header contents changed" needs an earlier recipe of the same base key and target.

    The probe matches targets by "=" and a missing target by a probe of its own; a
    sibling under another target (or none) is not one.
    """

    def compiled(kernel: str, recipe: str, target: str | None, minutes: int) -> dict[str, Any]:
        row = {k: v for k, v in vars(_record(0)).items()}
        row.update(
            outcome="compiled",
            kernel=kernel,
            recipe_key=recipe * 64,
            base_key=kernel[-1] * 64,
            target=target,
            digest=D[0],
            error=None,
            at=START + timedelta(minutes=minutes),
        )
        return row

    rows = [
        compiled("ka", "1", None, 0),  # ka: two recipes without a target
        compiled("ka", "2", None, 5),
        compiled("kb", "3", "sm_80", 0),  # kb: the earlier recipe had another target
        compiled("kb", "4", None, 5),
        compiled("kc", "5", "sm_90", 0),  # kc: two recipes for sm_90, the later one sorts first
        compiled("kc", "0", "sm_90", 5),
    ]
    with engine.begin() as conn:
        counts.write_events(conn, rows)
    missed = {m["kernel"]: m for m in _answers(engine, StatsQuery(top=50))["top_missed"]}
    changed = "header contents changed since an earlier build"
    assert missed["ka"]["last_miss_reason"] == changed
    assert missed["kb"]["last_miss_reason"] == "first build of this recipe"
    assert missed["kc"]["last_miss_reason"] == changed


def test_a_job_ranks_read_by_key_equal_them_read_by_range(
    engine: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Named buckets (window_source.keyed) and the range they fall back to give the same ranks.

    A job's per-rank counts and world size are read for the jobs shown only, each
    bucket the counts hold named so the database seeks (bucket, job) pairs; with
    more buckets than the bound the range is read instead. Both equal the raw recount.
    """
    _write_mixed(engine)
    for bound in (window_source.MAX_KEYED_BUCKETS, 1):
        monkeypatch.setattr(window_source, "MAX_KEYED_BUCKETS", bound)
        for window in WINDOWS:
            query = StatsQuery(group_by="job", **window)  # type: ignore[arg-type]
            counted = _answers(engine, query)
            assert counted == _raw_answers(engine, query, monkeypatch), (bound, window)
            assert any(g["ranks"] for g in counted["groups"]) or window, window


def test_the_groups_cut_at_the_limit_is_the_full_ranking_cut(engine: sa.Engine) -> None:
    """Groups ranked in SQL (dense_rank over totals, ties kept) and cut in Python.

    Jobs with equal totals straddle every cut: each limit's answer is the first
    groups of the whole ranking (most lookups, then the key as text), on counts and
    on raw events alike.
    """
    rows = []
    # Totals 3, 3, 3, 2, 2, 1 (and a job-less group of 2): ties at limits 1, 2, 4 and 5.
    for job, n in (("jc", 3), ("ja", 3), ("jb", 3), ("jz", 2), (None, 2), ("jy", 1)):
        for i in range(n):
            row = {k: v for k, v in vars(_record(i)).items()}
            row.update(job_id=job, outcome=("hit", "miss", "compiled")[i], digest=None)
            rows.append(row)
    with engine.begin() as conn:
        counts.write_events(conn, rows)
    for counted in (True, False):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(window_source, "counted", lambda query, counted=counted: counted)
            whole = _answers(engine, StatsQuery(group_by="job", limit=100))["groups"]
            assert [g["key"] for g in whole] == [
                "ja",
                "jb",
                "jc",
                None,
                "jz",
                "jy",
            ]  # "None" < "jz"
            for limit in range(1, 7):
                cut = _answers(engine, StatsQuery(group_by="job", limit=limit))["groups"]
                assert cut == whole[:limit], (counted, limit)


@pytest.mark.parametrize("level", [windows.MINUTE, windows.HOUR, windows.DAY])
def test_windows_round_exactly_up_to_the_last_instant(level: int) -> None:
    """A window may end at 9999-12-31 23:59:59.999999: rounding it must not leave the calendar.

    (A float timestamp rounds that instant up into year 10000; /v1/stats answered 500 for
    ``since=253402300767`` before the rounding went by whole seconds.)
    """
    last = windows.LATEST
    assert timedelta(0) <= last - windows.floor_to(last, level) < timedelta(seconds=level)
    assert windows.ceil_to(last, level) == last  # no later instant to round up to
    near_end = datetime.fromtimestamp(253402300767, timezone.utc)
    for dim in ("all", "job", "kernel"):
        spans, raw = windows.plan(StatsQuery(since=near_end), counts.LEVELS[dim])
        assert spans or raw  # the window's last half-minute, read from counts or raw events
    odd = datetime(2026, 12, 1, 10, 7, 30, 250000, tzinfo=timezone.utc)
    whole = int(odd.replace(microsecond=0).timestamp())  # exact as a float in this century
    assert windows.floor_to(odd, level).timestamp() == whole - whole % level
