"""``POST /v1/events``: client batches are validated as a whole and stored as one transaction."""

from __future__ import annotations

import time
from typing import Any

import pytest
import sqlalchemy as sa

from tests.audit.workload import Workload


def _event(**overrides: Any) -> dict[str, Any]:
    event = {
        "time": time.time(),
        "outcome": "local_hit",
        "tier": "node",
        "recipe_key": "a" * 64,
        "digest": "b" * 64,
        "kernel": "k",
        "job_id": "job-events",
        "rank": 0,
        "latency_ms": 0.1,
    }
    event.update(overrides)
    return event


def _count(w: Workload, job: str) -> int:
    engine = sa.create_engine(w.server.settings.database_url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            return int(
                conn.execute(
                    sa.text("SELECT count(*) FROM audit_events WHERE job_id = :j"), {"j": job}
                ).scalar_one()
            )
    finally:
        engine.dispose()


@pytest.mark.parametrize(
    ("event", "field"),
    [
        (_event(digest="not-a-digest"), "events.1.digest"),
        (_event(outcome="hit"), "events.1.outcome"),
        (_event(tier="server"), "events.1.tier"),
        (_event(rank=-1), "events.1.rank"),
        (_event(time=1e12), "events[1].time"),  # past the schema's maximum
    ],
)
def test_a_bad_event_refuses_the_batch_and_names_it(
    workload: Workload, event: dict, field: str
) -> None:
    job = f"job-bad-{field}"
    with workload.server.client() as http:
        r = http.post("/v1/events", json={"events": [_event(job_id=job), {**event, "job_id": job}]})
    assert r.status_code == 422, r.text
    assert r.json()["field"] == field
    assert _count(workload, job) == 0  # nothing of the batch was stored


def test_a_batch_over_the_limit_is_refused(workload: Workload) -> None:
    with workload.server.client() as http:
        r = http.post("/v1/events", json={"events": [_event(job_id="job-big")] * 10_001})
    assert r.status_code == 422
    assert "at most 10000" in r.json()["detail"]
    assert _count(workload, "job-big") == 0


def test_local_hits_are_credited_with_the_artifacts_compile_time(workload: Workload) -> None:
    digest, seconds = next(iter(workload.compile_seconds.items()))
    with workload.server.client() as http:
        r = http.post(
            "/v1/events", json={"events": [_event(job_id="job-credit", digest=digest)] * 4}
        )
        assert r.json() == {"accepted": 4}
        stats = http.get("/v1/stats", params={"job_id": "job-credit"}).json()
    assert stats["reported"]["local_hit"] == 4 and sum(stats["totals"].values()) == 0
    assert stats["by_tier"] == {
        "node": {**dict.fromkeys(stats["by_tier"]["node"], 0), "local_hit": 4}
    }
    # One process's four reports of one kernel: one compile avoided (at most one per process
    # and kernel), all of it the clients' word.
    assert stats["compiles_avoided"] == 1 and stats["reported_hits"] == 1
    assert stats["reported_compile_seconds_saved"] == pytest.approx(seconds)
    assert stats["compile_seconds_saved"] == pytest.approx(seconds)
    assert seconds > 0


def test_unknown_fields_from_newer_clients_are_ignored(workload: Workload) -> None:
    with workload.server.client() as http:
        r = http.post("/v1/events", json={"events": [_event(job_id="job-new", local_rank=3)]})
    assert r.status_code == 200 and r.json() == {"accepted": 1}
    assert _count(workload, "job-new") == 1


def test_a_tallied_event_counts_every_lookup_it_stands_for(workload: Workload) -> None:
    digest, seconds = next(iter(workload.compile_seconds.items()))
    with workload.server.client() as http:
        r = http.post(
            "/v1/events",
            json={
                "events": [
                    _event(job_id="job-tally", digest=digest, count=1000),
                    _event(job_id="job-tally"),
                ]
            },
        )
        assert r.status_code == 200, r.text
        stats = http.get("/v1/stats", params={"job_id": "job-tally"}).json()
        refused = http.post("/v1/events", json={"events": [_event(job_id="job-tally", count=0)]})
    assert _count(workload, "job-tally") == 2  # two rows...
    assert stats["reported"]["local_hit"] == 1001  # ...standing for 1001 lookups
    # ...of one kernel lookup: the 1000 are one process's, the other names bytes no
    # artifact has. One compile avoided, not 1000.
    assert stats["kernel_lookups"] == 1 and stats["compiles_avoided"] == 1
    assert stats["reported_compile_seconds_saved"] == pytest.approx(seconds)
    assert refused.status_code == 422 and refused.json()["field"] == "events.0.count"
