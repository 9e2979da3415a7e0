"""A scripted workload for the one hit rate: a cold job, a warm job, a late rank, a miss of each kind.

Every process speaks as a real client would: its resolves carry its context (job, rank,
host, pid, client id), and what its memory and node tier answered is reported through
``POST /v1/events`` (a memory hit is the process reading back what it already got). The
server compiles for real (NVRTC), and the evicted kernel is removed through the admin
API. :func:`run_kernel_workload` returns the compile time of each kernel as the server
recorded it and the window the workload ran in; the figures the tests expect are written
in the tests by hand.

Processes (host ``n1``):

- job ``cold`` (2 ranks): rank 0 (pid 101) compiles K1 and K2, reads K1 back (a server
  hit, then 50 memory hits); rank 1 (pid 102) reads both from the node tier rank 0
  filled (5 and 3 node hits), then K1 from memory 100 times;
- job ``warm`` (3 ranks): rank 0 (pid 201) gets K1 and K2 from the server; rank 1 (pid
  202) from the node tier (4 hits each), then 1000 memory hits of K1; rank 2 (pid 203)
  is late (its frozen cache missed K1: a ``late`` note) and fetches K1 from the server;
- job ``misc`` (rank 0 in four processes): pid 301 compiles K3, which an admin then
  evicts, and pid 302 compiles it again (evicted); pid 301 compiles H2, asks for an
  unknown recipe with compile false (not cached), compiles a broken one (compile error)
  and reports a library compile (bypass); pid 303 starts a slow compile S and pid 304
  joins it (joined a compile);
- job ``headers`` (pid 401) compiles H3, H2 with another header text (same base key:
  headers changed).
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.support import ServerThread, vector_add, wait_until

HOST = "n1"


def header_recipe(tag: str, scale: str) -> dict[str, Any]:
    """A recipe whose header text differs by ``scale``: same base key, another recipe key."""
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


def slow_recipe(tag: str) -> dict[str, Any]:
    """A kernel NVRTC takes a second or more over (2^14 template instantiations)."""
    return {
        "source": (
            f"// {tag}\n"
            "template <int N, unsigned long long K> struct X {\n"
            "  enum : unsigned long long { v = X<N - 1, K * 2>::v + X<N - 1, K * 2 + 1>::v };\n"
            "};\n"
            "template <unsigned long long K> struct X<0, K> { enum : unsigned long long { v = K }; };\n"
            'extern "C" __global__ void slow(unsigned long long* o) { *o = X<14, 1>::v; }\n'
        ),
        "target": "sm_80",
    }


def named(kernel: str, tag: str) -> dict[str, Any]:
    """A vector add whose kernel is called ``kernel`` (so each is its own row in the tables)."""
    recipe = vector_add(tag)
    recipe["source"] = recipe["source"].replace("void vadd(", f"void {kernel}(")
    return recipe


BROKEN = 'extern "C" __global__ void broken(float* x) { x[0] = undefined_symbol; }\n'


@dataclass
class Process:
    """One process of a job: what its requests and reports carry."""

    job: str
    rank: int
    pid: int
    world_size: int

    @property
    def context(self) -> dict[str, Any]:
        return {
            "job_id": self.job,
            "rank": self.rank,
            "world_size": self.world_size,
            "host": HOST,
            "pid": self.pid,
            "client_id": f"{HOST}-{self.pid}",
        }


@dataclass
class KernelWorkload:
    """What the workload did: the kernels' keys and compile times, and its window."""

    server: ServerThread
    since: float = 0.0
    until: float = 0.0
    keys: dict[str, str] = field(default_factory=dict)  # name -> recipe key
    digests: dict[str, str] = field(default_factory=dict)
    compile_seconds: dict[str, float] = field(default_factory=dict)
    meta: dict[str, dict[str, Any]] = field(default_factory=dict)

    def cs(self, name: str) -> float:
        return self.compile_seconds[name]


def _resolve(
    http: httpx.Client,
    w: KernelWorkload,
    name: str,
    recipe: dict[str, Any],
    p: Process,
    **body: Any,
) -> httpx.Response:
    r = http.post("/v1/resolve", json={"recipe": recipe, "context": p.context, **body})
    if r.status_code == 200:
        art = r.json()["artifact"]
        w.keys[name] = r.json()["recipe_key"]
        w.digests[name] = art["digest"]
        w.compile_seconds.setdefault(name, art["compile_seconds"])
        w.meta[name] = art
    return r


def _report(http: httpx.Client, w: KernelWorkload, p: Process, *events: dict[str, Any]) -> None:
    """What a process's own tiers answered, as its event sink sends it."""
    body = []
    for e in events:
        name = e.pop("name", None)
        event = {"time": time.time(), "latency_ms": 0.01, **p.context, **e}
        if name is not None:
            art = w.meta[name]
            event |= {
                "recipe_key": w.keys[name],
                "digest": w.digests[name],
                "kernel": art["kernel"],
                "target": art["target"],
                "toolchain": art["toolchain"],
            }
        body.append(event)
    r = http.post("/v1/events", json={"events": body})
    assert r.status_code == 200, r.text


