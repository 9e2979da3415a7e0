"""One hit rate, one time saved, everywhere (issue 45, item 1): five readers, the same figures.

A scripted workload (:mod:`tests.audit.kernel_workload`: a cold job, a warm job with a late
rank, a miss of each kind) runs once against a real server (uvicorn, SQLite, NVRTC) while a
real Prometheus scrapes it. The figures it must give are written below by hand, from what
the workload did; ``kcache stats``, ``GET /v1/stats``, the dashboard in Chromium, ``/metrics``
and the Grafana panels' queries (deploy/grafana/kcache.json, evaluated by that Prometheus)
must each give them for the workload's window.

The definitions (:mod:`kcache_server.auditing.lookups`): a kernel lookup is a process's
first lookup of a recipe; a hit when it needed no compile anywhere (no rank of its job
compiled it); a compile avoided when its process got the kernel without compiling or
waiting, at most once per process and kernel. The facts of the issue each have a test
here: a process reading back its own warmup is credited nothing; a job that compiled
everything from cold has a hit rate of 0, not 93.75 %; a job whose hits were all reported
by clients has a hit rate, not "-"; the dashboard's headline and rank chips say the one
definition.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.audit.conftest import chromium_installed
from tests.audit.kernel_workload import KernelWorkload, run_kernel_workload
from tests.support import KCACHE, ROOT, ServerThread, free_port, wait_until

PROMETHEUS = shutil.which("prometheus") or str(ROOT / ".venv/prometheus/usr/bin/prometheus")
GRAFANA = ROOT / "deploy" / "grafana" / "kcache.json"

# ------------------------------------------------------------------ the figures, by hand
#: Every kernel lookup of the workload (process: job, rank, pid):
#:   cold   r0 101: K1, K2 compiled (first build)          -> 2 misses
#:          r1 102: K1, K2 from the node tier rank 0 filled -> 2 misses (built by the job),
#:                  2 compiles avoided
#:   warm   r0 201: K1, K2 from the server                  -> 2 hits (observed)
#:          r1 202: K1, K2 from the node tier               -> 2 hits (reported)
#:          r2 203: late for K1, then K1 from the server    -> 1 hit (observed)
#:   misc   r0 301: K3 first build, H2 first build, an unknown recipe (not cached), a broken
#:                  one (compile error), a library compile (bypass)       -> 5 misses
#:          r0 302: K3 again after its eviction (evicted)                 -> 1 miss
#:          r0 303: S first build; r0 304: S joined 303's compile         -> 2 misses
#:   headers r0 401: H3, H2's sibling (headers changed)                   -> 1 miss
#: Memory hits (50 on cold r0, 100 on cold r1, 1000 on warm r1), cold r0's second resolve
#: of K1 and warm r2's late note are repeats: requests, no kernel lookup, no saving.
LOOKUPS, HITS, OBSERVED_HITS, REPORTED_HITS = 18, 5, 3, 2
#: Kernel lookups whose first lookup the server answered (the rest: reported by clients).
OBSERVED_LOOKUPS = 13
AVOIDED = 7  # cold r1 (2) + warm (5)
MISS_REASONS = {
    "first_build": 5,  # K1, K2, K3, H2, S
    "built_by_job": 2,
    "evicted": 1,
    "headers_changed": 1,
    "joined_compile": 1,
    "not_cached": 1,
    "error:compile_error": 1,
    "bypass:backend=nvcc": 1,
}
#: Every request, repeats included: cold 3 resolves + 158 reported, warm 3 resolves + 1009
#: reported (the late note among them), misc 7 resolves + 1 reported, headers 1.
REQUESTS = 1182
#: job -> (kernel lookups, hits, requests, {rank: (kernel lookups, hits)}, reasons)
JOBS: dict[str, tuple[int, int, int, dict[int, tuple[int, int]], dict[str, int]]] = {
    "cold": (4, 0, 161, {0: (2, 0), 1: (2, 0)}, {"first_build": 2, "built_by_job": 2}),
    "warm": (5, 5, 1012, {0: (2, 2), 1: (2, 2), 2: (1, 1)}, {}),
    "misc": (
        8,
        0,
        8,
        {0: (8, 0)},
        {
            "first_build": 3,
            "evicted": 1,
            "joined_compile": 1,
            "not_cached": 1,
            "error:compile_error": 1,
            "bypass:backend=nvcc": 1,
        },
    ),
    "headers": (1, 0, 1, {0: (1, 0)}, {"headers_changed": 1}),
}
#: kernel -> (kernel lookups, hits)
KERNELS = {
    "k_one": (5, 3),
    "k_two": (4, 2),
    "k_three": (2, 0),
    "scaled": (2, 0),
    "slow": (2, 0),
    "broken": (1, 0),
    "k_absent": (1, 0),
    "k_nvcc": (1, 0),
}


def saved(w: KernelWorkload) -> float:
    """Compile time avoided: K1 by cold r1 and warm r0, r1, r2; K2 by cold r1 and warm r0, r1."""
    return 4 * w.cs("K1") + 3 * w.cs("K2")


def reported_saved(w: KernelWorkload) -> float:
    """Of it, by the node-tier hits clients reported: cold r1 and warm r1."""
    return 2 * w.cs("K1") + 2 * w.cs("K2")


def job_saved(w: KernelWorkload, job: str) -> float:
    return {
        "cold": w.cs("K1") + w.cs("K2"),
        "warm": 3 * w.cs("K1") + 2 * w.cs("K2"),
    }.get(job, 0.0)


# ------------------------------------------------------------------ the server, Prometheus
class Prometheus:
    """A real Prometheus scraping one server every second, and its query API."""

    def __init__(self, root: Path, target: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = root / "prometheus.yml"
        config.write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            "scrape_configs:\n"
            "  - job_name: kcache\n"
            f"    static_configs: [{{targets: ['{target}']}}]\n"
        )
        self.log = open(root / "prometheus.log", "wb")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={config}",
                f"--storage.tsdb.path={root / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        params = {"query": expr} | ({"time": f"{at:.3f}"} if at is not None else {})
        body = httpx.get(f"{self.url}/api/v1/query", params=params, timeout=30).json()
        assert body["status"] == "success", body
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def value(self, expr: str, at: float | None = None) -> float | None:
        result = self.query(expr, at)
        return float(result[0]["value"][1]) if result else None

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self.log.close()


@dataclass
class Run:
    workload: KernelWorkload
    prometheus: Prometheus
    #: A Prometheus sample time after the workload: the end of the window its queries read.
    scraped_at: float

    @property
    def server(self) -> ServerThread:
        return self.workload.server

    def window(self) -> dict[str, str]:
        return {"since": str(self.workload.since), "until": str(self.workload.until)}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    """The server, Prometheus scraping it from before the first lookup, and the workload."""
    from kcache_server import Settings

    if not Path(PROMETHEUS).is_file():
        pytest.skip("prometheus is not installed (scripts/ensure-services unpacks it)")
    root = tmp_path_factory.mktemp("one-hit-rate")
    server = ServerThread(
        Settings(data_dir=root / "data", compile_workers=1, audit={"flush_s": 0.05})
    )
    prometheus = Prometheus(root, f"127.0.0.1:{server.port}")
    try:
        # Scraped before the workload: every counter's first sample is its 0.
        wait_until(
            lambda: _answers(prometheus) and prometheus.value('up{job="kcache"}') == 1,
            "Prometheus to scrape the server",
        )
        workload = run_kernel_workload(server)
        wait_until(
            lambda: prometheus.value("sum(kcache_kernel_lookups_total)") == LOOKUPS,
            "Prometheus to scrape the workload's counters",
        )
        stamp = prometheus.value("max(timestamp(kcache_kernel_lookups_total))")
        assert stamp is not None
        yield Run(workload, prometheus, stamp)
    finally:
        prometheus.stop()
        server.stop()


def _answers(prometheus: Prometheus) -> bool:
    try:
        return httpx.get(f"{prometheus.url}/-/ready", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def _stats(run: Run, **params: str) -> dict[str, Any]:
    with run.server.client() as http:
        r = http.get("/v1/stats", params={**run.window(), **params})
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


# ------------------------------------------------------------------ /v1/stats
def test_v1_stats_gives_the_figures(run: Run) -> None:
    w, s = run.workload, _stats(run)
    assert (s["kernel_lookups"], s["kernel_hits"], s["kernel_misses"]) == (
        LOOKUPS,
        HITS,
        LOOKUPS - HITS,
    )
    assert s["hit_rate"] == pytest.approx(HITS / LOOKUPS)
    assert (s["observed_hits"], s["reported_hits"]) == (OBSERVED_HITS, REPORTED_HITS)
    assert s["server_hit_rate"] == pytest.approx(OBSERVED_HITS / OBSERVED_LOOKUPS)
    assert s["compiles_avoided"] == AVOIDED
    assert s["compile_seconds_saved"] == pytest.approx(saved(w))
    assert s["reported_compile_seconds_saved"] == pytest.approx(reported_saved(w))
    assert {r["reason"]: r["kernel_lookups"] for r in s["miss_reasons"]} == MISS_REASONS
    assert s["lookups"] == REQUESTS  # requests, repeats included: the load, not the rate
    # The series adds up to the same (each kernel lookup in the bucket of its first lookup).
    assert sum(p["kernel_lookups"] for p in s["series"]) == LOOKUPS
    assert sum(p["kernel_hits"] for p in s["series"]) == HITS


def test_v1_stats_gives_each_job_kernel_and_target(run: Run) -> None:
    w = run.workload
    jobs = {g["key"]: g for g in _stats(run, group_by="job")["groups"]}
    assert set(jobs) == set(JOBS)
    for job, (lookups, hits, requests, ranks, reasons) in JOBS.items():
        g = jobs[job]
        assert (g["kernel_lookups"], g["kernel_hits"], g["total"]) == (lookups, hits, requests)
        assert g["hit_rate"] == pytest.approx(hits / lookups)
        assert g["compile_seconds_saved"] == pytest.approx(job_saved(w, job))
        assert {r["rank"]: (r["kernel_lookups"], r["kernel_hits"]) for r in g["ranks"]} == ranks
        one = _stats(run, job_id=job)  # the job's own page: its reasons
        assert {r["reason"]: r["kernel_lookups"] for r in one["miss_reasons"]} == reasons
        assert one["kernel_lookups"] == lookups and one["compile_seconds_saved"] == pytest.approx(
            job_saved(w, job)
        )
    kernels = {g["key"]: g for g in _stats(run, group_by="kernel")["groups"]}
    assert {k: (g["kernel_lookups"], g["kernel_hits"]) for k, g in kernels.items()} == KERNELS
    targets = {g["key"]: g["kernel_lookups"] for g in _stats(run, group_by="target")["groups"]}
    assert targets == {"sm_80": 17, None: 1}  # the library's compile named no target
    missed = {m["kernel"]: m for m in _stats(run, top="20")["top_missed"]}
    assert missed["k_one"]["misses"] == 2 and missed["k_one"]["reasons"] == {
        "first_build": 1,
        "built_by_job": 1,
    }
    assert missed["k_nvcc"]["last_miss_reason"] == (
        "compiled by the library outside kcache (backend=nvcc)"
    )


def test_a_process_reading_back_its_warmup_is_credited_nothing(run: Run) -> None:
    """cold r0 read K1 back 51 times, cold r1 100 times, warm r1 1000: no lookup, no saving."""
    w = run.workload
    cold = _stats(run, job_id="cold", group_by="rank")
    ranks = {g["key"]: g for g in cold["groups"]}
    assert ranks[0]["total"] == 53 and ranks[0]["kernel_lookups"] == 2  # 2 compiles, 51 reads
    assert ranks[0]["compile_seconds_saved"] == 0.0  # it compiled both: it saved nothing
    assert ranks[1]["total"] == 108 and ranks[1]["compiles_avoided"] == 2
    assert ranks[1]["compile_seconds_saved"] == pytest.approx(w.cs("K1") + w.cs("K2"))


def test_a_job_that_compiled_everything_from_cold_has_no_hit(run: Run) -> None:
    """Its ranks' reads of what rank 0 compiled needed that compile (they were 93.75 %)."""
    cold = _stats(run, job_id="cold")
    assert cold["hit_rate"] == 0.0 and cold["kernel_hits"] == 0
    assert cold["compiles_avoided"] == 2  # rank 1 still did not compile them itself


