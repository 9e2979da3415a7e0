"""What ``GET /v1/stats`` is asked (:class:`StatsQuery`) and what it answers (:class:`Stats`).

The answer's models are its JSON and OpenAPI schema; :func:`outcome_fields` fills the
fields every counted group shares (:class:`OutcomeCounts`). How the figures are read
is :mod:`~kcache_server.auditing.stats`'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, Field

from kcache.outcomes import CLIENT_OUTCOMES, HIT_OUTCOMES, MISS_OUTCOMES

__all__ = [
    "GROUP_BY",
    "REPORTED_OUTCOMES",
    "SERVER_TIER",
    "Divergence",
    "GroupBy",
    "GroupStats",
    "MissedKernel",
    "OutcomeCounts",
    "RankStats",
    "ReportedBy",
    "SeriesPoint",
    "Stats",
    "StatsQuery",
    "StoreStats",
    "outcome_fields",
]

# OUTCOMES, SERVER_OUTCOMES (tier ``server``), HIT_OUTCOMES and MISS_OUTCOMES are
# kcache.outcomes', the one list.
#: Outcomes only clients report (``POST /v1/events``).
REPORTED_OUTCOMES = CLIENT_OUTCOMES
#: The tier of the server's own events; every other tier is client-reported.
SERVER_TIER = "server"

GroupBy = Literal["kernel", "target", "client", "job", "rank"]
#: ``group_by`` value -> column of ``audit_events``.
GROUP_BY: dict[str, str] = {
    "kernel": "kernel",
    "target": "target",
    "client": "client_id",
    "job": "job_id",
    "rank": "rank",
}


@dataclass(frozen=True)
class StatsQuery:
    """What ``/v1/stats`` is asked for."""

    since: datetime | None = None
    until: datetime | None = None
    job_id: str | None = None
    client_id: str | None = None
    kernel: str | None = None
    target: str | None = None
    group_by: GroupBy | None = None
    top: int = 10
    limit: int = 200
    buckets: int = 60


class OutcomeCounts(BaseModel):
    """Counts of one group (or bucket) by outcome, with its hit rate."""

    total: int = Field(default=0, description="lookups: server-observed plus client-reported")
    hits: int = Field(default=0, description="hit + local_hit")
    misses: int = 0
    reported: int = Field(default=0, description="client-reported lookups (local_hit)")
    hit_rate: float | None = Field(
        default=None,
        description="hit / server-observed lookups (no client-reported figure in it); null "
        "with none",
    )
    combined_hit_rate: float | None = Field(
        default=None, description="(hit + local_hit) / all lookups, client reports included"
    )
    outcomes: dict[str, int] = Field(default_factory=dict)


class RankStats(OutcomeCounts):
    """One rank of a job (``group_by=job``)."""

    rank: int | None


class GroupStats(OutcomeCounts):
    """One value of the ``group_by`` dimension."""

    key: str | int | None
    compile_seconds_saved: float = 0.0
    world_size: int | None = Field(
        default=None, description="group_by=job: the largest world size seen"
    )
    ranks: list[RankStats] | None = Field(default=None, description="group_by=job: per-rank counts")
    divergent: bool = Field(
        default=False, description="group_by=job: ranks resolved one recipe differently"
    )


class MissedKernel(BaseModel):
    """A kernel that missed often, and why it missed last."""

    kernel: str | None
    misses: int
    errors: int
    outcomes: dict[str, int]
    last_miss_at: float | None = Field(default=None, description="unix seconds")
    last_miss_outcome: str | None = None
    last_miss_reason: str | None = None
    last_miss_explanation: str | None = Field(
        default=None,
        description="what the last miss's recipe differs in from the nearest one seen before "
        '(nearest <key>: header a.cuh changed (..); flag -lineinfo added), or "never seen"',
    )
    target: str | None = None
    recipe_key: str | None = None


class Divergence(BaseModel):
    """Ranks of one job whose same recipe (base key and target) resolved to different digests."""

    job_id: str
    base_key: str
    target: str | None
    kernel: str | None
    digests: list[str]
    ranks: dict[str, str] = Field(description="rank -> the digest it got last")
    reported: bool = Field(
        default=False,
        description="false: the server's own events show the ranks disagreeing (digests and "
        "ranks from them alone); true: client reports name digests the server did not see, and "
        "this row holds their word too",
    )
    reported_by: list[str] = Field(
        default_factory=list,
        description="reported rows: the tokens (token:<name>, client:<address> on an open "
        "server) that reported the digests the server did not see",
    )


class ReportedBy(BaseModel):
    """The lookups one reporter (a token) reported in the window."""

    reporter: str | None = Field(
        description="token:<name>, or client:<address> on an open server; null: reported "
        "before reporters were recorded"
    )
    lookups: int
    share: float = Field(description="of all lookups in the window, server-observed included")
    compile_seconds_saved: float = Field(description="by its reported local hits")


class SeriesPoint(OutcomeCounts):
    """One chart bucket, starting at ``t`` (unix seconds)."""

    t: float


class StoreStats(BaseModel):
    """The store now (size, cap, pins) and what eviction did in the window."""

    bytes_used: int = Field(description="bytes of stored artifacts, pinned ones included")
    bytes_cap: int | None = Field(description="max_store_bytes; null when unbounded")
    artifacts: int
    pinned_artifacts: int
    pinned_bytes: int
    evictions: int = Field(description="artifacts evicted or removed in the window")
    bytes_freed: int = Field(description="bytes those evictions freed")


class Stats(BaseModel):
    """Body of ``GET /v1/stats``."""

    since: float | None
    until: float | None
    lookups: int = Field(description="all lookups: server-observed plus client-reported")
    hits: int = Field(description="hit + local_hit")
    totals: dict[str, int] = Field(description="server-observed: outcome -> count")
    reported: dict[str, int] = Field(
        description="client-reported (POST /v1/events): outcome -> count"
    )
    reported_by: list[ReportedBy] = Field(
        default_factory=list,
        description="who reported the client-reported lookups, most first (at most limit)",
    )
    by_tier: dict[str, dict[str, int]] = Field(description="tier -> outcome -> count")
    hit_rate: float | None = Field(
        description="the headline: hit / server-observed lookups (no client-reported figure in "
        "it, so no token moves it); null with none"
    )
    server_hit_rate: float | None = Field(description="the same as hit_rate (kept for old readers)")
    combined_hit_rate: float | None = Field(
        default=None,
        description="(hit + local_hit) / all lookups, client reports included (see reported_by)",
    )
    compile_seconds_saved: float = Field(description="by server-observed hits")
    reported_compile_seconds_saved: float = Field(description="by client-reported local hits")
    group_by: str | None
    groups: list[GroupStats]
    top_missed: list[MissedKernel]
    divergence: list[Divergence]
    bucket_seconds: int
    series: list[SeriesPoint]
    store: StoreStats | None = Field(default=None, description="the store's size and evictions")


def outcome_fields(outcomes: Mapping[str, int]) -> dict[str, Any]:
    """:class:`OutcomeCounts` fields: the hit rate over what the server observed, the rest beside it."""
    total = sum(outcomes.values())
    hits = sum(v for k, v in outcomes.items() if k in HIT_OUTCOMES)
    reported = sum(v for k, v in outcomes.items() if k in REPORTED_OUTCOMES)
    observed_hits = sum(
        v for k, v in outcomes.items() if k in HIT_OUTCOMES and k not in REPORTED_OUTCOMES
    )
    observed = total - reported
    return {
        "total": total,
        "hits": hits,
        "misses": sum(v for k, v in outcomes.items() if k in MISS_OUTCOMES),
        "reported": reported,
        "hit_rate": observed_hits / observed if observed else None,
        "combined_hit_rate": hits / total if total else None,
        "outcomes": dict(outcomes),
    }
