"""``POST /v1/events``: batched audit events from clients (their memory and node-tier hits).

Posting needs the ``report`` scope: these figures are the client's word, and
``/v1/stats`` keeps them apart from what the server observed itself. Each event is
stored with the token that posted it (``token:<name>``; on an open server the caller's
``client:<address>``), and a token reports at most ``audit.max_reported_per_minute``
lookups per minute of arrival (429 past it; see :mod:`kcache_server.auditing.events`).

Event times ahead of the server's clock: a time up to ``audit.max_clock_skew_s``
past the server's clock when the batch arrives is recorded as sent (clocks differ a
little); a later one, up to the schema's ``maximum``, is recorded as the batch's
arrival time (:func:`clamp_event_times`). A lookup cannot have happened after its
report reached the server, so the arrival is the best estimate of when it did, and
every time the schema allows is accepted: what the published schema allows is what
the server takes. The request schema states both (the time's description, and
``x-max-clock-skew-s``, filled in with this server's setting).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from fastapi import APIRouter, Request

from kcache_server.auditing.events import (
    MAX_EVENT_TIME,
    ClientEvent,
    EventBatch,
    IngestResult,
    check_batch,
    ingest_events,
)
from kcache_server.auth import Principal
from kcache_server.errors import InvalidRequestError
from kcache_server.fairness import caller_identity
from kcache_server.routes._deps import ERRORS, Reporter, State, body_doc, read_body
from kcache_server.schemas import ErrorBody, load_model, parse_json
from kcache_server.state import ServerState

__all__ = ["TIME_DESCRIPTION", "clamp_event_times", "reporter_of", "router"]

router = APIRouter(prefix="/v1/events", tags=["audit"])

log = logging.getLogger(__name__)

#: The published description of an event's ``time`` (``{setting:...}`` is filled in with
#: this server's value by :mod:`kcache_server.serving.openapi`).
TIME_DESCRIPTION = (
    "when, in unix seconds. A time up to x-max-clock-skew-s "
    "({setting:audit.max_clock_skew_s} s on this server) past the server's clock when the "
    "batch arrives is recorded as sent; a later one (up to maximum) is recorded as the time "
    "the batch arrived (check the client's clock): every time the schema allows is accepted"
)


def clamp_event_times(events: Sequence[ClientEvent], *, max_skew_s: float, now: float) -> int:
    """Record times more than ``max_skew_s`` past ``now`` as ``now``; how many were moved.

    A time past the schema's maximum (:data:`~kcache_server.auditing.events.MAX_EVENT_TIME`)
    is refused, naming the event, as the schema refuses it.
    """
    latest = now + max_skew_s
    moved = 0
    for i, event in enumerate(events):
        if event.time > MAX_EVENT_TIME:
            raise InvalidRequestError(
                f"events[{i}].time",
                f"{event.time} is past the latest time accepted ({MAX_EVENT_TIME:.0f}, "
                "the schema's maximum)",
            )
        if event.time > latest:
            event.time = now
            moved += 1
    return moved


def _parse(raw: bytes, max_events: int) -> EventBatch:
    data: Any = parse_json(raw)
    events = data.get("events") if isinstance(data, dict) else None
    if isinstance(events, list) and len(events) > max_events:  # before validating any of them
        raise InvalidRequestError(
            "events", f"{len(events)} events in one batch; at most {max_events} are accepted"
        )
    return load_model(EventBatch, data)


def _request_doc() -> dict[str, Any]:
    """The request body's schema, with the time's description saying what this route does."""
    doc = body_doc(EventBatch)
    schema = doc["requestBody"]["content"]["application/json"]["schema"]
    schema["properties"]["events"]["items"]["properties"]["time"]["description"] = TIME_DESCRIPTION
    return doc


#: A token past its reported lookups of the minute (``ReportLimitError``), beside the shared ones.
_RESPONSES: dict[int | str, dict[str, Any]] = {**ERRORS, 429: {"model": ErrorBody}}


def _ingest(state: ServerState, events: Sequence[ClientEvent], **options: Any) -> int:
    """:func:`ingest_events`, after this process's own queued audit rows are written.

    A client reports its node-tier hits after the server answered the compile that filled
    the tier; the compile's row must be written first, or its job's other ranks' hits would
    be decided before it (:mod:`kcache_server.auditing.lookups`). The flush never raises.
    """
    state.audit.flush()
    return ingest_events(state.backends.db, events, **options)


def reporter_of(principal: Principal, request: Request) -> str:
    """Who a batch is attributed to: ``token:<name>``, or ``client:<address>`` on an open server."""
    return caller_identity(principal.name, request.client.host if request.client else None)


@router.post("", response_model=IngestResult, responses=_RESPONSES, openapi_extra=_request_doc())
async def post_events(request: Request, principal: Reporter, state: State) -> IngestResult:
    """Record a batch of client events in one transaction (all of it, or none on an error)."""
    settings = state.settings.audit
    body = await read_body(request, state, lambda raw: _parse(raw, settings.max_events_per_batch))
    now = time.time()
    moved = clamp_event_times(body.events, max_skew_s=settings.max_clock_skew_s, now=now)
    if moved:
        log.warning(
            "%d of %d client events were dated more than %.0f s past this server's clock; "
            "recorded at their arrival (a client's clock is ahead)",
            moved,
            len(body.events),
            settings.max_clock_skew_s,
        )
    check_batch(
        body.events,
        max_events=settings.max_events_per_batch,
        max_skew_s=settings.max_clock_skew_s,
        now=now,
        max_reported=settings.max_reported_per_minute,
    )
    accepted = await state.run(
        _ingest,
        state,
        body.events,
        reporter=reporter_of(principal, request),
        max_per_minute=settings.max_reported_per_minute,
        now=now,
        on_lookups=state.metrics.kernel_lookups,
    )
    metrics = state.metrics
    metrics.events_ingested.inc(accepted)
    for event in body.events:
        metrics.lookup(event.outcome, event.tier, latency_ms=event.latency_ms, n=event.count)
    return IngestResult(accepted=accepted)
