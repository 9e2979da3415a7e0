"""What ``GET /v1/stats`` is asked (:class:`StatsQuery`) and what it answers (:class:`Stats`).

The answer's models are its JSON and OpenAPI schema. Two kinds of figure, named apart:

- **kernel lookups** (:mod:`~kcache_server.auditing.lookups`): one per process and
  recipe, a hit when it needed no compile anywhere. The hit rate, the hits and misses,
  the compiles avoided and the compile time saved are these, in the answer and in every
  group, rank and series bucket (:class:`~kcache_server.auditing.lookup_stats.Figures`
  fills them), with the hits the server observed and those clients reported as parts;
- **requests**: every lookup the server answered or a client reported, repeats
  included (``lookups``, ``totals``, ``reported``, ``by_tier``, a group's ``total`` and
  ``outcomes``, :func:`outcome_fields`): the load, not the hit rate.

How the figures are read is :mod:`~kcache_server.auditing.stats`'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, Field

from kcache.outcomes import CLIENT_OUTCOMES

__all__ = [
    "GROUP_BY",
    "REPORTED_OUTCOMES",
    "SERVER_TIER",
    "Divergence",
    "ForeignLibrary",
    "GroupBy",
    "GroupStats",
    "MissReason",
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
    """One group (or rank, or bucket): its kernel lookups and hit rate, and its requests."""

    kernel_lookups: int = Field(
        default=0, description="kernel lookups: each process's first lookup of each recipe"
    )
    kernel_hits: int = Field(
        default=0, description="kernel lookups that needed no compile anywhere"
    )
    kernel_misses: int = Field(default=0, description="kernel lookups that needed a compile")
    hit_rate: float | None = Field(
        default=None, description="kernel_hits / kernel_lookups; null with none"
    )
    observed_hits: int = Field(default=0, description="of kernel_hits: answered by the server")
    reported_hits: int = Field(
        default=0, description="of kernel_hits: reported by clients (node-tier hits)"
    )
    compiles_avoided: int = Field(
        default=0,
        description="kernel lookups whose process got the kernel without compiling or waiting "
        "(at most one per process and kernel)",
    )
    compile_seconds_saved: float = Field(
        default=0.0, description="the compile time of those kernels: what the cache saved"
    )
    total: int = Field(
        default=0,
        description="requests: every lookup, server-observed plus client-reported, repeats "
        "included",
    )
    reported: int = Field(default=0, description="of total: client-reported requests")
    outcomes: dict[str, int] = Field(default_factory=dict, description="requests by outcome")


class RankStats(OutcomeCounts):
    """One rank of a job (``group_by=job``)."""

    rank: int | None


class GroupStats(OutcomeCounts):
    """One value of the ``group_by`` dimension."""

    key: str | int | None
    world_size: int | None = Field(
        default=None, description="group_by=job: the largest world size seen"
    )
    ranks: list[RankStats] | None = Field(default=None, description="group_by=job: per-rank counts")
    divergent: bool = Field(
        default=False, description="group_by=job: ranks resolved one recipe differently"
    )


class MissReason(BaseModel):
    """Missed kernel lookups of one reason."""

    reason: str = Field(
        description="first_build, evicted, headers_changed, joined_compile, built_by_job, "
        "not_cached, error:<code>, bypass:<why>, miss:<code>"
    )
    text: str = Field(description="the reason in words")
    kernel_lookups: int


class MissedKernel(BaseModel):
    """A kernel that missed often, and why it missed last."""

    kernel: str | None
    misses: int = Field(description="its missed kernel lookups")
    errors: int = Field(description="of misses: failed (outcome error)")
    outcomes: dict[str, int] = Field(description="its missed kernel lookups by first outcome")
    reasons: dict[str, int] = Field(
        default_factory=dict, description="its missed kernel lookups by reason (MissReason codes)"
    )
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
    """The requests one reporter (a token) reported in the window."""

    reporter: str | None = Field(
        description="token:<name>, or client:<address> on an open server; null: reported "
        "before reporters were recorded"
    )
    lookups: int = Field(description="requests it reported, repeats included")
    share: float = Field(description="of all requests in the window, server-observed included")
    compile_seconds_saved: float = Field(
        description="compile time its reported kernel lookups avoided"
    )


class ForeignLibrary(BaseModel):
    """One library's foreign lookups (``GET /v1/foreign/{library}/{key}``) in the window."""

    library: str = Field(description="the library whose cache hook looked up: cupy, triton, ...")
    lookups: int = Field(
        description="its foreign lookups (each a kernel lookup of its own: none names a process)"
    )
    hits: int = Field(description="of lookups: answered with a binding (outcome hit)")
    misses: int = Field(description="of lookups: no binding under the name (the library compiled)")
    hit_rate: float | None = Field(description="hits / lookups; null with none")


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
    hit_rate: float | None = Field(
        description="the headline: kernel_hits / kernel_lookups (the share of kernel lookups that "
        "needed no compile anywhere); null with none"
    )
    kernel_lookups: int = Field(
        description="kernel lookups: each process's first lookup of each recipe (a lookup that "
        "names no process counts each time)"
    )
    kernel_hits: int = Field(description="kernel lookups that needed no compile anywhere")
    kernel_misses: int = Field(description="kernel lookups that needed a compile (miss_reasons)")
    observed_hits: int = Field(description="of kernel_hits: answered by the server itself")
    reported_hits: int = Field(
        description="of kernel_hits: reported by clients (node-tier hits the server never sees; "
        "see reported_by)"
    )
    server_hit_rate: float | None = Field(
        description="the part the server observed: its own answers' hits / the kernel lookups "
        "whose first lookup it answered; null with none"
    )
    compiles_avoided: int = Field(
        description="kernel lookups whose process got the kernel without compiling or waiting "
        "for a compile (at most one per process and kernel)"
    )
    compile_seconds_saved: float = Field(description="the compile time of those kernels")
    reported_compile_seconds_saved: float = Field(
        description="of compile_seconds_saved: by kernel lookups clients reported"
    )
    miss_reasons: list[MissReason] = Field(
        default_factory=list, description="the missed kernel lookups by reason, most first"
    )
    lookups: int = Field(
        description="requests: every lookup, server-observed plus client-reported, repeats "
        "included (a process reading its warmup back counts each time)"
    )
    totals: dict[str, int] = Field(description="server-observed requests: outcome -> count")
    reported: dict[str, int] = Field(
        description="client-reported requests (POST /v1/events): outcome -> count"
    )
    reported_by: list[ReportedBy] = Field(
        default_factory=list,
        description="who reported the client-reported requests, most first (at most limit)",
    )
    by_tier: dict[str, dict[str, int]] = Field(description="requests: tier -> outcome -> count")
    group_by: str | None
    groups: list[GroupStats]
    top_missed: list[MissedKernel]
    divergence: list[Divergence]
    bucket_seconds: int
    series: list[SeriesPoint]
    store: StoreStats | None = Field(default=None, description="the store's size and evictions")
    foreign_by_library: list[ForeignLibrary] = Field(
        default_factory=list,
        description="foreign artifacts (GET /v1/foreign/{library}/{key}, docs/design.md "
        "section 10) by library: each library's lookups, hits, misses and hit rate, most "
        "looked up first, under the same window and filters; empty with none. They are "
        "kernel lookups named foreign:<library>:<key>, so the headline counts them too",
    )


def outcome_fields(outcomes: Mapping[str, int]) -> dict[str, Any]:
    """:class:`OutcomeCounts`' request fields (every lookup by outcome, repeats included).

    Its kernel-lookup fields (the hit rate) come from
    :meth:`~kcache_server.auditing.lookup_stats.Figures.fields`.
    """
    return {
        "total": sum(outcomes.values()),
        "reported": sum(v for k, v in outcomes.items() if k in REPORTED_OUTCOMES),
        "outcomes": dict(outcomes),
    }
