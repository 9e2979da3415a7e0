"""Audit event ingestion: ``POST /v1/events`` in batches against a plain executemany.

ours:   events/s that a real ``kcache serve`` (SQLite) accepts through ``POST /v1/events``,
        batches of ``BATCH`` sent back to back by one client (bodies encoded before the
        clock starts: the figure is the server's: HTTP, validation, one transaction each).
anchor: events/s of a plain SQLAlchemy ``insert(audit_events)`` executemany of the same
        rows, same batches, into the same database file, one transaction per batch;
        the sides alternate batch by batch, so all write into tables of the same size.
also:   ``counted``: the same rows through ``counts.write_events`` (events plus the
        ``audit_counts``/``audit_digests`` upserts every audit write makes), in the same
        rotation: ``counted / anchor`` is what the maintained counts cost a write.
goal:   ours >= 5,000 events/s (issue 6). Bounded: SECONDS per side at most.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import emit, kcache_server
from kcache_server.auditing.counts import write_events
from kcache_server.db import open_database
from kcache_server.models import AuditEvent

BATCH = 1000
BATCHES = 50
SECONDS = 10.0


def _events(n: int, job: str) -> list[dict[str, Any]]:
    now = time.time()
    return [
        {
            "time": now - i * 0.001,
            "outcome": "local_hit",
            "tier": "node" if i % 4 else "memory",
            "recipe_key": uuid.UUID(int=i).hex * 2,
            "base_key": uuid.UUID(int=i // 2).hex * 2,
            "digest": uuid.UUID(int=i % 97).hex * 2,
            "kernel": f"kernel_{i % 50}",
            "target": "sm_90",
            "toolchain": "nvrtc-13.0",
            "client_id": f"{job}-r{i % 8}",
            "host": f"node{i % 4}",
            "pid": 1000 + i % 8,
            "job_id": job,
            "rank": i % 8,
            "world_size": 8,
            "latency_ms": 0.02,
        }
        for i in range(n)
    ]


def _rows(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for e in events:
        row = {k: v for k, v in e.items() if k != "time"}
        row.update(
            at=datetime.fromtimestamp(e["time"], timezone.utc),
            route="events",
            error=None,
            compile_seconds_saved=0.0,
        )
        rows.append(row)
    return rows


def _measure(url: str, db_url: str) -> tuple[float, float, float, int]:
    """Alternate one batch each way, so every side sees the same table size and indexes."""
    bodies = [json.dumps({"events": _events(BATCH, f"bench-{b}")}).encode() for b in range(BATCHES)]
    rows = [_rows(_events(BATCH, f"anchor-{b}")) for b in range(BATCHES)]
    counted_rows = [_rows(_events(BATCH, f"counted-{b}")) for b in range(BATCHES)]
    for batch in counted_rows:
        for row in batch:
            row["count"] = 1
    table = AuditEvent.__table__
    engine = open_database(db_url)
    ours_s = anchor_s = counted_s = 0.0
    done = 0
    try:
        with httpx.Client(
            base_url=url, timeout=60, headers={"Content-Type": "application/json"}
        ) as http:
            http.post("/v1/events", content=bodies[0]).raise_for_status()  # warm-up, not timed
            with engine.begin() as conn:
                conn.execute(sa.insert(table), rows[0])
            with engine.begin() as conn:
                write_events(conn, counted_rows[0])
            for body, batch, counted in zip(bodies[1:], rows[1:], counted_rows[1:], strict=True):
                t0 = time.perf_counter()
                http.post("/v1/events", content=body).raise_for_status()
                t1 = time.perf_counter()
                with engine.begin() as conn:
                    conn.execute(sa.insert(table), batch)
                t2 = time.perf_counter()
                with engine.begin() as conn:
                    write_events(conn, counted)
                t3 = time.perf_counter()
                ours_s += t1 - t0
                anchor_s += t2 - t1
                counted_s += t3 - t2
                done += BATCH
                if ours_s + anchor_s + counted_s > SECONDS:
                    break
    finally:
        engine.dispose()
    return done / ours_s, done / anchor_s, done / counted_s, done


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="kcache-bench-events-") as tmp:
        data_dir = Path(tmp)
        with kcache_server(data_dir=data_dir) as url:
            ours, anchor, counted, sent = _measure(url, f"sqlite:///{data_dir / 'kcache.db'}")
    emit(
        "events_ingest.events_per_s",
        ours,
        anchor,
        "events/s",
        batch=BATCH,
        events=sent,
        counted_events_per_s=round(counted, 1),
        counted_vs_anchor=round(counted / anchor, 3),
        goal=5000,
        met=ours >= 5000,
    )


if __name__ == "__main__":
    main()
