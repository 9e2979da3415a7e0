"""Client audit events (``POST /v1/events``): their schema and their batched insert.

A client's memory and node-tier hits never reach the server, so the client sends
them afterwards in batches (with a ``report``-scope token). They are the client's
word, so they are bounded and attributed:

- one event stands for at most :data:`MAX_EVENT_COUNT` lookups (``count``): what one
  process tallies into one event before it opens another (the client's own limit,
  ``kcache_client._events.MAX_EVENT_COUNT``). A memory hit costs a client about a
  microsecond, so a process in a tight loop looks up about that many between two of
  its sends (every 2 s); a lower cap would refuse honest batches, which the client drops;
- one token reports at most ``audit.max_reported_per_minute`` lookups per minute of
  arrival, summed over its batches and over every replica (``audit_report_windows``,
  charged in the batch's own transaction, :func:`ingest_events`). A batch past it is
  refused whole with 429 and Retry-After (the client keeps it and sends it again); a
  batch that alone holds more can never be taken and is a 422 (:func:`check_batch`).
  Arrival, not the events' own times: a client chooses those;
- every event is stored with its ``reporter`` (``token:<name>``, or
  ``client:<address>`` on an open server), so ``/v1/stats`` names who reported what
  (``reported_by``) and keeps it apart from what the server observed itself.

A batch is validated as a whole (a bad event names its index and field) and inserted
with one ``executemany`` in one transaction, so a batch is either recorded entirely or
not at all, and ingestion costs one round trip per batch rather than per event.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from typing import Annotated, Any, Literal

import sqlalchemy as sa
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy.dialects import postgresql, sqlite

from kcache.outcomes import CLIENT_OUTCOMES, ClientOutcome
from kcache_server.auditing.counts import write_events
from kcache_server.errors import InvalidRequestError, ReportLimitError
from kcache_server.models import artifacts_table as _artifacts
from kcache_server.models import audit_report_windows_table as _windows
from kcache_server.schemas import (
    INTEGRAL,
    SETTING_MARK,
    Context,
    HexKey,
    Label32,
    Label64,
    Label128,
    Label1024,
)

__all__ = [
    "BATCH_DESCRIPTION",
    "CLIENT_OUTCOMES",
    "CLIENT_TIERS",
    "MAX_EVENT_COUNT",
    "ClientEvent",
    "EventBatch",
    "IngestResult",
    "ingest_events",
]

#: The client's tiers: its in-process memory and the node-local directory, and
#: ``library`` for a ``bypass`` (the adapter's library compiled it, outside kcache).
CLIENT_TIERS = ("memory", "node", "library")

#: The most lookups one event may stand for (a client tallies more into several events).
MAX_EVENT_COUNT = 1_000_000


#: The latest event time the schema states: the last second of the year 9999. The
#: server refuses far less (``audit.max_clock_skew_s`` past its clock), but a bound
#: relative to now is one JSON Schema cannot state.
MAX_EVENT_TIME = 253_402_300_799.0


class ClientEvent(Context):
    """One lookup a client served itself: who asked (the resolve ``Context``) plus what it found."""

    # A newer client may send more fields; dropping them beats refusing its audit trail.
    model_config = ConfigDict(extra="ignore")

    time: float = Field(
        gt=0,
        strict=True,
        allow_inf_nan=False,
        description=(
            "when, in unix seconds. A time more than x-max-clock-skew-s seconds past the "
            "server's clock when the batch arrives is recorded as the batch's arrival (check "
            "the client's clock); JSON Schema cannot state a bound relative to now"
        ),
        json_schema_extra={
            "maximum": MAX_EVENT_TIME,
            SETTING_MARK: {"x-max-clock-skew-s": "audit.max_clock_skew_s"},
        },
    )
    outcome: ClientOutcome = Field(
        description="local_hit, bypass (an adapter's library compiled it, uncached) or late "
        "(a frozen client missed its tiers after its warmup): the server records the rest"
    )
    tier: Literal["memory", "node", "library"]
    reason: Label64 | None = Field(
        default=None, description="why a bypass bypassed kcache (backend=nvcc, code_type=ptx, ...)"
    )
    recipe_key: HexKey | None = None
    base_key: HexKey | None = None
    digest: HexKey | None = None
    kernel: Label1024 | None = None
    target: Label32 | None = None
    toolchain: Label128 | None = None
    count: Annotated[int, Field(strict=True, ge=1, le=MAX_EVENT_COUNT), INTEGRAL] = Field(
        default=1,
        description="identical lookups this event stands for: at most 1000000, what one "
        "process tallies into one event before it opens another",
    )
    latency_ms: float = Field(default=0.0, ge=0, le=86_400_000, strict=True, allow_inf_nan=False)


#: The published description of a batch (``{setting:...}`` filled in by :mod:`kcache_server.serving.openapi`).
BATCH_DESCRIPTION = (
    "client-reported lookups, stored with the token that posted them and shown apart from "
    "what the server observed. One token reports at most x-max-reported-per-minute "
    "({setting:audit.max_reported_per_minute} on this server) lookups (the sum of count) per "
    "minute of arrival: a batch past it is refused whole with 429 and Retry-After (the "
    "seconds left in the minute); a batch holding more on its own is a 422"
)


class EventBatch(BaseModel):
    """Body of ``POST /v1/events``."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "description": BATCH_DESCRIPTION,
            SETTING_MARK: {"x-max-reported-per-minute": "audit.max_reported_per_minute"},
        },
    )

    events: list[ClientEvent] = Field(
        json_schema_extra={SETTING_MARK: {"maxItems": "audit.max_events_per_batch"}}
    )


