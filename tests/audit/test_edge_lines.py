"""Lines of nginx's edge log count as the server's hits only for keys and digests the index knows.

Whoever can write the edge log can write lines in its format: 200,005 forged lines once
moved the server's own hit rate from 0.6 to 0.99998. A real server (uvicorn, SQLite,
NVRTC) reads a file it is told is its edge log; the test writes true lines (a key the
server compiled, with its digest) and forged ones (a key it never saw, a known key with
another digest), and only the true ones reach ``/v1/stats`` and the lookup counters.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support import ServerThread, unique, vector_add, wait_until


def _line(recipe_key: str, digest: str, at: float) -> bytes:
    return f"1 {at:.3f} 200 0.001 /v1/recipes/{recipe_key}/artifact {digest}\n".encode()


def _metric(text: str, name: str, **labels: str) -> float:
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


@pytest.fixture(scope="module")
def edge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerThread, Path]]:
    from kcache_server import Settings

    root = tmp_path_factory.mktemp("edge-lines")
    log = root / "edge.log"
    log.touch()
    settings = Settings(
        data_dir=root / "data", compile_workers=1, audit={"flush_s": 0.05}, edge_log=log
    )
    server = ServerThread(settings)
    try:
        yield server, log
    finally:
        server.stop()


def test_forged_edge_lines_are_not_counted(edge: tuple[ServerThread, Path]) -> None:
    server, log = edge
    with server.client() as http:
        answer: dict[str, Any] = http.post(
            "/v1/resolve", json={"recipe": vector_add(unique("edge"))}
        ).json()
        key, digest = answer["recipe_key"], answer["artifact"]["digest"]
        now = time.time()
        true_lines = [_line(key, digest, now)] * 3
        forged = [_line(f"{i:064x}", digest, now) for i in range(1, 6)]  # keys never seen
        forged += [_line(key, "e" * 64, now)] * 2  # a known key, another digest
        with open(log, "ab") as out:  # O_APPEND, as nginx writes it
            out.write(b"".join(forged[:3] + true_lines + forged[3:]))

        def lines(result: str) -> float:
            return _metric(http.get("/metrics").text, "kcache_edge_log_lines_total", result=result)

        wait_until(lambda: lines("hit") + lines("unknown") == 10, "the tailer to read the lines")
        text = http.get("/metrics").text
        assert _metric(text, "kcache_edge_log_lines_total", result="hit") == 3
        assert _metric(text, "kcache_edge_log_lines_total", result="unknown") == 7
        assert _metric(text, "kcache_lookups_total", outcome="hit", tier="server") == 3
        stats = http.get("/v1/stats").json()
    assert stats["totals"]["hit"] == 3 and stats["totals"]["compiled"] == 1
    assert sum(tier.get("hit", 0) for tier in stats["by_tier"].values()) == 3
