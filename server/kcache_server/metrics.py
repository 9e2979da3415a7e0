"""Prometheus metrics of one server process, on its own registry.

Each app gets its own :class:`ServerMetrics` (never the global default registry),
so tests can build many apps in one process and every ``/metrics`` answer counts
only what its app did. With several uvicorn workers each process exports its own
metrics, and a scrape reaches whichever process accepts it; so there every sample also
carries ``worker`` (the process id): each process's counters stay one series, which a
scrape of the other process does not seem to reset, and queries sum them
(``sum without (worker)``, as ``deploy/alerts`` and ``deploy/grafana`` do).

What is measured:

- ``kcache_build_info{version,toolchain}``: always 1; the release and the default toolchain
  id (NVRTC and nvJitLink versions, library and header hashes) this process serves with;
- ``kcache_compiler_available``: 1 when this process can compile, 0 when it serves
  fetches only (no NVRTC >= 13.3: :mod:`kcache_server.compiler_presence`; its
  ``toolchain`` label above is then empty);
- ``kcache_ready`` and ``kcache_readiness_check{check}``: 1 or 0, what ``/readyz`` answers:
  set by every ``/readyz`` and by every scrape, which runs the same checks first
  (:func:`kcache_server.routes.health.install_readiness_gauges`), so a server nothing
  probes still reads current;
- ``kcache_http_requests_total{route,method,status}`` and a latency histogram, by
  route template (``/v1/recipes/{recipe_key}``), never by raw path, so label
  cardinality stays bounded whatever clients send;
- ``kcache_lookups_total{outcome,tier}``: every audit event (server lookups and
  client-reported local hits), repeats included: requests, not the hit rate;
- ``kcache_kernel_lookups_total{result,source}``, ``kcache_compiles_avoided_total{source}``,
  ``kcache_compile_seconds_saved_total{source}``: kernel lookups (a process's first lookup
  of a recipe, :mod:`kcache_server.auditing.lookups`) as this process records them,
  ``result`` hit (needed no compile anywhere) or miss, ``source`` server (observed here) or
  client (reported); the compiles they avoided and their compile time. The hit rate is
  ``result="hit"`` over all, the figure ``/v1/stats`` gives for the same window. Every
  label set exists from the start (at 0), so ``increase()`` counts a window's first ones;
- ``kcache_compile_duration_seconds``: wall time of lookups that compiled;
- ``kcache_compiles_in_flight``, ``kcache_compile_queue_depth``: the compile pool, read at
  scrape time;
- ``kcache_store_bytes``, ``kcache_store_artifacts``: the artifacts the index knows;
- ``kcache_store_bytes_cap``, ``kcache_store_pinned_artifacts``, ``kcache_store_pinned_bytes``,
  ``kcache_evictions_total``, ``kcache_evicted_bytes_total``: bounded storage (the
  eviction counters count what this process evicted; one evictor runs at a time);
- ``kcache_verified_total{result}``, ``kcache_verification_divergences_total``: served
  artifacts compiled again and compared (:mod:`kcache_server.verification`);
- ``kcache_audit_rows_dropped_total{reason}``: audit rows the database refused
  (``refused``) or that found the writer's queue full (``queue_full``);
- ``kcache_recipe_record_failures_total{operation}``: recipes not recorded (``record``),
  misses not explained (``explain``) for a database error, notes dropped (``queue_full``)
  (:mod:`kcache_server.recipe_records`).
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable, Iterator
from typing import Any

import sqlalchemy as sa
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import Metric

from kcache._version import __version__
from kcache_server.compile_pool import ProcessPoolCompiler
from kcache_server.models import artifacts_table

__all__ = [
    "CONTENT_TYPE_LATEST",
    "LoopCounter",
    "LoopHistogram",
    "MetricsMiddleware",
    "ServerMetrics",
    "pool_sampler",
    "store_sampler",
]

# Compiles range from tens of milliseconds (a vector add) to minutes (CCCL templates).
_COMPILE_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_REQUEST_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0, 60.0)


class ServerMetrics:
    """The metrics of one app; pass ``registry`` to share one, else a private one is made.

    ``toolchain`` is the default toolchain's id, for ``kcache_build_info``; ``compiles``
    whether this process can compile at all (``kcache_compiler_available``); ``worker``, when
    this process is one of several uvicorn workers, the ``worker`` label of every sample.
    """

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        toolchain: str = "",
        compiles: bool = True,
        worker: str | None = None,
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.worker = worker
        r = self.registry
        self.build_info = Gauge(
            "kcache_build_info",
            "Always 1: the kcache release and the default toolchain this process serves with",
            ["version", "toolchain"],
            registry=r,
        )
        self.build_info.labels(version=__version__, toolchain=toolchain).set(1)
        self.compiler_available = Gauge(
            "kcache_compiler_available",
            "1 when this process can compile; 0: it serves fetches only (its log says why)",
            registry=r,
        )
        self.compiler_available.set(1 if compiles else 0)
        self.ready = Gauge(
            "kcache_ready",
            "1 when this process is ready (the checks of /readyz, run at every scrape), else 0",
            registry=r,
        )
        self.readiness_checks = Gauge(
            "kcache_readiness_check",
            "1 when the /readyz check passed (ok or degraded), as of this scrape",
            ["check"],
            registry=r,
        )
        self.requests = Counter(
            "kcache_http_requests",
            "HTTP requests by route template, method and status code",
            ["route", "method", "status"],
            registry=r,
        )
        self.request_seconds = Histogram(
            "kcache_http_request_duration_seconds",
            "HTTP request latency by route template",
            ["route"],
            buckets=_REQUEST_BUCKETS,
            registry=r,
        )
        self.verified = Counter(
            "kcache_verified",
            "Served artifacts compiled again and compared, by result "
            "(same_bytes, diverged, failed)",
            ["result"],
            registry=r,
        )
        self.divergences = Counter(
            "kcache_verification_divergences",
            "Served artifacts a fresh compile of their recipe disagreed with (withdrawn)",
            registry=r,
        )
        self.lookups = Counter(
            "kcache_lookups",
            "Lookups by outcome (hit, local_hit, compiled, waited, miss, error) and tier",
            ["outcome", "tier"],
            registry=r,
        )
        self.kernel_lookups_total = Counter(
            "kcache_kernel_lookups",
            "Kernel lookups (a process's first lookup of a recipe) this process recorded, by "
            "result (hit: needed no compile anywhere; miss) and source (server: observed; "
            "client: reported)",
            ["result", "source"],
            registry=r,
        )
        self.compiles_avoided = Counter(
            "kcache_compiles_avoided",
            "Kernel lookups whose process got the kernel without compiling or waiting for a "
            "compile, by source (server, client)",
            ["source"],
            registry=r,
        )
        self.compile_seconds_saved = Counter(
            "kcache_compile_seconds_saved",
            "Compile time avoided by those kernel lookups (their kernels' compile times), by source",
            ["source"],
            registry=r,
        )
        for source in ("server", "client"):  # at 0 from the start: increase() sees the first
            self.compiles_avoided.labels(source=source)
            self.compile_seconds_saved.labels(source=source)
            for result in ("hit", "miss"):
                self.kernel_lookups_total.labels(result=result, source=source)
        self.compile_seconds = Histogram(
            "kcache_compile_duration_seconds",
            "Wall time of lookups that compiled (queueing, NVRTC/nvJitLink, publishing)",
            buckets=_COMPILE_BUCKETS,
            registry=r,
        )
        self.compiles_in_flight = Gauge(
            "kcache_compiles_in_flight", "Compiles running or queued in this process", registry=r
        )
        self.queue_depth = Gauge(
            "kcache_compile_queue_depth", "Compiles waiting for a free worker", registry=r
        )
        self.store_bytes = Gauge(
            "kcache_store_bytes", "Bytes of artifacts in the store", registry=r
        )
        self.store_artifacts = Gauge("kcache_store_artifacts", "Artifacts in the store", registry=r)
        self.store_bytes_cap = Gauge(
            "kcache_store_bytes_cap", "max_store_bytes (0: unbounded)", registry=r
        )
        self.store_pinned_artifacts = Gauge(
            "kcache_store_pinned_artifacts", "Pinned artifacts (never evicted)", registry=r
        )
        self.store_pinned_bytes = Gauge(
            "kcache_store_pinned_bytes", "Bytes of pinned artifacts", registry=r
        )
        self.evictions = Counter(
            "kcache_evictions",
            "Artifacts this process evicted (least recently used, or removed by an admin)",
            registry=r,
        )
        self.evicted_bytes = Counter(
            "kcache_evicted_bytes", "Bytes of artifacts this process evicted", registry=r
        )
        self.events_ingested = Counter(
            "kcache_audit_events_ingested",
            "Client audit events accepted through POST /v1/events",
            registry=r,
        )
        self.audit_rows_dropped = Counter(
            "kcache_audit_rows_dropped",
            "Audit rows dropped: refused by the database, or the writer's queue was full",
            ["reason"],
            registry=r,
        )
        self.recipe_record_failures = Counter(
            "kcache_recipe_record_failures",
            "Recipe records not written or misses not explained (database errors, full queue)",
            ["operation"],
            registry=r,
        )
        self._samplers: list[Callable[[], None]] = []
        self._loop_metrics: list[LoopCounter | LoopHistogram] = []
        # labels() costs microseconds per call; the hot path counts every warm fetch.
        self._lookup_children: dict[tuple[str, str], Any] = {}

    def lookup(self, outcome: str, tier: str, *, latency_ms: float = 0.0, n: int = 1) -> None:
        """Count ``n`` lookups; a ``compiled`` one also observes its wall time as a compile."""
        child = self._lookup_children.get((outcome, tier))
        if child is None:
            child = self._lookup_children[(outcome, tier)] = self.lookups.labels(
                outcome=outcome, tier=tier
            )
        child.inc(n)
        if outcome == "compiled":
            self.compile_seconds.observe(latency_ms / 1000.0)

    def kernel_lookups(self, lookups: list[dict[str, Any]]) -> None:
        """Count kernel lookups as recorded (``audit_lookups`` rows: ``hit``, ``tier``, ``count``,
        ``saved``, ``outcome``); quick, never raising."""
        for row in lookups:
            source = "server" if row.get("tier") == "server" else "client"
            n = int(row.get("count") or 1)
            result = "hit" if row.get("hit") else "miss"
            self.kernel_lookups_total.labels(result=result, source=source).inc(n)
            if row.get("outcome") in ("hit", "local_hit"):
                self.compiles_avoided.labels(source=source).inc(n)
                self.compile_seconds_saved.labels(source=source).inc(float(row.get("saved") or 0))

    def readiness(self, ready: bool, checks: dict[str, bool]) -> None:
        """Record the readiness checks' result: ready or not, and which checks passed."""
        self.ready.set(1 if ready else 0)
        for name, passed in checks.items():
            self.readiness_checks.labels(check=name).set(1 if passed else 0)

    def recipe_record_failed(self, operation: str) -> None:
        """Count one failure of :mod:`kcache_server.recipe_records` (``record``, ``explain``, ...)."""
        self.recipe_record_failures.labels(operation=operation).inc()

    def loop_counter(self, child: Any) -> LoopCounter:
        """A :class:`LoopCounter` adding to ``child`` (a labelled counter) at every scrape."""
        counter = LoopCounter(child)
        self._loop_metrics.append(counter)
        return counter

    def loop_histogram(self, child: Any) -> LoopHistogram:
        """A :class:`LoopHistogram` adding to ``child`` (a labelled histogram) at every scrape."""
        histogram = LoopHistogram(child)
        self._loop_metrics.append(histogram)
        return histogram

    def add_sampler(self, sampler: Callable[[], None]) -> None:
        """Run ``sampler`` before every scrape (it sets gauges from live state)."""
        self._samplers.append(sampler)

    def render(self) -> bytes:
        """The text exposition format, the fast paths' counts added and gauges refreshed first."""
        for metric in self._loop_metrics:
            metric.flush()
        for sampler in self._samplers:
            sampler()
        if self.worker is None:
            return bytes(generate_latest(self.registry))
        return bytes(generate_latest(_WorkerLabelled(self.registry, self.worker)))