def _in_flight(server: ServerThread) -> float:
    with server.client() as http:
        text = http.get("/metrics").text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "kcache_compiles_in_flight"
    )


def run_kernel_workload(server: ServerThread) -> KernelWorkload:
    """The workload of the module docstring, against ``server``."""
    tag = uuid.uuid4().hex[:8]
    w = KernelWorkload(server)
    w.since = float(int(time.time()) - 1)
    k1, k2, k3 = (named(n, f"{tag}-{n}") for n in ("k_one", "k_two", "k_three"))
    with server.client() as http:
        # --------------------------------------------------------------- job cold
        c0, c1 = Process("cold", 0, 101, 2), Process("cold", 1, 102, 2)
        assert _resolve(http, w, "K1", k1, c0).json()["status"] == "compiled"
        assert _resolve(http, w, "K2", k2, c0).json()["status"] == "compiled"
        assert _resolve(http, w, "K1", k1, c0).json()["status"] == "hit"  # its own read-back
        _report(http, w, c0, {"name": "K1", "outcome": "local_hit", "tier": "memory", "count": 50})
        _report(
            http,
            w,
            c1,
            {"name": "K1", "outcome": "local_hit", "tier": "node", "count": 5},
            {"name": "K2", "outcome": "local_hit", "tier": "node", "count": 3},
            {"name": "K1", "outcome": "local_hit", "tier": "memory", "count": 100},
        )
        # --------------------------------------------------------------- job warm
        m0, m1, m2 = (Process("warm", r, 201 + r, 3) for r in range(3))
        assert _resolve(http, w, "K1", k1, m0).json()["status"] == "hit"
        assert _resolve(http, w, "K2", k2, m0).json()["status"] == "hit"
        _report(
            http,
            w,
            m1,
            {"name": "K1", "outcome": "local_hit", "tier": "node", "count": 4},
            {"name": "K2", "outcome": "local_hit", "tier": "node", "count": 4},
            {"name": "K1", "outcome": "local_hit", "tier": "memory", "count": 1000},
        )
        late = {
            "outcome": "late",
            "tier": "node",
            "recipe_key": w.keys["K1"],
            "kernel": w.meta["K1"]["kernel"],
            "target": "sm_80",
        }
        _report(http, w, m2, late)
        assert _resolve(http, w, "K1", k1, m2).json()["status"] == "hit"
        # --------------------------------------------------------------- job misc
        first, second = Process("misc", 0, 301, 1), Process("misc", 0, 302, 1)
        assert _resolve(http, w, "K3", k3, first).json()["status"] == "compiled"
        removed = http.post("/v1/cache/remove", json={"keys": [w.keys["K3"]]})
        assert removed.status_code == 200, removed.text
        assert _resolve(http, w, "K3", k3, second).json()["status"] == "compiled"  # evicted
        h2, h3 = header_recipe(tag, "2.0"), header_recipe(tag, "3.0")
        assert _resolve(http, w, "H2", h2, first).json()["status"] == "compiled"
        other = Process("headers", 0, 401, 1)
        assert _resolve(http, w, "H3", h3, other).json()["status"] == "compiled"
        absent = _resolve(http, w, "absent", named("k_absent", tag), first, compile=False)
        assert absent.status_code == 404
        broken = {"source": f"// {tag}\n{BROKEN}", "target": "sm_80"}
        assert _resolve(http, w, "broken", broken, first).status_code == 422
        _report(
            http,
            w,
            first,
            {"outcome": "bypass", "tier": "library", "reason": "backend=nvcc", "kernel": "k_nvcc"},
        )
        # Joined a compile: pid 304 asks while pid 303's compile of S is running.
        starter, joiner = Process("misc", 0, 303, 1), Process("misc", 0, 304, 1)
        slow = slow_recipe(tag)
        answers: dict[str, httpx.Response] = {}

        def start() -> None:
            with server.client() as own:
                answers["starter"] = _resolve(own, w, "S", slow, starter)

        thread = threading.Thread(target=start)
        thread.start()
        wait_until(lambda: _in_flight(server) >= 1, "the slow compile to start")
        answers["joiner"] = _resolve(http, w, "S", slow, joiner)
        thread.join(timeout=300)
        assert answers["starter"].json()["status"] == "compiled"
        assert answers["joiner"].json()["status"] == "waited", answers["joiner"].text
        http.get("/v1/stats")  # flushes the audit writer: everything is written
    w.until = float(int(time.time()) + 2)
    return w
