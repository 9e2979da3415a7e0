"""Two replicas behind nginx, sharing no filesystem: single flight through the balancer, and a
replica SIGKILLed (then restarted) under a client workload without one failed call.

Real parts: Debian's nginx (``nginx-light``, installed by ``scripts/ensure-services``)
as the load balancer, two ``kcache serve`` processes on one PostgreSQL database with
data directories of their own, blobs in a bucket on moto's S3 server, and the real
client (``KernelCache`` with its default retry policy) sending through nginx.

nginx retries a request on the other replica when the first cannot be reached, resets
or answers 502/503 (``proxy_next_upstream``); for ``POST /v1/resolve`` even after the
request was sent (``non_idempotent``), because a resolve is safe to repeat: a repeated
compile joins the first or finds its result. What nginx cannot carry (both tries
failed), the client's retries do.
"""

from __future__ import annotations

import hashlib
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from kcache_client import ClientSettings, KernelCache

from kcache.recipe import Recipe
from kcache.store.s3 import S3ArtifactStore
from tests.s3_server import S3Server, s3_server
from tests.support import (
    NGINX,
    NginxProcess,
    ServerProcess,
    full_runs,
    pg_database,
    unique,
    upgrade,
)

pytestmark = pytest.mark.postgres

#: The killed-replica workload's phases, in seconds: before the kill, with the replica
#: down, and in all. The issue's acceptance (30 s in all) is the --slow run's; by default
#: a shorter run of the same phases.
BEFORE_KILL_S, DOWN_S, WORKLOAD_S = (5.0, 10.0, 30.0) if full_runs() else (2.0, 4.0, 10.0)


_CONFIG = """\
daemon off;
worker_processes 1;
pid {root}/nginx.pid;
error_log {root}/error.log warn;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    client_body_temp_path {root}/body;
    proxy_temp_path {root}/proxy;
    fastcgi_temp_path {root}/fastcgi;
    uwsgi_temp_path {root}/uwsgi;
    scgi_temp_path {root}/scgi;
    client_max_body_size 64m;
    upstream kcache {{
        # One failure takes a replica out for 2 s; then nginx tries it again.
{servers}
        keepalive 32;
    }}
    server {{
        listen 127.0.0.1:{port};
        proxy_http_version 1.1;
        proxy_set_header Connection "";
        proxy_connect_timeout 2s;
        proxy_read_timeout 300s;
        proxy_next_upstream error timeout http_502 http_503;
        location / {{
            proxy_pass http://kcache;
        }}
        # Resolves are safe to repeat (they join or find the first compile): retried on
        # the other replica even once sent. Other POSTs (audit events) are not repeated.
        location /v1/resolve {{
            proxy_pass http://kcache;
            proxy_next_upstream error timeout http_502 http_503 non_idempotent;
        }}
    }}
}}
"""


class Nginx(NginxProcess):
    """nginx in the foreground with a generated config, balancing over ``upstreams``."""

    def __init__(self, root: Path, upstreams: list[str]) -> None:
        super().__init__(root)
        servers = "\n".join(
            f"        server {u.removeprefix('http://')} max_fails=1 fail_timeout=2s;"
            for u in upstreams
        )
        self.config.write_text(_CONFIG.format(root=root, servers=servers, port=self.port))
        self.start()


@dataclass
class Topology:
    """nginx in front of two replicas (each its own data dir), PostgreSQL, one bucket."""

    nginx: Nginx
    replicas: list[ServerProcess]
    bucket: S3ArtifactStore
    root: Path
    known: dict[str, str] = field(default_factory=dict)  # recipe_key -> digest


def _bucket(server: S3Server, store_url: str) -> S3ArtifactStore:
    return S3ArtifactStore.from_url(
        store_url,
        endpoint_url=server.endpoint,
        access_key_id=server.env["AWS_ACCESS_KEY_ID"],
        secret_access_key=server.env["AWS_SECRET_ACCESS_KEY"],
    )


@pytest.fixture(scope="module")
def topology(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Topology]:
    if not Path(NGINX).exists():
        pytest.skip(
            f"no nginx at {NGINX}: scripts/ensure-services installs Debian's nginx-light "
            "(or set KCACHE_TEST_NGINX)"
        )
    server = s3_server()
    with pg_database("kcache_lb") as db_url:
        upgrade(db_url)
        root = tmp_path_factory.mktemp("balanced")
        store_url = f"s3://{server.new_bucket()}/kcache"
        env = {
            **os.environ,
            **server.env,
            "KCACHE_STORE_URL": store_url,
            "KCACHE_COMPILE_WORKERS": "1",
            "KCACHE_AUDIT_FLUSH_S": "0.2",
        }
        replicas = [ServerProcess(root / n, db_url=db_url, env=env) for n in ("a", "b")]
        nginx: Nginx | None = None
        try:
            for replica in replicas:
                replica.launch()
            for replica in replicas:
                replica.wait_ready()
            nginx = Nginx(root / "nginx", [r.url for r in replicas])
            yield Topology(nginx, replicas, _bucket(server, store_url), root)
        finally:
            if nginx is not None:
                nginx.stop()
            for replica in replicas:
                replica.stop()


def _compiles(replicas: list[ServerProcess]) -> float:
    """Compiles counted by the replicas' /metrics (``kcache_lookups_total{outcome="compiled"}``)."""
    total = 0.0
    for replica in replicas:
        for line in httpx.get(f"{replica.url}/metrics", timeout=30).text.splitlines():
            if line.startswith("kcache_lookups_total{") and 'outcome="compiled"' in line:
                total += float(line.rsplit(" ", 1)[1])
    return total


