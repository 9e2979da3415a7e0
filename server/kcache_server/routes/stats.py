"""``GET /v1/stats``: hit rate, outcomes by tier, groups, top missed kernels, rank divergence."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from kcache_server.auditing.query_times import (
    SPAN_PATTERN,
    UNIX_TIME_PATTERN,
    YEAR_PATTERN,
    parse_window,
)
from kcache_server.auditing.stats import compute_stats
from kcache_server.auditing.stats_models import GroupBy, Stats, StatsQuery
from kcache_server.routes._deps import ERRORS, Reader, State
from kcache_server.state import ServerState

router = APIRouter(prefix="/v1/stats", tags=["audit"])

_TIME_DOC = (
    "unix seconds (up to the year 9999), an RFC 3339 date or date-time from 1970 to 9998 "
    "(2024-05-01, 2024-05-01T10:00:00Z), or a span back from now: 15m, 6h, 7d; empty: no bound"
)
#: The forms :func:`~kcache_server.auditing.query_times.parse_time` reads, as the schema states them.
_TIME_FORMS = {
    "anyOf": [
        {"type": "string", "pattern": UNIX_TIME_PATTERN},
        {"type": "string", "pattern": SPAN_PATTERN},
        {"type": "string", "format": "date-time", "pattern": YEAR_PATTERN},
        {"type": "string", "format": "date", "pattern": YEAR_PATTERN},
        {"type": "string", "maxLength": 0},
    ]
}


def _stats(state: ServerState, query: StatsQuery) -> Stats:
    # Read-your-writes for this process: events still queued in the audit writer
    # would otherwise be missing from the answer for up to audit_flush_s. The flush
    # never raises: a row the database refuses is dropped and counted, not our 500.
    state.audit.flush()
    return compute_stats(state.backends.db, query, state.settings.max_store_bytes)


@router.get("", response_model=Stats, responses=ERRORS)
async def get_stats(
    _: Reader,
    state: State,
    since: Annotated[
        str | None,
        Query(
            max_length=64, description=f"window start: {_TIME_DOC}", json_schema_extra=_TIME_FORMS
        ),
    ] = None,
    until: Annotated[
        str | None,
        Query(
            max_length=64,
            description=f"window end (exclusive), not before since (a 422): {_TIME_DOC}",
            json_schema_extra=_TIME_FORMS,
        ),
    ] = None,
    job_id: Annotated[str | None, Query(max_length=256)] = None,
    client_id: Annotated[str | None, Query(max_length=256)] = None,
    kernel: Annotated[str | None, Query(max_length=1024)] = None,
    target: Annotated[str | None, Query(max_length=32)] = None,
    group_by: GroupBy | None = None,
    top: Annotated[int, Query(ge=1, le=100, description="how many missed kernels")] = 10,
    limit: Annotated[
        int, Query(ge=1, le=10_000, description="most groups and divergence rows")
    ] = 200,
    buckets: Annotated[int, Query(ge=1, le=1000, description="about how many series buckets")] = 60,
) -> Stats:
    """Aggregates over the audit events of a window, filtered and grouped as asked."""
    start, end = parse_window(since, until, ("query.since", "query.until"))
    query = StatsQuery(
        since=start,
        until=end,
        job_id=job_id,
        client_id=client_id,
        kernel=kernel,
        target=target,
        group_by=group_by,
        top=top,
        limit=limit,
        buckets=buckets,
    )
    result: Stats = await state.run(_stats, state, query)
    return result