class _WorkerLabelled:
    """A registry's metrics with ``worker="..."`` added to every sample (see the module docstring)."""

    def __init__(self, registry: CollectorRegistry, worker: str) -> None:
        self._registry = registry
        self._worker = worker

    def collect(self) -> Iterator[Metric]:
        """The registry's metric families (made afresh by each collect), relabelled."""
        for family in self._registry.collect():
            family.samples = [
                sample._replace(labels={**sample.labels, "worker": self._worker})
                for sample in family.samples
            ]
            yield family


class LoopCounter:
    """A count kept by the event loop's fast paths without a lock, added to its counter at each scrape.

    A prometheus counter takes a lock on every ``inc``; the warm fetch counts tens of
    thousands of requests a second, and the lock was about a tenth of its Python time.
    Only the event loop's thread calls :meth:`inc` (the fast paths run nowhere else),
    so a plain integer cannot lose an update; :meth:`flush` (``/metrics``, on the same
    thread) adds what was counted since the last flush to the real counter.
    """

    __slots__ = ("_added", "_child", "count")

    def __init__(self, child: Any) -> None:
        self._child = child
        self.count = 0
        self._added = 0

    def inc(self) -> None:
        """One more (from the event loop's thread only)."""
        self.count += 1

    def flush(self) -> None:
        """Add what was counted since the last flush to the counter."""
        count = self.count
        if count != self._added:
            self._child.inc(count - self._added)
            self._added = count


