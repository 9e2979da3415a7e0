"""How long a server's event loop stalls while large bodies arrive: a ``/healthz`` poller, and the bodies.

Shared by ``tests/server/test_loop_stall.py`` (CI: no stall over 1 s) and
``bench/b_loop_stall.py`` (a quiet machine: the largest stall, goal 100 ms). The
poller asks ``/healthz`` on one kept-alive connection every few milliseconds from
a thread of the measuring process; the server runs in a process of its own, so
what it measures is the server's loop (``/healthz`` answers from it at once) plus
a little client overhead, which a quiet run of the poller measures alone.

Only the standard library and httpx are imported, as in :mod:`tests.support`.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from types import TracebackType

import httpx

__all__ = ["SHAPES", "HealthPoller", "body_of", "measure"]


class HealthPoller:
    """Polls ``{url}/healthz`` from a thread while in its ``with`` block; :attr:`worst` is the longest answer."""

    def __init__(self, url: str, interval_s: float = 0.002) -> None:
        self.url = url
        self.interval_s = interval_s
        self.latencies: list[float] = []
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="healthz-poller", daemon=True)

    def _poll(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self._stop.is_set():
                started = time.perf_counter()
                try:
                    ok = client.get(f"{self.url}/healthz").status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.latencies.append(time.perf_counter() - started)
                self.errors += not ok
                time.sleep(self.interval_s)

    @property
    def worst(self) -> float:
        """The longest ``/healthz`` answer seen (seconds)."""
        return max(self.latencies, default=0.0)

    def __enter__(self) -> HealthPoller:
        self._thread.start()
        time.sleep(0.2)  # a few answers before the load starts
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        time.sleep(0.2)  # and after it: a stall at the very end is seen too
        self._stop.set()
        self._thread.join(timeout=60)


def _spec_keys(n: int) -> bytes:
    spec = {f"k{i}": i for i in range(n)}
    recipe = {"source": 'extern "C" __global__ void k() {}\n', "target": "sm_80"}
    return json.dumps({"recipe": {**recipe, "specialization": spec}, "compile": False}).encode()


def _batch(recipes: int, keys: int) -> bytes:
    items = [
        {
            "source": f'// {i}\nextern "C" __global__ void k() {{}}\n',
            "target": "sm_80",
            "specialization": {f"k{j}": j for j in range(keys)},
        }
        for i in range(recipes)
    ]
    return json.dumps({"recipes": items, "compile": False}).encode()


def _events(n: int) -> bytes:
    now = time.time()
    event = {"outcome": "local_hit", "tier": "node", "recipe_key": "a" * 64, "digest": "b" * 64}
    events = [{**event, "time": now, "job_id": f"stall-{i % 7}", "rank": i % 8} for i in range(n)]
    return json.dumps({"events": events}).encode()


def _big_source(mib: int) -> bytes:
    line = '  out[i] = a[i] * 2.0f + b[i]; // "quoted" \\ and escaped\n'
    source = line * ((mib << 20) // len(line))
    return json.dumps({"recipe": {"source": source, "target": "sm_80"}, "compile": False}).encode()


#: Body shapes by name: (path, a function making the body). The first two are the
#: issue's (a 17 MiB resolve of a million keys) and its largest kin within 32 MiB.
SHAPES: dict[str, tuple[str, Callable[[], bytes]]] = {
    "resolve_1m_keys_17mib": ("/v1/resolve", lambda: _spec_keys(1_000_000)),
    "resolve_1m6_keys_30mib": ("/v1/resolve", lambda: _spec_keys(1_600_000)),
    "resolve_190k_keys": ("/v1/resolve", lambda: _spec_keys(190_000)),  # just under the limit
    "batch_1024_recipes": ("/v1/resolve/batch", lambda: _batch(1024, 180)),
    "events_5000": ("/v1/events", lambda: _events(5000)),
    "resolve_28mib_source": ("/v1/resolve", lambda: _big_source(28)),
}


def body_of(shape: str) -> tuple[str, bytes]:
    """``(path, body)`` of ``shape``."""
    path, make = SHAPES[shape]
    return path, make()


def measure(url: str, path: str, body: bytes, rounds: int = 3) -> Iterator[tuple[float, int]]:
    """For each round: (the longest ``/healthz`` answer while ``body`` was posted, its status)."""
    headers = {"content-type": "application/json"}
    with httpx.Client(timeout=120) as client:
        for _ in range(rounds):
            with HealthPoller(url) as poller:
                status = client.post(f"{url}{path}", content=body, headers=headers).status_code
            yield poller.worst, status
