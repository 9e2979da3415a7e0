"""``GET /dashboard`` in real headless Chromium: its numbers match ``/v1/stats``, the chart is
drawn, the divergent job is flagged in red, the window selector and auto-refresh work, and
foreign kernels are shown by library.

Chromium is Debian's (``apt-get install chromium``), driven by Playwright's Python
package; Playwright never downloads a browser here.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from tests.audit.conftest import chromium_installed
from tests.audit.foreign_workload import ForeignWorkload
from tests.audit.workload import Workload

pytestmark = pytest.mark.skipif(
    not chromium_installed(),
    reason="Chromium is not installed (scripts/ensure-services installs it)",
)


def _stats(w: Workload) -> dict[str, Any]:
    with w.server.client() as http:
        return http.get("/v1/stats", params={"group_by": "job"}).json()


def _open(page: Any, w: Workload, query: str = "") -> None:
    page.goto(f"{w.server.url}/dashboard{query}")
    page.wait_for_function("() => Number(document.body.dataset.loads || 0) >= 1", timeout=15_000)


def test_numbers_match_the_stats_api(page: Any, workload: Workload, artifacts_dir: Path) -> None:
    _open(page, workload)
    stats = _stats(workload)
    # The headline is the one hit rate over kernel lookups (none of the 9 found without a
    # compile: tests/audit/test_stats_api.py), its parts beside it.
    assert page.text_content("#kpi-hit-rate") == f"{stats['hit_rate'] * 100:.1f}%" == "0.0%"
    assert float(page.get_attribute("#kpi-hit-rate", "data-value")) == stats["hit_rate"]
    assert page.text_content("#kpi-hits") == "0 of 9 kernel lookups needed no compile"
    assert page.get_attribute("#kpi-lookups", "data-value") == str(stats["kernel_lookups"]) == "9"
    assert page.text_content("#kpi-lookups") == "9"
    assert float(page.get_attribute("#kpi-saved", "data-value")) == pytest.approx(
        stats["compile_seconds_saved"]
    )
    # Server-observed and client-reported figures are shown apart.
    assert page.text_content("#kpi-lookups-sub") == (
        "11 requests, repeats included: 8 seen by the server · 3 reported by clients"
    )
    assert page.text_content("#kpi-parts") == "0 answered by the server · 0 reported by clients"
    assert page.text_content("#kpi-reporters") == "reported by client:127.0.0.1 (3)"
    assert "reported by clients" in page.text_content("#kpi-saved-sub")
    assert page.text_content("#kpi-misses") == str(stats["kernel_misses"]) == "9"
    assert page.text_content("#kpi-errors") == "2 failed to compile"
    assert page.text_content("#kpi-divergence") == "1"
    # Outcomes by tier: every non-zero count shown, and nothing else.
    shown = {
        (el.get_attribute("data-tier"), el.get_attribute("data-outcome")): int(
            el.get_attribute("data-value")
        )
        for el in page.query_selector_all("#tiers [data-outcome]")
    }
    assert shown == {(t, o): n for t, c in stats["by_tier"].items() for o, n in c.items() if n}
    # Top missed kernels with their last miss reason.
    rows = page.query_selector_all("#top-missed tbody tr")
    missed = {r.get_attribute("data-kernel"): r.query_selector_all("td") for r in rows}
    for m in stats["top_missed"]:
        cells = missed[m["kernel"]]
        assert cells[1].text_content() == str(m["misses"])
        assert cells[3].query_selector(".why").text_content() == m["last_miss_reason"]
        explained = cells[3].query_selector(".explained")
        said = explained.text_content() if explained is not None else None
        assert said == m["last_miss_explanation"]
    # The miss of job-b's second header explained: the nearest recipe and the header that changed.
    scaled = next(m for m in stats["top_missed"] if m["kernel"] == "scaled")
    assert scaled["last_miss_explanation"].startswith("nearest ")
    assert "header scale.h changed (" in scaled["last_miss_explanation"]
    assert "header scale.h changed (" in missed["scaled"][3].text_content()
    assert page.is_visible('#top-missed tr[data-kernel="scaled"] .explained')
    # Per-job table with ranks.
    jobs = {r.get_attribute("data-job"): r for r in page.query_selector_all("#jobs tbody tr")}
    assert set(jobs) == {"job-a", "job-b"}
    for group in stats["groups"]:
        row = jobs[group["key"]]
        assert row.query_selector("td.num").text_content() == str(group["kernel_lookups"])
        ranks = [c.get_attribute("data-rank") for c in row.query_selector_all(".chip")]
        assert ranks == [str(r["rank"]) for r in group["ranks"]]
    page.screenshot(path=str(artifacts_dir / "dashboard.png"), full_page=True)


def test_the_divergent_job_is_flagged_in_red(page: Any, workload: Workload) -> None:
    _open(page, workload)
    rows = page.query_selector_all("#divergence tbody tr")
    assert len(rows) == 1
    row = rows[0]
    assert row.get_attribute("data-job") == "job-b"
    assert "divergent" in row.get_attribute("class")
    for digest in workload.divergent.values():
        assert digest[:12] in row.text_content()
    # The computed colours, not just a class name: a reddish background and text.
    bg = page.eval_on_selector(
        "#divergence tbody tr td", "td => getComputedStyle(td).backgroundColor"
    )
    red, green, blue, *_ = (float(v) for v in bg[bg.index("(") + 1 : -1].split(","))
    assert red > 200 and green < 100 and blue < 100, bg
    job_b = page.query_selector('#jobs tr[data-job="job-b"]')
    job_a = page.query_selector('#jobs tr[data-job="job-a"]')
    assert "divergent" in job_b.get_attribute("class") and "divergent" not in (
        job_a.get_attribute("class") or ""
    )
    assert "alarm" in page.get_attribute("#kpi-divergence-card", "class")


def test_the_chart_is_drawn(page: Any, workload: Workload) -> None:
    _open(page, workload)
    assert int(page.get_attribute("#hit-chart", "data-points")) >= 1
    assert int(page.get_attribute("#hit-chart", "data-buckets")) >= 40
    # Count pixels in the chart's accent colour (the hit-rate line and dots).
    accent = page.evaluate(
        """() => {
          const c = document.getElementById('hit-chart');
          const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
          let n = 0;
          for (let i = 0; i < d.length; i += 4) {
            if (d[i] < 130 && d[i + 1] > 200 && d[i + 2] > 180 && d[i + 3] > 200) n++;
          }
          return n;
        }"""
    )
    assert accent > 20


def test_window_selector_and_auto_refresh(page: Any, workload: Workload) -> None:
    _open(page, workload, "?refresh=0.5")
    assert page.get_attribute("body", "data-window") == "24h"
    page.click('#windows button[data-window="1h"]')
    page.wait_for_function("() => document.body.dataset.window === '1h'")
    assert "active" in page.get_attribute('#windows button[data-window="1h"]', "class")
    assert page.url.endswith("#window=1h")
    loads = int(page.get_attribute("body", "data-loads"))
    page.wait_for_function(
        "n => Number(document.body.dataset.loads) >= n", arg=loads + 2, timeout=10_000
    )
    # Switching auto-refresh off stops the reloads.
    page.uncheck("#auto-refresh")
    settled = int(page.get_attribute("body", "data-loads"))
    page.wait_for_timeout(1500)
    assert int(page.get_attribute("body", "data-loads")) == settled


def test_the_page_loads_nothing_from_elsewhere(page: Any, workload: Workload) -> None:
    urls: list[str] = []
    page.on("request", lambda request: urls.append(request.url))
    _open(page, workload)
    assert urls and all(u.startswith(workload.server.url) for u in urls), urls
    with workload.server.client() as http:
        r = http.get("/dashboard")
    assert "default-src 'none'" in r.headers["content-security-policy"]
    assert http_status(workload, "/dashboard/../../etc/passwd") == 404


def test_the_page_draws_the_servers_outcomes(page: Any, workload: Workload) -> None:
    """The legend and the tier bars come from kcache.outcomes, written into the page by the server."""
    from kcache.outcomes import HIT_OUTCOMES, OUTCOMES

    _open(page, workload)
    legend = page.eval_on_selector_all("#outcome-legend span", "els => els.map(e => e.textContent)")
    assert legend == [o.replace("_", " ") for o in OUTCOMES]
    drawn = page.eval_on_selector_all(
        "#tiers [data-outcome]", "els => els.map(e => e.dataset.outcome)"
    )
    assert drawn and set(drawn) <= set(OUTCOMES)
    # Each tier's hit share counts exactly the hit outcomes.
    for tier, counts in _stats(workload)["by_tier"].items():
        total = sum(counts.values())
        hits = sum(n for o, n in counts.items() if o in HIT_OUTCOMES)
        head = page.text_content(f'.tier[data-tier="{tier}"] .tier-head .muted')
        assert head == f"{total} requests · {hits / total * 100:.1f}% hits"


def test_the_first_answer_is_drawn_before_the_jobs(
    page: Any, workload: Workload, console_errors: list[str]
) -> None:
    """Progressive: the page asks without group_by first, draws it, then asks for the jobs.

    The second answer is refused here (a real 500 body through the browser's route), so
    the page must show the first answer's panels, the error as it always has, and a
    jobs table that says it was not loaded, not an empty list of jobs.
    """
    asked: list[str] = []

    def refuse_jobs(route: Any) -> None:
        asked.append(route.request.url)
        if "group_by=job" in route.request.url:
            route.fulfill(status=500, content_type="application/json", body='{"detail": "boom"}')
        else:
            route.continue_()

    page.route("**/v1/stats?*", refuse_jobs)
    page.goto(f"{workload.server.url}/dashboard?refresh=600")
    page.wait_for_function("() => !document.getElementById('error').hidden", timeout=15_000)
    assert ["group_by=job" in u for u in asked] == [False, True]  # nothing more asked
    assert page.get_attribute("body", "data-paints") == "1"
    assert page.get_attribute("body", "data-loads") is None  # the whole answer never came
    stats = _stats(workload)
    assert page.get_attribute("#kpi-lookups", "data-value") == str(stats["kernel_lookups"]) == "9"
    assert page.text_content("#kpi-divergence") == "1"
    assert len(page.query_selector_all("#divergence tbody tr")) == 1
    assert int(page.get_attribute("#hit-chart", "data-points")) >= 1
    assert page.text_content("#error") == "GET /v1/stats answered 500: boom"
    assert page.text_content("#jobs tbody") == "jobs not loaded"
    assert page.query_selector("#jobs tr[data-job]") is None
    # Chromium logs the refused answer itself; that one error is this test's doing.
    assert len(console_errors) == 1 and "status of 500" in console_errors[0], console_errors
    console_errors.clear()


def test_the_jobs_fill_in_after_the_first_answer(page: Any, workload: Workload) -> None:
    """Both answers drawn, in order: the jobs table holds the second one's jobs; the kernels
    and the targets are asked after them."""
    asked: list[str] = []
    page.on("request", lambda r: asked.append(r.url) if "/v1/stats" in r.url else None)
    _open(page, workload, "?refresh=600")
    grouped = [re.search(r"group_by=(\w+)", u) for u in asked]
    assert [g.group(1) if g else None for g in grouped] == [None, "job", "kernel", "target"]
    assert page.get_attribute("body", "data-paints") == "2"
    assert page.get_attribute("#jobs", "data-pending") is None
    assert page.is_hidden("#error")
    jobs = [r.get_attribute("data-job") for r in page.query_selector_all("#jobs tbody tr")]
    assert sorted(jobs) == ["job-a", "job-b"]


def http_status(w: Workload, path: str) -> int:
    """The status of ``GET path`` sent verbatim."""
    with w.server.client() as http:
        return http.get(path).status_code


def test_verification_divergences_are_shown(page: Any, workload: Workload) -> None:
    """A divergence the verifier recorded (planted here: tests/server/test_verification.py makes
    real ones) is listed with how it was served and what differed."""
    import sqlalchemy as sa
    from kcache_server.models import VerificationEvent, utcnow

    key = "7e" * 32
    with workload.server.state.backends.db.begin() as conn:
        conn.execute(
            sa.insert(VerificationEvent).values(
                at=utcnow(),
                recipe_key=key,
                base_key="8f" * 32,
                via="manifest",
                result="diverged",
                stored_digest="aa" * 32,
                fresh_digest="bb" * 32,
                kernel="scaled",
                differences=["dependency b.cuh (0123abcd..) read but not recorded"],
                seconds=0.1,
            )
        )
    _open(page, workload)
    page.wait_for_selector(f'#verification tr[data-recipe-key="{key}"]', timeout=15_000)
    row = page.query_selector(f'#verification tr[data-recipe-key="{key}"]')
    text = row.text_content()
    assert "manifest match" in text and "b.cuh" in text and "aaaaaaaaaaaa" in text
    assert int(page.get_attribute("#verification-summary", "data-diverged")) >= 1


def test_the_token_is_kept_for_the_tab_only(page: Any, workload: Workload) -> None:
    _open(page, workload)
    page.evaluate(
        """() => { document.getElementById("token").value = "secret-token";
                   document.getElementById("auth-form").requestSubmit(); }"""
    )
    assert page.evaluate("() => sessionStorage.getItem('kcache.token')") == "secret-token"
    assert page.evaluate("() => localStorage.getItem('kcache.token')") is None


def test_the_store_bar_is_empty_without_a_cap(page: Any, workload: Workload) -> None:
    """No cap: no whole to fill a bar of, so the bar holds no fill and says "no cap" (issue 31).

    The bar used to be drawn full (the stored bytes out of themselves): its ``hidden``
    attribute lost to the stylesheet's ``display: flex``.
    """
    assert _stats(workload)["store"]["bytes_cap"] is None
    _open(page, workload)
    bar = page.query_selector("#store-bar")
    assert bar.is_visible() and bar.text_content() == "no cap"
    assert page.query_selector_all("#store-bar .seg") == []
    assert "no cap" in page.text_content("#store-sub")
    assert bar.get_attribute("aria-valuemax") is None


def test_the_store_bar_fills_to_the_share_of_a_cap(page: Any, workload: Workload) -> None:
    """With a cap the bar is the stored bytes' share of it (the answer rewritten in the browser)."""
    import json

    body = _stats(workload)
    used = body["store"]["bytes_used"]
    assert used > 0
    body["store"] = {**body["store"], "bytes_cap": used * 4, "pinned_bytes": 0}

    def capped(route: Any) -> None:
        route.fulfill(status=200, content_type="application/json", body=json.dumps(body))

    page.route("**/v1/stats?*", capped)
    _open(page, workload, "?refresh=600")
    widths = page.eval_on_selector_all("#store-bar .seg", "els => els.map(e => e.style.width)")
    assert widths == ["25%"]
    assert page.text_content("#store-bar") == ""  # no "no cap" label
    assert page.get_attribute("#store-bar", "aria-valuemax") == str(used * 4)


def test_a_reported_divergence_names_its_reporters(page: Any, workload: Workload) -> None:
    """A row only client reports make is shown apart, with the tokens that reported it."""
    import json

    body = _stats(workload)
    (row,) = body["divergence"]
    fabricated = {
        **row,
        "job_id": "job-hearsay",
        "reported": True,
        "reported_by": ["token:liar", "token:other"],
    }
    body["divergence"] = [row, fabricated]

    def with_hearsay(route: Any) -> None:
        route.fulfill(status=200, content_type="application/json", body=json.dumps(body))

    page.route("**/v1/stats?*", with_hearsay)
    _open(page, workload, "?refresh=600")
    hearsay = page.query_selector('#divergence tr[data-job="job-hearsay"]')
    assert "reported-divergence" in hearsay.get_attribute("class")
    assert "reported by token:liar, token:other" in hearsay.text_content()
    assert page.text_content("#kpi-divergence") == "1"  # the server's own row only


def test_foreign_kernels_are_shown_by_library(
    page: Any, foreign_workload: ForeignWorkload, artifacts_dir: Path
) -> None:
    """The "Foreign kernels by library" panel holds /v1/stats' foreign_by_library, as counted
    by the script that published and looked them up (tests/audit/foreign_workload.py)."""
    page.goto(f"{foreign_workload.server.url}/dashboard")
    page.wait_for_function("() => Number(document.body.dataset.loads || 0) >= 1", timeout=15_000)
    assert page.is_visible("#foreign-section")
    rows = page.query_selector_all("#foreign-libraries tbody tr")
    shown = [
        [r.get_attribute("data-library")] + [c.text_content() for c in r.query_selector_all("td")]
        for r in rows
    ]
    assert shown == [
        ["cupy", "cupy", "5", "4", "80.0%"],
        ["triton", "triton", "3", "1", "33.3%"],
    ]
    rates = page.eval_on_selector_all(
        "#foreign-libraries tbody tr td:nth-child(4)",
        "tds => tds.map(td => Number(td.dataset.value))",
    )
    assert rates == [row["hit_rate"] for row in foreign_workload.expected()]
    page.screenshot(path=str(artifacts_dir / "dashboard-foreign.png"), full_page=True)


def test_no_foreign_lookups_is_one_line(page: Any, workload: Workload) -> None:
    assert _stats(workload)["foreign_by_library"] == []
    _open(page, workload)
    assert page.text_content("#foreign-libraries tbody") == (
        "no foreign kernels looked up in this window"
    )
    assert page.query_selector("#foreign-libraries tr[data-library]") is None


def test_a_hostile_library_name_is_shown_as_text(page: Any, workload: Workload) -> None:
    """A library name is text, never markup (the route restricts names; the page relies on nothing)."""
    import json

    hostile = '<img src=x onerror="window.pwned=1"><b>cupy</b>'
    body = _stats(workload)
    body["foreign_by_library"] = [
        {"library": hostile, "lookups": 2, "hits": 1, "misses": 1, "hit_rate": 0.5}
    ]

    def rewritten(route: Any) -> None:
        route.fulfill(status=200, content_type="application/json", body=json.dumps(body))

    page.route("**/v1/stats?*", rewritten)
    _open(page, workload, "?refresh=600")
    (row,) = page.query_selector_all("#foreign-libraries tbody tr")
    assert row.get_attribute("data-library") == hostile
    assert row.query_selector("td").text_content() == hostile
    assert page.query_selector_all("#foreign-libraries img, #foreign-libraries b") == []
    assert page.evaluate("() => window.pwned") is None
