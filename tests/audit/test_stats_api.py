"""``GET /v1/stats`` after a scripted workload: every count equals what the workload did."""

from __future__ import annotations

import time

import pytest

from kcache.outcomes import CLIENT_OUTCOMES
from tests.audit.workload import Workload


def _stats(w: Workload, **params: str) -> dict:
    with w.server.client() as http:
        r = http.get("/v1/stats", params=params)
    assert r.status_code == 200, r.text
    return r.json()


def test_totals_and_tiers_equal_the_workload(workload: Workload) -> None:
    stats = _stats(workload)
    # Server-observed outcomes in totals, client-reported ones (local hits) apart.
    observed = {
        o: workload.totals.get(o, 0) for o in ("hit", "compiled", "waited", "miss", "error")
    }
    assert stats["totals"] == observed
    reported = {o: 0 for o in CLIENT_OUTCOMES} | {"local_hit": workload.totals["local_hit"]}
    assert stats["reported"] == reported  # every client outcome, those not reported at 0
    # 2 hits, 3 local hits, 3 compiles, 1 miss, 2 errors: the script says so independently.
    assert observed == {"hit": 2, "compiled": 3, "waited": 0, "miss": 1, "error": 2}
    assert {o: n for o, n in stats["reported"].items() if n} == {"local_hit": 3}
    assert {t: {o: n for o, n in c.items() if n} for t, c in stats["by_tier"].items()} == {
        t: dict(c) for t, c in workload.by_tier.items()
    }
    assert stats["lookups"] == 11  # requests, repeats included
    # The headline counts kernel lookups (a process's first lookup of a recipe; the
    # script's resolves name no pid, its reports do: other processes). job-a compiled vadd,
    # so its ranks' later hits of it needed that compile; nothing else was found:
    #   job-a r0: vadd compiled, broken failed; r1: vadd (built by the job), absent (not
    #   cached), broken failed; pids 1234 and 1235: vadd from the node tier (built by the
    #   job; 1235's memory hit is a repeat); job-b: scaled twice (first build, headers).
    assert (stats["kernel_lookups"], stats["kernel_hits"]) == (9, 0)
    assert stats["hit_rate"] == 0.0 == stats["server_hit_rate"]
    reasons = {r["reason"]: r["kernel_lookups"] for r in stats["miss_reasons"]}
    assert reasons == {
        "built_by_job": 3,
        "error:compile_error": 2,
        "first_build": 2,
        "headers_changed": 1,
        "not_cached": 1,
    }
    # Compiles avoided: vadd by r1's resolve and by the two reporting processes (each
    # got it without compiling), once each; r0's second resolve and the memory hit: repeats.
    vadd = workload.compile_seconds[next(iter(workload.compile_seconds))]
    assert stats["compiles_avoided"] == 3
    assert stats["compile_seconds_saved"] == pytest.approx(3 * vadd)
    assert stats["reported_compile_seconds_saved"] == pytest.approx(2 * vadd)
    # The workload's server is open: its reports are attributed to the caller's address.
    assert stats["reported_by"] == [
        {
            "reporter": "client:127.0.0.1",
            "lookups": 3,
            "share": pytest.approx(3 / 11),
            "compile_seconds_saved": pytest.approx(2 * vadd),
        }
    ]
    assert vadd > 0


def test_groups_by_job_carry_their_ranks(workload: Workload) -> None:
    stats = _stats(workload, group_by="job")
    groups = {g["key"]: g for g in stats["groups"]}
    assert set(groups) == {"job-a", "job-b"}
    for job, counts in workload.by_job.items():
        assert groups[job]["outcomes"] == dict(counts)
        assert groups[job]["total"] == sum(counts.values())
        ranks = {r["rank"]: r["outcomes"] for r in groups[job]["ranks"]}
        assert ranks == {rank: dict(c) for (j, rank), c in workload.by_rank.items() if j == job}
        assert groups[job]["world_size"] == 2
    assert groups["job-b"]["divergent"] is True
    assert groups["job-a"]["divergent"] is False


def test_filters_and_other_groupings(workload: Workload) -> None:
    only_b = _stats(workload, job_id="job-b")
    assert only_b["totals"]["compiled"] == 2 and only_b["lookups"] == 2
    by_rank = {g["key"]: g["total"] for g in _stats(workload, group_by="rank")["groups"]}
    assert by_rank == {
        rank: sum(sum(c.values()) for (_, r), c in workload.by_rank.items() if r == rank)
        for rank in (0, 1)
    }
    by_client = {g["key"] for g in _stats(workload, group_by="client")["groups"]}
    assert by_client == {"job-a-r0", "job-a-r1", "job-b-r0", "job-b-r1"}
    # A window that ended before the workload started holds nothing.
    empty = _stats(workload, until="1000")
    assert empty["lookups"] == 0 and empty["hit_rate"] is None and empty["divergence"] == []


def test_divergence_names_the_job_the_recipe_and_each_ranks_digest(workload: Workload) -> None:
    (row,) = _stats(workload)["divergence"]
    assert row["job_id"] == "job-b"
    assert row["target"] == "sm_80"
    assert row["kernel"] == "scaled"
    assert row["ranks"] == workload.divergent
    assert row["digests"] == sorted(workload.divergent.values())


def test_top_missed_gives_the_last_miss_reason(workload: Workload) -> None:
    missed = {m["kernel"]: m for m in _stats(workload)["top_missed"]}
    assert missed["broken"]["misses"] == 2 and missed["broken"]["errors"] == 2
    assert missed["broken"]["last_miss_reason"] == "compile error"
    # vadd: a compile, a compile=false miss, and three lookups of what job-a compiled
    # (missed kernel lookups); the compile=false miss was the last miss.
    assert missed["vadd"]["misses"] == 5
    assert missed["vadd"]["reasons"] == {"first_build": 1, "built_by_job": 3, "not_cached": 1}
    assert missed["vadd"]["last_miss_reason"] == "not cached, and the caller did not ask to compile"
    # scaled was compiled twice; the second time only a header differed.
    assert missed["scaled"]["last_miss_reason"] == "header contents changed since an earlier build"


def test_series_adds_up_to_the_totals(workload: Workload) -> None:
    until = time.time() + 1
    stats = _stats(workload, since=str(until - 3600), until=str(until))
    assert stats["bucket_seconds"] == 60
    assert 60 <= len(stats["series"]) <= 61
    assert sum(p["total"] for p in stats["series"]) == stats["lookups"] == 11
    assert sum(p["kernel_lookups"] for p in stats["series"]) == stats["kernel_lookups"] == 9


def test_bad_parameters_are_refused_precisely(workload: Workload) -> None:
    with workload.server.client() as http:
        r = http.get("/v1/stats", params={"since": "yesterday"})
        assert r.status_code == 422
        assert r.json()["error"] == "invalid_request" and r.json()["field"] == "query.since"
        r = http.get("/v1/stats", params={"group_by": "color"})
        assert r.status_code == 422 and r.json()["field"] == "query.group_by"
        # A window that ends before it starts held nothing: it read as an empty window.
        r = http.get("/v1/stats", params={"since": "1h", "until": "2h"})
        assert r.status_code == 422 and r.json()["field"] == "query.until"
        assert "is before query.since" in r.json()["detail"]
        assert http.get("/v1/stats", params={"since": "2h", "until": "1h"}).status_code == 200
