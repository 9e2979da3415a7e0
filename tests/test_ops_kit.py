"""The operator's kit in ``deploy/``: alert rules, their promtool tests, the Grafana dashboard.

- ``promtool check rules`` and ``promtool test rules`` pass on ``deploy/alerts`` (promtool
  comes from Debian's ``prometheus`` package; ``scripts/ensure-services`` unpacks it into
  ``.venv/prometheus``, and these tests skip, saying so, only where it could not);
- every alert the operations docs promise is there, and each has a promtool test;
- every metric the rules and the dashboard query is one the server exports (read from a
  real :class:`~kcache_server.metrics.ServerMetrics`), and every dashboard query parses
  (promtool checks it as a recording rule);
- Prometheus' configurations (compose's, Kubernetes') load the rules file compose mounts,
  and Grafana's provisioning finds the dashboard and the data source it names.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.support import ROOT

yaml = pytest.importorskip("yaml")

DEPLOY = ROOT / "deploy"
RULES = DEPLOY / "alerts" / "kcache.rules.yml"
RULE_TESTS = DEPLOY / "alerts" / "kcache.rules.test.yml"
DASHBOARD = DEPLOY / "grafana" / "kcache.json"
ALERTS = {
    "KcacheHitRateDrop",
    "KcacheCompileErrors",
    "KcacheServerErrors",
    "KcacheStoreNearCap",
    "KcacheVerificationDivergence",
    "KcacheReplicaNotReady",
    "KcacheReplicaDown",
}
METRIC = re.compile(r"\b(kcache_[a-z_]+|up)\b(?![:(])")


def _promtool() -> str:
    found = shutil.which("promtool") or str(ROOT / ".venv/prometheus/usr/bin/promtool")
    if not Path(found).is_file():
        pytest.skip(
            "promtool is not installed: scripts/ensure-services unpacks it from Debian's "
            "prometheus package into .venv/prometheus (it could not here)"
        )
    return found


def _promtool_run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [_promtool(), *args], cwd=cwd, capture_output=True, text=True, check=False, timeout=120
    )


def _rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def _dashboard_exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]


def _exported_metrics() -> set[str]:
    """Every sample name a server's /metrics can show (counters' _total, histograms' _bucket, ...)."""
    from kcache_server.metrics import ServerMetrics

    metrics = ServerMetrics(toolchain="nvrtc13.5-nvjitlink13.5-0000000000000000")
    # Labelled metrics show no sample before their first use: give each one.
    metrics.lookup("hit", "server")
    metrics.requests.labels(route="/", method="GET", status="200").inc()
    metrics.request_seconds.labels(route="/").observe(0.1)
    metrics.verified.labels(result="same_bytes").inc()
    metrics.audit_rows_dropped.labels(reason="refused").inc()
    metrics.recipe_record_failed("record")
    metrics.readiness(True, {"database": True})
    return {sample.name for family in metrics.registry.collect() for sample in family.samples}


def test_the_rules_pass_promtools_check_and_their_own_tests() -> None:
    checked = _promtool_run("check", "rules", RULES.name, cwd=RULES.parent)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = _promtool_run("test", "rules", RULE_TESTS.name, cwd=RULES.parent)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "SUCCESS" in tested.stdout


def test_every_promised_alert_is_there_and_tested_firing() -> None:
    alerts = {rule["alert"]: rule for rule in _rules() if "alert" in rule}
    assert set(alerts) == ALERTS
    for name, rule in alerts.items():
        assert rule["labels"]["severity"] in ("warning", "critical"), name
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], name
    tests = yaml.safe_load(RULE_TESTS.read_text())
    assert tests["rule_files"] == [RULES.name]
    fired = {
        case["alertname"]
        for test in tests["tests"]
        for case in test.get("alert_rule_test", [])
        if case["exp_alerts"]
    }
    quiet = {
        case["alertname"]
        for test in tests["tests"]
        for case in test.get("alert_rule_test", [])
        if not case["exp_alerts"]
    }
    assert fired == ALERTS  # each fires in a test, on the series that should raise it
    assert ALERTS - {"KcacheReplicaDown"} <= quiet  # and stays quiet on ones that should not


def test_rules_and_dashboard_query_only_metrics_the_server_exports() -> None:
    exported = _exported_metrics()
    assert {"kcache_build_info", "kcache_ready", "kcache_verification_divergences_total"} <= (
        exported
    )
    exprs = [rule["expr"] for rule in _rules()] + _dashboard_exprs()
    queried = {name for expr in exprs for name in METRIC.findall(expr)}
    assert queried - {"up"} <= exported, sorted(queried - exported - {"up"})
    assert len(queried) >= 15  # the dashboard covers lookups, compiles, store, HTTP, readiness


def test_every_dashboard_query_parses(tmp_path: Path) -> None:
    exprs = _dashboard_exprs()
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {
                        "record": f"dashboard:query{i}",
                        "expr": e.replace("$__rate_interval", "5m").replace("$__range", "6h"),
                    }
                    for i, e in enumerate(exprs)
                ],
            }
        ]
    }
    (tmp_path / "dashboard.rules.yml").write_text(yaml.safe_dump(rules))
    checked = _promtool_run("check", "rules", "dashboard.rules.yml", cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_the_dashboard_is_provisioned_with_its_data_source() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "kcache"
    (variable,) = dashboard["templating"]["list"]
    assert (variable["name"], variable["type"], variable["query"]) == (
        "datasource",
        "datasource",
        "prometheus",
    )
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        for where in (panel, *panel["targets"]):
            assert where["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel
    grafana = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]["grafana"]
    mounts = dict(v.rsplit(":", 1)[0].split(":", 1) for v in grafana["volumes"])
    assert mounts["./grafana/kcache.json"].startswith("/var/lib/grafana/dashboards/")
    provisioning = DEPLOY / "grafana" / "provisioning"
    assert mounts["./grafana/provisioning"] == "/etc/grafana/provisioning"
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "kcache.yml").read_text())[
        "providers"
    ]
    assert provider["options"]["path"] == str(Path(mounts["./grafana/kcache.json"]).parent)
    (source,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())[
        "datasources"
    ]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"


def test_prometheus_loads_the_rules_compose_mounts() -> None:
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]["prometheus"]
    mounts = dict(v.rsplit(":", 1)[0].split(":", 1) for v in compose["volumes"])
    in_container = mounts["./alerts/kcache.rules.yml"]
    assert yaml.safe_load((DEPLOY / "prometheus.yml").read_text())["rule_files"] == [in_container]
    manifest = [d for d in yaml.safe_load_all((DEPLOY / "kubernetes.yaml").read_text()) if d]
    (config_map,) = [d for d in manifest if d["metadata"]["name"] == "kcache-prometheus"]
    k8s = yaml.safe_load(config_map["data"]["prometheus.yml"])
    assert k8s["rule_files"] == [in_container]
    text = (DEPLOY / "kubernetes.yaml").read_text()
    assert "--from-file=deploy/alerts/kcache.rules.yml" in text
    # A replica that fails /readyz stays scraped, so KcacheReplicaNotReady can see it.
    (metrics_service,) = [d for d in manifest if d["metadata"]["name"] == "kcache-metrics"]
    assert metrics_service["spec"]["publishNotReadyAddresses"] is True