def _distinct(tag: str) -> dict[str, Any]:
    """A recipe whose cubin differs from every other test's (the bias is in the code)."""
    bias = int.from_bytes(os.urandom(3), "little")
    return {
        "source": (
            f'extern "C" __global__ void lb(float* out, const float* a, int n) {{  // {tag}\n'
            "  int i = blockIdx.x * blockDim.x + threadIdx.x;\n"
            f"  if (i < n) out[i] = a[i] * {bias}.0f;\n}}\n"
        ),
        "target": "sm_80",
    }


def test_64_identical_misses_through_nginx_compile_once_and_store_one_object(
    topology: Topology,
) -> None:
    before_objects = set(topology.bucket.digests())
    before_compiles = _compiles(topology.replicas)
    recipe = _distinct(unique("flight"))

    def ask(_: int) -> httpx.Response:
        return httpx.post(f"{topology.nginx.url}/v1/resolve", json={"recipe": recipe}, timeout=180)

    with ThreadPoolExecutor(max_workers=64) as pool:
        answers = list(pool.map(ask, range(64)))
    assert all(r.status_code == 200 for r in answers), [r.text for r in answers if r.status_code]
    statuses = Counter(r.json()["status"] for r in answers)
    assert statuses["compiled"] == 1 and sum(statuses.values()) == 64, statuses
    digests = {r.json()["artifact"]["digest"] for r in answers}
    assert len(digests) == 1
    assert set(topology.bucket.digests()) - before_objects == digests  # one object uploaded
    assert _compiles(topology.replicas) - before_compiles == 1  # and one compile, by the metrics
    # Both replicas took part (nginx spread them), so the flight was across replicas.
    answered_by = Counter(r.headers.get("x-request-id", "")[:12] for r in answers)
    assert len(answered_by) >= 2, answered_by
    topology.known[answers[0].json()["recipe_key"]] = digests.pop()


@dataclass
class Workload:
    """Client calls through nginx from several threads; every failure is kept."""

    url: str
    root: Path
    warm: list[tuple[Recipe, str]]  # (recipe, digest)
    stop: threading.Event = field(default_factory=threading.Event)
    failures: list[str] = field(default_factory=list)
    done: Counter[str] = field(default_factory=Counter)
    compiled: dict[str, str] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def client(self) -> KernelCache:
        """A fresh client (empty memory and node tier), so each call goes to the server."""
        settings = ClientSettings.from_env(
            url=self.url, cache_dir=self.root / unique("tier"), send_events=False
        )
        return KernelCache(settings=settings)

    def run(self, worker: int) -> None:
        n = 0
        while not self.stop.is_set():
            kind = ("fetch", "resolve", "fetch", "compile" if n % 8 == 7 else "resolve")[n % 4]
            recipe, digest = self.warm[(worker + n) % len(self.warm)]
            if kind == "compile":
                recipe, digest = Recipe.from_dict(_distinct(unique(f"w{worker}"))), ""
            n += 1
            try:
                with self.client() as cache:
                    art = cache.get(recipe, refresh=(kind == "resolve"))
                if hashlib.sha256(art.data).hexdigest() != art.digest or (
                    digest and art.digest != digest
                ):
                    raise AssertionError(f"{kind}: wrong bytes for {art.recipe_key}")
                with self.lock:
                    self.done[kind] += 1
                    if kind == "compile":
                        self.compiled[art.recipe_key] = art.digest
            except Exception as exc:  # every failure is the test's finding, not a crash
                with self.lock:
                    self.failures.append(f"{kind}: {type(exc).__name__}: {exc}")


def test_a_replica_killed_and_restarted_under_load_costs_no_client_call(
    topology: Topology,
) -> None:
    url = topology.nginx.url
    victim = topology.replicas[0]
    warm: list[tuple[Recipe, str]] = []
    known = dict(topology.known)
    for i in range(4):
        body = _distinct(unique(f"warm{i}"))
        answer = httpx.post(f"{url}/v1/resolve", json={"recipe": body}, timeout=180)
        assert answer.status_code == 200, answer.text
        warm.append((Recipe.from_dict(body), answer.json()["artifact"]["digest"]))
        known[answer.json()["recipe_key"]] = answer.json()["artifact"]["digest"]
    work = Workload(url, topology.root / "clients", warm)
    threads = [threading.Thread(target=work.run, args=(w,)) for w in range(6)]
    for thread in threads:
        thread.start()
    started = time.monotonic()
    try:
        time.sleep(BEFORE_KILL_S)
        assert victim.proc is not None
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait(10)
        at_kill = sum(work.done.values())
        time.sleep(DOWN_S)
        during = sum(work.done.values()) - at_kill
        victim.launch()  # the same port and data dir, as a restarted pod or unit would be
        victim.wait_ready()
        # The workload runs WORKLOAD_S in all (30 s, as the acceptance has it, in a
        # --slow run), and some seconds with both replicas back.
        time.sleep(max(BEFORE_KILL_S, WORKLOAD_S - (time.monotonic() - started)))
    finally:
        work.stop.set()
        for thread in threads:
            thread.join(120)
    assert work.failures == [], work.failures[:5]
    assert during > 0, "no client call completed while a replica was down"
    assert work.done["fetch"] and work.done["resolve"] and work.done["compile"], work.done
    # Every artifact verifies afterwards, from each replica and in the bucket (the
    # restarted replica fills from the bucket what was compiled while it was down).
    known.update(work.compiled)
    objects = set(topology.bucket.digests())
    for key, digest in known.items():
        assert digest in objects
        assert hashlib.sha256(topology.bucket.get(digest)).hexdigest() == digest
        for replica in topology.replicas:
            fetched = httpx.get(f"{replica.url}/v1/recipes/{key}/artifact", timeout=60)
            assert fetched.status_code == 200, fetched.text
            assert hashlib.sha256(fetched.content).hexdigest() == digest
