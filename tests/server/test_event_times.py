"""Client event times ahead of the server's clock: accepted as the schema says, recorded at arrival.

The schema allows any time up to the year 9999 (a bound relative to now is one JSON
Schema cannot state); the server used to refuse a time more than
``audit.max_clock_skew_s`` ahead of its clock, so schema-valid batches were refused
(schemathesis' positive-data check). Now such a time is recorded as the batch's
arrival, a time within the skew as sent, and only what the schema forbids is refused;
the published description says so, with this server's setting.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import datetime, timezone
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from tests.support import ServerThread, unique

SKEW_S = 600.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    """One server whose clock skew bound is 10 minutes (stopped after the module)."""
    from kcache_server import Settings

    data = tmp_path_factory.mktemp("event-times") / "data"
    settings = Settings(
        data_dir=data,
        compile_workers=1,
        audit={"flush_s": 0.05, "max_clock_skew_s": SKEW_S},
        verify={"enabled": False},
    )
    started = ServerThread(settings)
    try:
        yield started
    finally:
        started.stop()


def _event(job: str, when: float) -> dict[str, Any]:
    return {"time": when, "outcome": "local_hit", "tier": "node", "job_id": job}


def _times(server: ServerThread, job: str) -> list[float]:
    engine = sa.create_engine(server.settings.database_url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                sa.text("SELECT at FROM audit_events WHERE job_id = :j ORDER BY id"), {"j": job}
            ).scalars()
            return [_seconds(at) for at in rows]
    finally:
        engine.dispose()


def _seconds(at: Any) -> float:
    if isinstance(at, str):  # SQLite hands the column back as text
        at = datetime.fromisoformat(at)
    if at.tzinfo is None:
        at = at.replace(tzinfo=timezone.utc)
    return float(at.timestamp())


def test_a_time_far_ahead_is_accepted_and_recorded_at_its_arrival(server: ServerThread) -> None:
    job = unique("ahead")
    soon = time.time() + SKEW_S / 2  # within the skew: recorded as sent
    ahead = [time.time() + 10 * 86_400, 253_402_300_798.0]  # days ahead; the schema's last second
    with server.client() as http:
        sent = time.time()
        r = http.post(
            "/v1/events", json={"events": [_event(job, soon), *(_event(job, t) for t in ahead)]}
        )
        arrived = time.time()
    assert r.status_code == 200, r.text
    assert r.json() == {"accepted": 3}
    recorded = _times(server, job)
    assert recorded[0] == pytest.approx(soon, abs=1e-3)
    for when in recorded[1:]:
        assert sent - 1 <= when <= arrived + 1, (when, sent, arrived)


def test_a_time_past_the_schemas_maximum_is_refused_naming_it(server: ServerThread) -> None:
    job = unique("past-max")
    with server.client() as http:
        r = http.post("/v1/events", json={"events": [_event(job, time.time()), _event(job, 1e12)]})
    assert r.status_code == 422, r.text
    assert r.json()["field"] == "events[1].time"
    assert _times(server, job) == []  # nothing of the batch was stored


def test_the_published_description_states_the_bound_and_what_happens_past_it(
    server: ServerThread,
) -> None:
    document = httpx.get(f"{server.url}/openapi.json", timeout=30).json()
    body = document["paths"]["/v1/events"]["post"]["requestBody"]["content"]["application/json"]
    field = body["schema"]["properties"]["events"]["items"]["properties"]["time"]
    assert field["x-max-clock-skew-s"] == SKEW_S
    assert field["maximum"] == 253_402_300_799.0
    assert "600 s on this server" in field["description"]
    assert "recorded as the time the batch arrived" in field["description"]
    assert "{setting:" not in str(document)
