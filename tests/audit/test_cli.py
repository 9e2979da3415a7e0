"""``kcache stats``: the same summary as ``/v1/stats``, as tables in a terminal."""

from __future__ import annotations

import json
import subprocess

from kcache.outcomes import OUTCOMES
from tests.audit.workload import Workload
from tests.support import KCACHE


def _run(*args: str) -> str:
    result = subprocess.run(
        [KCACHE, "stats", *args], capture_output=True, text=True, check=False, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_stats_from_a_server_prints_the_summary(workload: Workload) -> None:
    out = _run("--server", workload.server.url)
    # Kernel lookups (tests/audit/test_stats_api.py counts them): job-a compiled every kernel
    # it found, job-b compiled both of its own.
    assert (
        "hit rate      0.0%  (0 of 9 kernel lookups needed no compile anywhere: 0 answered by "
        "the server, 0 reported by clients)"
    ) in out
    assert "misses        9: 3 another rank of this job compiled it, 2 compile error, " in out
    assert "compile saved " in out and "(3 compiles avoided, at most one per process" in out
    assert "reported by   client:127.0.0.1 3" in out
    assert "requests      11  (8 seen by the server, 3 reported by clients; repeats included" in out
    tiers = {
        line.split()[0]: line.split()[1:]
        for line in out.splitlines()
        if line.split()[:1] in (["server"], ["node"], ["memory"], ["all"])
    }

    def row(**counts: int) -> list[str]:  # a column per outcome (kcache.outcomes), then total
        return [str(counts.get(o, 0)) for o in OUTCOMES] + [str(sum(counts.values()))]

    assert tiers["server"] == row(hit=2, compiled=3, miss=1, error=2)
    assert tiers["node"] == row(local_hit=2)
    assert tiers["all"] == row(hit=2, local_hit=3, compiled=3, miss=1, error=2)
    assert "job-b DIVERGED" in out
    assert "DIVERGENCE: ranks of one job" in out
    assert f"0:{workload.divergent['0'][:12]} 1:{workload.divergent['1'][:12]}" in out
    assert "compile error" in out


def test_json_output_is_the_api_answer(workload: Workload) -> None:
    data = json.loads(_run("--server", workload.server.url, "--json", "--job", "job-b"))
    assert data["totals"]["compiled"] == 2 and data["lookups"] == 2
    assert data["kernel_lookups"] == 2 and data["hit_rate"] == 0.0
    assert data["divergence"][0]["ranks"] == workload.divergent


def test_stats_read_the_database_directly_without_a_server(workload: Workload) -> None:
    workload.server.state.audit.flush()
    data = json.loads(_run("--data-dir", str(workload.server.settings.data_dir), "--json"))
    assert data["lookups"] == 11
    assert data["totals"] == {o: workload.totals.get(o, 0) for o in data["totals"]}
