"""``POST /v1/events``: batched audit events from clients (their memory and node-tier hits).

Posting needs the ``report`` scope: these figures are the client's word, and
``/v1/stats`` keeps them apart from what the server observed itself.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from kcache_server.auditing.events import EventBatch, IngestResult, check_batch, ingest_events
from kcache_server.errors import InvalidRequestError
from kcache_server.routes._deps import ERRORS, Reporter, State, body_doc, read_body
from kcache_server.schemas import load_model, parse_json

router = APIRouter(prefix="/v1/events", tags=["audit"])


def _parse(raw: bytes, max_events: int) -> EventBatch:
    data: Any = parse_json(raw)
    events = data.get("events") if isinstance(data, dict) else None
    if isinstance(events, list) and len(events) > max_events:  # before validating any of them
        raise InvalidRequestError(
            "events", f"{len(events)} events in one batch; at most {max_events} are accepted"
        )
    return load_model(EventBatch, data)


@router.post("", response_model=IngestResult, responses=ERRORS, openapi_extra=body_doc(EventBatch))
async def post_events(request: Request, _: Reporter, state: State) -> IngestResult:
    """Record a batch of client events in one transaction (all of it, or none on an error)."""
    settings = state.settings.audit
    body = await read_body(request, state, lambda raw: _parse(raw, settings.max_events_per_batch))
    check_batch(
        body.events, max_events=settings.max_events_per_batch, max_skew_s=settings.max_clock_skew_s
    )
    accepted = await state.run(ingest_events, state.backends.db, body.events)
    metrics = state.metrics
    metrics.events_ingested.inc(accepted)
    for event in body.events:
        metrics.lookup(event.outcome, event.tier, latency_ms=event.latency_ms, n=event.count)
    return IngestResult(accepted=accepted)
