"""A scripted workload of foreign artifacts (docs/design.md section 10), and its own account.

Two libraries' cache hooks, spoken as a hook speaks over HTTP: each file's bytes to
``PUT /v1/blobs/{digest}``, the group to ``PUT /v1/foreign/{library}/{key}``, lookups
``GET /v1/foreign/{library}/{key}`` of published names (hits) and of names nobody
published (misses). Repeated hits of one name within a flush are one audit row that
counts them (the writer's tally), as a hook's hot loop makes them. A client's report of
a library compile under a kernel named like a foreign lookup (``bypass``, tier
``library``) is sent too: it is a kernel lookup, but no foreign lookup, and must not be
counted as one. :class:`ForeignWorkload` counts each library's lookups as the script
makes them, independently of the server.
"""

from __future__ import annotations

import hashlib
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

from tests.support import ServerThread

NAMESPACE = {"version": "14.2.0", "target": "sm_90", "toolchain": "nvrtc-13.0"}
#: library -> (published keys and how often each is looked up, unpublished keys looked up once)
SCRIPT: dict[str, tuple[dict[str, int], tuple[str, ...]]] = {
    "cupy": ({"vadd.cubin": 3, "scale.cubin": 1}, ("absent.cubin",)),
    "triton": ({"matmul_kernel": 1}, ("softmax_kernel", "layernorm_kernel")),
}


@dataclass
class ForeignWorkload:
    """What the script looked up, per library, counted on the client side."""

    server: ServerThread
    lookups: Counter[str] = field(default_factory=Counter)
    hits: Counter[str] = field(default_factory=Counter)

    def expected(self) -> list[dict[str, Any]]:
        """``foreign_by_library`` as the script's own count says it must read: most first."""
        return [
            {
                "library": library,
                "lookups": n,
                "hits": self.hits[library],
                "misses": n - self.hits[library],
                "hit_rate": self.hits[library] / n,
            }
            for library, n in sorted(self.lookups.items(), key=lambda item: (-item[1], item[0]))
        ]


def _publish(http: httpx.Client, library: str, key: str) -> None:
    data = f"{library}:{key}".encode() * 16
    digest = hashlib.sha256(data).hexdigest()
    put = http.put(
        f"/v1/blobs/{digest}", content=data, headers={"content-type": "application/octet-stream"}
    )
    assert put.status_code == 200, put.text
    files = [{"name": "payload", "digest": digest, "size": len(data)}]
    published = http.put(f"/v1/foreign/{library}/{key}", json={**NAMESPACE, "files": files})
    assert published.status_code == 200 and published.json()["published"], published.text


def _lookup(w: ForeignWorkload, http: httpx.Client, library: str, key: str) -> None:
    got = http.get(f"/v1/foreign/{library}/{key}", params=NAMESPACE)
    assert got.status_code in (200, 404), got.text
    w.lookups[library] += 1
    w.hits[library] += got.status_code == 200


def run_foreign_workload(server: ServerThread) -> ForeignWorkload:
    """Publish and look up :data:`SCRIPT` on ``server``; returns the script's account."""
    w = ForeignWorkload(server)
    with server.client() as http:
        for library, (published, absent) in SCRIPT.items():
            for key, times in published.items():
                _publish(http, library, key)
                for _ in range(times):
                    _lookup(w, http, library, key)
            for key in absent:
                _lookup(w, http, library, key)
        forged = {
            "time": time.time(),
            "outcome": "bypass",
            "tier": "library",
            "kernel": "foreign:forged:vadd.cubin",
            "target": "sm_90",
            "pid": 4242,
            "latency_ms": 0.1,
        }
        reported = http.post("/v1/events", json={"events": [forged]})
        assert reported.status_code == 200 and reported.json() == {"accepted": 1}, reported.text
    return w
