"""Auditing is configured through the one ``Settings``: its ``audit`` section, ``KCACHE_AUDIT_*``."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import pytest
from pydantic import ValidationError

from tests.support import ServerThread


def test_the_audit_section_reads_the_same_variables_and_merges_what_code_gives(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kcache_server.settings import AuditSettings, Settings

    monkeypatch.setenv("KCACHE_AUDIT_RETENTION_DAYS", "7")
    monkeypatch.setenv("KCACHE_AUDIT_FLUSH_S", "0.2")
    monkeypatch.setenv("KCACHE_AUDIT_MAX_CLOCK_SKEW_S", "60")
    from_env = Settings().audit
    assert (from_env.retention_days, from_env.flush_s, from_env.max_clock_skew_s) == (
        7.0,
        0.2,
        60.0,
    )
    given = Settings(audit={"max_events_per_batch": 2}).audit
    assert (given.max_events_per_batch, given.retention_days) == (
        2,
        7.0,
    )  # the rest still from the environment
    assert Settings(audit=AuditSettings(flush_s=1.0)).audit.flush_s == 1.0
    # The settings `kcache serve --workers N` hands to each worker keep the section.
    dumped = Settings(audit={"rollup_interval_s": 5.0})
    assert Settings.model_validate_json(dumped.model_dump_json()).audit.rollup_interval_s == 5.0
    with pytest.raises(ValidationError, match="retention_days"):
        Settings(audit={"retention_days": -1})
    # A setting that does not exist is refused, not ignored (the old flat name included).
    with pytest.raises(ValidationError, match="audit_flush_s"):
        Settings(audit_flush_s=0.05)


def test_create_app_injects_the_audit_section_into_routes_and_workers(tmp_path: Path) -> None:
    """What code passes to create_app is what the events route and the retention worker use."""
    from kcache_server import Settings

    settings = Settings(
        data_dir=tmp_path / "data",
        compile_workers=1,
        audit={"flush_s": 0.05, "max_events_per_batch": 2, "retention_days": 3},
    )
    server = ServerThread(settings)
    try:
        retention = server.state.retention
        assert retention.retention == timedelta(days=3)
        assert (
            retention._thread is not None and retention._thread.is_alive()
        )  # the one lifespan started it
        event = {"time": time.time(), "outcome": "local_hit", "tier": "node"}
        with server.client() as http:
            assert http.post("/v1/events", json={"events": [event] * 2}).json() == {"accepted": 2}
            refused = http.post("/v1/events", json={"events": [event] * 3})
        assert refused.status_code == 422 and "at most 2" in refused.json()["detail"]
    finally:
        server.stop()
    assert not retention._thread.is_alive()  # and stopped it