class LoopHistogram:
    """Observations kept by the event loop's fast paths without a lock; see :class:`LoopCounter`.

    Each observation lands in the bucket prometheus would put it in (the first whose
    upper bound is not below it); :meth:`flush` adds the new bucket counts and sum to
    the histogram's own values, so the exposition is the one direct observations give.
    """

    __slots__ = ("_added", "_added_sum", "_bounds", "_child", "counts", "sum")

    def __init__(self, child: Any) -> None:
        self._child = child
        self._bounds: list[float] = list(child._upper_bounds)
        self.counts = [0] * len(self._bounds)
        self.sum = 0.0
        self._added = [0] * len(self._bounds)
        self._added_sum = 0.0

    def observe(self, amount: float) -> None:
        """One more observation (from the event loop's thread only)."""
        self.counts[bisect_left(self._bounds, amount)] += 1
        self.sum += amount

    def flush(self) -> None:
        """Add the observations since the last flush to the histogram."""
        buckets = self._child._buckets
        for i, count in enumerate(self.counts):
            if count != self._added[i]:
                buckets[i].inc(count - self._added[i])
                self._added[i] = count
        total = self.sum
        if total != self._added_sum:
            self._child._sum.inc(total - self._added_sum)
            self._added_sum = total


def store_sampler(db: sa.Engine, metrics: ServerMetrics) -> Callable[[], None]:
    """A sampler setting the store gauges from the artifacts the index knows."""

    def sample() -> None:
        with db.connect() as conn:
            count, size = conn.execute(
                sa.select(sa.func.count(), sa.func.coalesce(sa.func.sum(artifacts_table.c.size), 0))
            ).one()
        metrics.store_artifacts.set(count)
        metrics.store_bytes.set(size)

    return sample


def pool_sampler(compiler: ProcessPoolCompiler, metrics: ServerMetrics) -> Callable[[], None]:
    """A sampler setting the compile pool gauges."""

    def sample() -> None:
        # The pool counts compiles running or queued; beyond its workers they queue.
        pending = compiler.pending
        metrics.compiles_in_flight.set(pending)
        metrics.queue_depth.set(max(0, pending - compiler.workers))

    return sample


def _route_template(scope: dict[str, Any]) -> str:
    route = scope.get("route")
    path = getattr(route, "path", None)
    # Unmatched paths (404 scans) share one label instead of one series each.
    return path if isinstance(path, str) else "(unmatched)"


class MetricsMiddleware:
    """Pure ASGI middleware counting every HTTP request by route template and status."""

    def __init__(self, app: Any, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """Pass the request on, then count it (also when the app raised)."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        async def send_wrapper(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = _route_template(scope)
            self.metrics.requests.labels(
                route=route, method=scope["method"], status=str(status)
            ).inc()
            self.metrics.request_seconds.labels(route=route).observe(time.perf_counter() - started)