def test_a_job_whose_hits_clients_reported_has_a_hit_rate(run: Run) -> None:
    """warm r1's lookups were all node-tier hits, reported by its client (they read "-")."""
    warm = {g["key"]: g for g in _stats(run, job_id="warm", group_by="rank")["groups"]}
    assert warm[1]["hit_rate"] == 1.0 and warm[1]["reported_hits"] == 2


# ------------------------------------------------------------------ kcache stats
def _cli(run: Run, *args: str) -> subprocess.CompletedProcess[str]:
    w = run.workload
    window = ["--since", str(w.since), "--until", str(w.until)]
    return subprocess.run(
        [KCACHE, "stats", "--server", run.server.url, *window, *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "COLUMNS": "200"},
    )


def _secs(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 60 else f"{seconds / 60:.1f} min"


def test_kcache_stats_prints_the_figures(run: Run) -> None:
    w = run.workload
    done = _cli(run)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert (
        "hit rate      27.8%  (5 of 18 kernel lookups needed no compile anywhere: 3 answered by "
        "the server, 2 reported by clients)"
    ) in lines
    misses = next(line for line in lines if line.startswith("misses "))
    assert misses.startswith("misses        13: 5 first build of this recipe, ")
    assert "1 another rank" not in misses and "2 another rank of this job compiled it" in misses
    saved_line = next(line for line in lines if line.startswith("compile saved "))
    assert saved_line.startswith(f"compile saved {_secs(saved(w))}  (7 compiles avoided")
    assert f"{_secs(reported_saved(w))} of it reported by clients" in saved_line
    assert any(line.startswith(f"requests      {REQUESTS}  ") for line in lines)
    rows = {
        line.split()[0]: line.split() for line in lines if line.split()[:1] in ([j] for j in JOBS)
    }
    for job, (lookups, hits, requests, _, _) in JOBS.items():
        row = rows[job]
        assert row[1:5] == [str(lookups), str(hits), str(lookups - hits), f"{hits / lookups:.1%}"]
        assert row[7] == str(requests)
    assert rows["warm"][-3:] == ["0:100.0%", "1:100.0%", "2:100.0%"]  # what each rank got
    assert rows["cold"][-2:] == ["0:0.0%", "1:0.0%"]
    assert json.loads(_cli(run, "--json").stdout)["kernel_lookups"] == LOOKUPS


def test_kcache_stats_of_an_unknown_job_says_so(run: Run) -> None:
    done = _cli(run, "--job", "colt")
    assert done.returncode == 1 and done.stdout == ""
    assert "no lookups of job 'colt' in this window" in done.stderr
    assert "jobs with lookups in it: " in done.stderr and "cold" in done.stderr
    known = _cli(run, "--job", "cold")
    assert known.returncode == 0 and "27.8%" not in known.stdout and "0.0%" in known.stdout


# ------------------------------------------------------------------ /metrics
def _samples(run: Run) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with run.server.client() as http:
        text = http.get("/metrics").text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_metrics_count_the_same(run: Run) -> None:
    w, samples = run.workload, _samples(run)

    def total(name: str, **labels: str) -> float:
        return sum(
            v
            for (n, ls), v in samples.items()
            if n == name and all(dict(ls).get(k) == x for k, x in labels.items())
        )

    lookups = "kcache_kernel_lookups_total"
    assert total(lookups) == LOOKUPS and total(lookups, result="hit") == HITS
    assert total(lookups, result="hit", source="server") == OBSERVED_HITS
    assert total(lookups, result="hit", source="client") == REPORTED_HITS
    assert total(lookups, source="server") == OBSERVED_LOOKUPS
    assert total("kcache_compiles_avoided_total") == AVOIDED
    assert total("kcache_compile_seconds_saved_total") == pytest.approx(saved(w))
    assert total("kcache_compile_seconds_saved_total", source="client") == pytest.approx(
        reported_saved(w)
    )
    assert total("kcache_lookups_total") == REQUESTS  # requests, as /v1/stats' lookups


# ------------------------------------------------------------------ Grafana, by Prometheus
def _panels() -> dict[str, dict[str, Any]]:
    dashboard = json.loads(GRAFANA.read_text())
    return {p["title"]: p for p in dashboard["panels"]}


def test_the_grafana_panels_give_the_same(run: Run) -> None:
    """Each panel's query, with the dashboard's time range over the workload, evaluated by
    Prometheus at a scrape after it (so nothing is extrapolated)."""
    w = run.workload
    span = f"{int(run.scraped_at - w.since) + 60}s"

    def evaluate(expr: str) -> list[dict[str, Any]]:
        return run.prometheus.query(
            expr.replace("$__range", span).replace("$__rate_interval", span), run.scraped_at
        )

    def one(panel: str, ref: str = "A") -> float:
        (target,) = [t for t in _panels()[panel]["targets"] if t["refId"] == ref]
        (sample,) = evaluate(target["expr"])
        return float(sample["value"][1])

    assert one("Hit rate · no compile needed") == pytest.approx(HITS / LOOKUPS)
    # The time series panel draws the same rate.
    rate_panel = next(p for p in _panels().values() if p["type"] == "timeseries" and p["id"] == 1)
    (sample,) = evaluate(rate_panel["targets"][0]["expr"])
    assert float(sample["value"][1]) == pytest.approx(HITS / LOOKUPS)
    assert one("Kernel lookups") == LOOKUPS
    assert one("Kernel lookups", "B") == HITS
    (by_source,) = [t for t in _panels()["Kernel lookups"]["targets"] if t["refId"] == "C"]
    sources = {s["metric"]["source"]: float(s["value"][1]) for s in evaluate(by_source["expr"])}
    assert sources == {"server": OBSERVED_HITS, "client": REPORTED_HITS}
    assert one("Compile time saved") == pytest.approx(saved(w))
    assert one("Compile time saved", "B") == AVOIDED


def test_the_alerts_hit_ratio_is_the_same_rate(run: Run) -> None:
    """deploy/alerts' recording rule (what KcacheHitRateDrop watches) over the same window."""
    import yaml

    rules = yaml.safe_load((ROOT / "deploy/alerts/kcache.rules.yml").read_text())["groups"][0]
    exprs = {r["record"]: r["expr"] for r in rules["rules"]}
    span = f"{int(run.scraped_at - run.workload.since) + 60}s"
    inner = exprs["kcache:kernel_lookups:rate30m"].replace("[30m]", f"[{span}]")
    hits = inner.replace(
        "kcache_kernel_lookups_total[", 'kcache_kernel_lookups_total{result="hit"}['
    )
    ratio = (
        exprs["kcache:hit_ratio:rate30m"]
        .replace('kcache:kernel_lookups:rate30m{result="hit"}', f"({hits})")
        .replace("kcache:kernel_lookups:rate30m", f"({inner})")
    )
    (sample,) = run.prometheus.query(ratio, run.scraped_at)
    assert float(sample["value"][1]) == pytest.approx(HITS / LOOKUPS)


# ------------------------------------------------------------------ the dashboard
dashboard = pytest.mark.skipif(
    not chromium_installed(), reason="Chromium is not installed (scripts/ensure-services)"
)


def _open(page: Any, run: Run, **params: str) -> None:
    query = urllib.parse.urlencode({**run.window(), "refresh": "600", **params})
    page.goto(f"{run.server.url}/dashboard?{query}")
    page.wait_for_function("() => Number(document.body.dataset.loads || 0) >= 1", timeout=30_000)


def _value(page: Any, selector: str) -> float:
    return float(page.get_attribute(selector, "data-value"))


def _reasons(page: Any) -> dict[str, int]:
    return {
        row.get_attribute("data-reason"): int(
            row.query_selector("td.num").get_attribute("data-value")
        )
        for row in page.query_selector_all("#miss-reasons tbody tr[data-reason]")
    }


@dashboard
def test_the_dashboard_gives_the_figures(page: Any, run: Run, artifacts_dir: Path) -> None:
    w = run.workload
    _open(page, run)
    assert page.text_content(".kpi.accent .kpi-label") == "Hit rate · no compile needed"
    assert page.text_content("#kpi-hit-rate") == "27.8%"
    assert _value(page, "#kpi-hit-rate") == pytest.approx(HITS / LOOKUPS)
    assert page.text_content("#kpi-hits") == "5 of 18 kernel lookups needed no compile"
    assert page.text_content("#kpi-parts") == "3 answered by the server · 2 reported by clients"
    assert _value(page, "#kpi-lookups") == LOOKUPS
    assert _value(page, "#kpi-lookups-sub") == REQUESTS
    assert _value(page, "#kpi-saved") == pytest.approx(saved(w))
    assert _value(page, "#kpi-saved-sub") == AVOIDED
    assert _value(page, "#kpi-misses") == LOOKUPS - HITS
    assert _reasons(page) == MISS_REASONS
    jobs = {r.get_attribute("data-job"): r for r in page.query_selector_all("#jobs tbody tr")}
    assert set(jobs) == set(JOBS)
    for job, (lookups, hits, _, ranks, _) in JOBS.items():
        cells = jobs[job].query_selector_all("td.num")
        assert float(cells[0].get_attribute("data-value")) == lookups
        assert float(cells[1].get_attribute("data-value")) == pytest.approx(hits / lookups)
        assert float(cells[2].get_attribute("data-value")) == pytest.approx(job_saved(w, job))
        chips = jobs[job].query_selector_all(".chip")
        assert [c.get_attribute("data-rank") for c in chips] == [str(r) for r in ranks]
    kernels = {
        r.get_attribute("data-key"): r.query_selector("td.num").get_attribute("data-value")
        for r in page.query_selector_all("#kernels tbody tr")
    }
    assert {k: int(v) for k, v in kernels.items()} == {k: n for k, (n, _) in KERNELS.items()}
    page.screenshot(path=str(artifacts_dir / "dashboard-one-hit-rate.png"), full_page=True)


@dashboard
def test_rank_chips_say_what_each_rank_got_with_a_legend(page: Any, run: Run) -> None:
    _open(page, run)

    def chips(job: str) -> list[str]:
        return page.eval_on_selector_all(
            f'#jobs tr[data-job="{job}"] .chip', "cs => cs.map(c => c.dataset.got)"
        )

    assert chips("warm") == ["all", "all", "all"]  # every kernel found, observed or reported
    assert chips("cold") == ["most", "most"]  # rank 1 read only what rank 0 compiled
    legend = page.text_content("#rank-legend")
    for said in ("every kernel found", "some needed a compile", "half or more needed a compile"):
        assert said in legend
    # The chip's colour is the legend's colour for what it got.
    colour = "el => getComputedStyle(el).backgroundColor"
    assert page.eval_on_selector('#jobs tr[data-job="warm"] .chip .dot', colour) == (
        page.eval_on_selector('#rank-legend [data-got="all"] .dot', colour)
    )
    assert page.eval_on_selector('#jobs tr[data-job="cold"] .chip .dot', colour) == (
        page.eval_on_selector('#rank-legend [data-got="most"] .dot', colour)
    )


@dashboard
def test_a_job_is_one_click_and_one_url_away(page: Any, run: Run, artifacts_dir: Path) -> None:
    w = run.workload
    _open(page, run)
    page.click('#jobs tr[data-job="cold"] a[data-filter="job_id"]')
    page.wait_for_function("() => Number(document.body.dataset.loads || 0) >= 1", timeout=30_000)
    assert "job_id=cold" in page.url and page.text_content("#scope") == "job cold"
    # The job's own page: its hits, misses, saved time and miss reasons.
    assert page.text_content("#kpi-hit-rate") == "0.0%"
    assert _value(page, "#kpi-lookups") == 4 and _value(page, "#kpi-misses") == 4
    assert _value(page, "#kpi-saved") == pytest.approx(job_saved(w, "cold"))
    assert _reasons(page) == JOBS["cold"][4]
    assert [r.get_attribute("data-job") for r in page.query_selector_all("#jobs tbody tr")] == [
        "cold"
    ]
    page.screenshot(path=str(artifacts_dir / "dashboard-job.png"), full_page=True)
    # The same page from its address alone.
    _open(page, run, job_id="warm")
    assert page.text_content("#kpi-hit-rate") == "100.0%"
    assert _value(page, "#kpi-saved") == pytest.approx(job_saved(w, "warm"))
    assert _reasons(page) == {}


@dashboard
def test_a_kernel_and_a_target_are_one_click_away(page: Any, run: Run) -> None:
    _open(page, run)
    page.click('#kernels tr[data-key="k_one"] a[data-filter="kernel"]')
    page.wait_for_function("() => Number(document.body.dataset.loads || 0) >= 1", timeout=30_000)
    assert "kernel=k_one" in page.url and page.text_content("#scope") == "kernel k_one"
    assert _value(page, "#kpi-lookups") == 5 and page.text_content("#kpi-hit-rate") == "60.0%"
    assert _reasons(page) == {"first_build": 1, "built_by_job": 1}
    jobs = sorted(r.get_attribute("data-job") for r in page.query_selector_all("#jobs tbody tr"))
    assert jobs == ["cold", "warm"]  # the jobs that looked it up
    page.click('#targets tr[data-key="sm_80"] a[data-filter="target"]')
    page.wait_for_function("() => Number(document.body.dataset.loads || 0) >= 1", timeout=30_000)
    assert "target=sm_80" in page.url and "kernel=k_one" in page.url
    _open(page, run, target="sm_80")
    assert _value(page, "#kpi-lookups") == 17
    assert page.text_content("#scope") == "target sm_80"
    page.fill("#f-job", "cold")
    page.click("#filter-form button")
    page.wait_for_function("() => Number(document.body.dataset.loads || 0) >= 1", timeout=30_000)
    assert page.text_content("#scope") == "job cold · target sm_80"
    assert _value(page, "#kpi-lookups") == 4


def test_the_dashboard_refuses_an_unknown_parameter(run: Run) -> None:
    with run.server.client() as http:
        assert http.get("/dashboard", params={"job_id": "cold", "window": "1h"}).status_code == 200
        r = http.get("/dashboard", params={"job": "cold"})
    assert r.status_code == 422 and "job_id" in r.json()["detail"]


def test_no_wall_clock_in_the_window(run: Run) -> None:
    """The window is the workload's own: the figures above are the workload's, whenever run."""
    assert run.workload.since < run.workload.until <= time.time() + 5
    assert re.fullmatch(r"\d+\.0", str(run.workload.since))
