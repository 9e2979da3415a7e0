"""``POST /v1/events``: batched audit events from clients (their memory and node-tier hits)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from kcache_server.auditing.events import EventBatch, IngestResult, check_batch, ingest_events
from kcache_server.auditing.install import auditing_of
from kcache_server.routes._deps import ERRORS, Reader, State

router = APIRouter(prefix="/v1/events", tags=["audit"])


@router.post("", response_model=IngestResult, responses=ERRORS)
async def post_events(body: EventBatch, request: Request, _: Reader, state: State) -> IngestResult:
    """Record a batch of client events in one transaction (all of it, or none on an error)."""
    auditing = auditing_of(request)
    check_batch(
        body.events,
        max_events=auditing.settings.max_events_per_batch,
        max_skew_s=auditing.settings.max_clock_skew_s,
    )
    accepted = await state.run(ingest_events, state.backends.db, body.events)
    metrics = auditing.metrics
    metrics.events_ingested.inc(accepted)
    for event in body.events:
        metrics.lookup(event.outcome, event.tier, latency_ms=event.latency_ms)
    return IngestResult(accepted=accepted)
