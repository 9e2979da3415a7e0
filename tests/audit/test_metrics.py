"""``GET /metrics``: Prometheus text that the official parser reads, counting the workload."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tests.audit.workload import Workload


def _families(w: Workload) -> dict:
    with w.server.client() as http:
        r = http.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    return {f.name: f for f in text_string_to_metric_families(r.text)}


def _samples(family, suffix: str = "_total") -> dict:
    return {
        tuple(sorted(s.labels.items())): s.value for s in family.samples if s.name.endswith(suffix)
    }


def test_lookup_counters_match_the_workload(workload: Workload) -> None:
    families = _families(workload)
    lookups = _samples(families["kcache_lookups"])
    expected = {
        (("outcome", outcome), ("tier", tier)): float(n)
        for tier, counts in workload.by_tier.items()
        for outcome, n in counts.items()
    }
    assert lookups == expected


def test_request_counters_are_by_route_template_and_status(workload: Workload) -> None:
    requests = _samples(_families(workload)["kcache_http_requests"])
    resolve = {
        dict(labels)["status"]: value
        for labels, value in requests.items()
        if dict(labels)["route"] == "/v1/resolve" and dict(labels)["method"] == "POST"
    }
    assert resolve == {status: float(n) for (route, status), n in workload.requests.items()}
    assert requests[(("method", "POST"), ("route", "/v1/events"), ("status", "200"))] == 1.0


def test_compiles_and_the_store_are_measured(workload: Workload) -> None:
    families = _families(workload)
    compiles = {s.name: s.value for s in families["kcache_compile_duration_seconds"].samples}
    assert compiles["kcache_compile_duration_seconds_count"] == workload.totals["compiled"] == 3
    assert compiles["kcache_compile_duration_seconds_sum"] > 0
    store = families["kcache_store_artifacts"].samples[0].value
    assert store == len(workload.compile_seconds) == 3
    assert families["kcache_store_bytes"].samples[0].value > 1000  # three real cubins
    assert families["kcache_compiles_in_flight"].samples[0].value == 0
    assert families["kcache_compile_queue_depth"].samples[0].value == 0
    assert _samples(families["kcache_audit_events_ingested"]) == {(): 3.0}


def test_unmatched_paths_share_one_label(workload: Workload) -> None:
    with workload.server.client() as http:
        for i in range(3):
            assert http.get(f"/no/such/path/{i}").status_code == 404
    requests = _samples(_families(workload)["kcache_http_requests"])
    assert requests[(("method", "GET"), ("route", "(unmatched)"), ("status", "404"))] == 3.0
    assert not any("/no/such" in dict(labels)["route"] for labels in requests)