class IngestResult(BaseModel):
    """Answer of ``POST /v1/events``."""

    accepted: int


def _compile_seconds(conn: sa.Connection, digests: set[str]) -> dict[str, float]:
    # A local hit saved what the artifact cost to compile; the client does not know
    # that figure, the artifacts table does.
    if not digests:
        return {}
    rows = conn.execute(
        sa.select(_artifacts.c.digest, _artifacts.c.compile_seconds).where(
            _artifacts.c.digest.in_(sorted(digests))
        )
    )
    return {row.digest: float(row.compile_seconds) for row in rows}


def _row(event: ClientEvent, saved: dict[str, float], reporter: str | None) -> dict[str, Any]:
    return {
        "reporter": reporter,
        "at": datetime.fromtimestamp(event.time, timezone.utc),
        "outcome": event.outcome,
        "tier": event.tier,
        "route": "events",
        "recipe_key": event.recipe_key,
        "base_key": event.base_key,
        "digest": event.digest,
        "kernel": event.kernel,
        "target": event.target,
        "toolchain": event.toolchain,
        "error": event.reason,  # a bypass's reason; the column a server error's code goes in
        "client_id": event.client_id,
        "host": event.host,
        "pid": event.pid,
        "job_id": event.job_id,
        "rank": event.rank,
        "world_size": event.world_size,
        "latency_ms": event.latency_ms,
        "count": event.count,
        "compile_seconds_saved": event.count * saved.get(event.digest, 0.0)
        if event.digest
        else 0.0,
    }


def check_batch(
    events: Sequence[ClientEvent],
    *,
    max_events: int,
    max_skew_s: float,
    now: float | None = None,
    max_reported: int | None = None,
) -> None:
    """Refuse a batch over ``max_events``, with an event time too far in the future, or
    standing for more lookups than one token may report a minute (``max_reported``)."""
    if len(events) > max_events:
        raise InvalidRequestError(
            "events", f"{len(events)} events in one batch; at most {max_events} are accepted"
        )
    lookups = sum(e.count for e in events)
    if max_reported is not None and lookups > max_reported:
        raise InvalidRequestError(
            "events",
            f"the batch reports {lookups} lookups; one token may report at most {max_reported} "
            "a minute (audit.max_reported_per_minute), so it can never be taken: send them in "
            "smaller batches",
        )
    limit = (time.time() if now is None else now) + max_skew_s
    for i, event in enumerate(events):
        if not math.isfinite(event.time) or event.time > limit:
            raise InvalidRequestError(
                f"events[{i}].time",
                f"{event.time} is more than {max_skew_s:.0f} s in the future (check the client's clock)",
            )


def _charge(
    conn: sa.Connection, reporter: str, lookups: int, n_events: int, limit: int, now: float
) -> None:
    """Add a batch to ``reporter``'s minute; :class:`ReportLimitError` past ``limit``.

    In the batch's transaction, first: on PostgreSQL the upsert locks the reporter's row,
    so its concurrent batches (on any replica) are counted one after the other, and a
    refused batch's rollback takes its share back with its events.
    """
    start = math.floor(now / 60) * 60
    minute = datetime.fromtimestamp(start, timezone.utc)
    w = _windows.c
    conn.execute(sa.delete(_windows).where(w.reporter == reporter, w.minute < minute))
    dialect = postgresql if conn.dialect.name == "postgresql" else sqlite
    stmt = dialect.insert(_windows).values(
        reporter=reporter, minute=minute, lookups=lookups, events=n_events
    )
    total = conn.execute(
        stmt.on_conflict_do_update(
            index_elements=[w.reporter, w.minute],
            set_={
                "lookups": w.lookups + stmt.excluded.lookups,
                "events": w.events + stmt.excluded.events,
            },
        ).returning(w.lookups)
    ).scalar_one()
    if total > limit:
        raise ReportLimitError(
            reporter,
            limit=limit,
            reported=int(total) - lookups,
            batch=lookups,
            retry_after=max(1, math.ceil(start + 60 - now)),
        )


def ingest_events(
    engine: sa.Engine,
    events: Sequence[ClientEvent],
    *,
    reporter: str | None = None,
    max_per_minute: int | None = None,
    now: float | None = None,
    on_lookups: Callable[[list[dict[str, Any]]], None] | None = None,
) -> int:
    """Insert ``events`` in one transaction; returns how many rows were written.

    ``reporter`` is stored with each event; with ``max_per_minute`` too, the batch is
    charged to the reporter's minute of ``now`` (:class:`ReportLimitError` past it,
    nothing written). ``on_lookups`` gets the kernel lookups the batch started
    (:mod:`~kcache_server.auditing.lookups`) once it is committed.
    """
    if not events:
        return 0
    # Read before the write transaction: on SQLite a transaction that reads first
    # cannot upgrade to the write lock once another writer has committed meanwhile.
    with engine.connect() as conn:
        saved = _compile_seconds(conn, {e.digest for e in events if e.digest})
    with engine.begin() as conn:  # events and their counts together, as the writer does
        if reporter is not None and max_per_minute is not None:
            reported = sum(e.count for e in events)
            at = time.time() if now is None else now
            _charge(conn, reporter, reported, len(events), max_per_minute, at)
        kernel_lookups = write_events(conn, [_row(e, saved, reporter) for e in events])
    if kernel_lookups and on_lookups is not None:
        on_lookups(kernel_lookups)
    return len(events)
