"""The auditing tests' scripted workload, and its own account of what it caused.

Starting a server (NVRTC workers) and compiling take seconds, so the workload runs
once per module (the ``workload`` fixture) against a real uvicorn server on SQLite,
and its tests read what it did. :class:`Workload` counts every outcome as the script
causes it, independently of the server, so a test can compare the server's account
with the truth.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

from tests.support import ServerThread, vector_add


def header_recipe(tag: str, scale: str) -> dict[str, Any]:
    """A recipe whose header text differs by ``scale``: same base key, another recipe key and digest."""
    return {
        "source": (
            f"// {tag}\n"
            '#include "scale.h"\n'
            'extern "C" __global__ void scaled(float* x, int n) {\n'
            "  int i = blockIdx.x * blockDim.x + threadIdx.x;\n"
            "  if (i < n) x[i] *= SCALE;\n"
            "}\n"
        ),
        "headers": {"scale.h": f"#define SCALE {scale}f\n"},
        "target": "sm_80",
    }


BROKEN = {
    "source": 'extern "C" __global__ void broken(float* x) { x[0] = undefined_symbol; }\n',
    "target": "sm_80",
}


@dataclass
class Workload:
    """What the script did, counted on the client side."""

    server: ServerThread
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    totals: Counter[str] = field(default_factory=Counter)
    by_tier: dict[str, Counter[str]] = field(default_factory=dict)
    by_job: dict[str, Counter[str]] = field(default_factory=dict)
    by_rank: dict[tuple[str, int], Counter[str]] = field(default_factory=dict)
    saved: float = 0.0  # by server-observed hits
    reported_saved: float = 0.0  # by the local hits the script reports as a client
    requests: Counter[tuple[str, str]] = field(default_factory=Counter)
    compile_seconds: dict[str, float] = field(default_factory=dict)
    divergent: dict[str, str] = field(default_factory=dict)  # rank -> digest, job-b

    def count(
        self, outcome: str, tier: str, job: str | None = None, rank: int | None = None
    ) -> None:
        """Record one outcome the script caused."""
        self.totals[outcome] += 1
        self.by_tier.setdefault(tier, Counter())[outcome] += 1
        if job is not None:
            self.by_job.setdefault(job, Counter())[outcome] += 1
            if rank is not None:
                self.by_rank.setdefault((job, rank), Counter())[outcome] += 1

    def resolve(
        self,
        http: httpx.Client,
        recipe: dict[str, Any],
        *,
        job: str,
        rank: int,
        compile: bool = True,
    ) -> httpx.Response:
        """``POST /v1/resolve`` as rank ``rank`` of ``job``, counting what came back."""
        context = {
            "job_id": job,
            "rank": rank,
            "world_size": 2,
            "client_id": f"{job}-r{rank}",
            "host": "node1",
        }
        r = http.post(
            "/v1/resolve", json={"recipe": recipe, "compile": compile, "context": context}
        )
        self.requests[("/v1/resolve", str(r.status_code))] += 1
        if r.status_code == 200:
            body = r.json()
            status = body["status"]
            art = body["artifact"]
            self.compile_seconds[art["digest"]] = art["compile_seconds"]
            if status in ("hit", "waited"):
                self.saved += art["compile_seconds"]
            self.count(status, "server", job, rank)
        elif r.status_code == 404:
            self.count("miss", "server", job, rank)
        else:
            self.count("error", "server", job, rank)
        return r


def run_workload(server: ServerThread) -> Workload:
    """Hits, misses, a compile error, client local hits, and two ranks that diverged."""
    w = Workload(server)
    with server.client() as http:
        # job-a: rank 0 compiles, rank 1 and rank 0 again hit.
        add = vector_add(f"audit-{w.tag}")
        first = w.resolve(http, add, job="job-a", rank=0)
        assert first.json()["status"] == "compiled"
        assert w.resolve(http, add, job="job-a", rank=1).json()["status"] == "hit"
        assert w.resolve(http, add, job="job-a", rank=0).json()["status"] == "hit"
        # An unknown recipe with compile=false: a miss.
        assert (
            w.resolve(
                http, vector_add(f"absent-{w.tag}"), job="job-a", rank=1, compile=False
            ).status_code
            == 404
        )
        # A compile error, then its cached failure.
        broken = {**BROKEN, "source": f"// {w.tag}\n" + BROKEN["source"]}
        assert w.resolve(http, broken, job="job-a", rank=0).status_code == 422
        assert w.resolve(http, broken, job="job-a", rank=1).status_code == 422
        # job-b: rank 1 was given another header: same base key, another digest.
        r0 = w.resolve(http, header_recipe(w.tag, "2.0"), job="job-b", rank=0).json()
        r1 = w.resolve(http, header_recipe(w.tag, "3.0"), job="job-b", rank=1).json()
        assert r0["artifact"]["digest"] != r1["artifact"]["digest"]
        w.divergent = {"0": r0["artifact"]["digest"], "1": r1["artifact"]["digest"]}
        # Client-side local hits of the vector add (node tier, memory tier).
        digest = first.json()["artifact"]["digest"]
        meta = first.json()["artifact"]
        events = []
        for rank, tier in ((0, "node"), (1, "node"), (1, "memory")):
            events.append(
                {
                    "time": time.time(),
                    "outcome": "local_hit",
                    "tier": tier,
                    "recipe_key": first.json()["recipe_key"],
                    "digest": digest,
                    "kernel": "vadd",
                    "target": meta["target"],
                    "toolchain": meta["toolchain"],
                    "client_id": f"job-a-r{rank}",
                    "host": "node1",
                    "pid": 1234 + rank,
                    "job_id": "job-a",
                    "rank": rank,
                    "world_size": 2,
                    "latency_ms": 0.05,
                }
            )
            w.count("local_hit", tier, "job-a", rank)
            w.reported_saved += meta["compile_seconds"]
        r = http.post("/v1/events", json={"events": events})
        assert r.status_code == 200, r.text
        assert r.json() == {"accepted": 3}
    return w
