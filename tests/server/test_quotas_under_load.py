"""Quotas hold under load (issue 29, item 1), on two real ``kcache serve`` replicas per backend.

Before, ``QuotaCompiler`` read the usage, compiled, then charged: with a 16 KiB quota one
batch of 40 new recipes charged 72,240 bytes and 40 concurrent single resolves 24,080.
Now a compile reserves room in the database first and settles after (see
:mod:`kcache_server.quotas`), so the charged total of a token never passes its quota,
whether its compiles come as one batch, as concurrent requests, or through both
replicas at once (one database, one data directory; SQLite and PostgreSQL).

The kernels carry 64 distinct bytes of data each, all of one length: their cubins
differ (distinct digests, each charged) and are all the same size ``S``, so exactly
``QUOTA // S`` of them fit, as one-at-a-time resolves would have had it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from tests.support import ServerProcess, pg_database, unique, upgrade

QUOTA = 16 << 10
N = 40
TOKENS = ("single", "batch", "fail")


def sized(tag: str) -> dict[str, Any]:
    """A kernel whose cubin has 64 bytes of data of its own; every one is the same size."""
    seed = hashlib.sha256(tag.encode()).hexdigest()
    return {
        "source": (
            f'extern "C" __device__ const char kc_tag[65] = "{seed}";\n'
            'extern "C" __global__ void vtag(float* out, const float* a, int n) {\n'
            "  int i = blockIdx.x * blockDim.x + threadIdx.x;\n"
            "  if (i < n) out[i] = a[i] + kc_tag[i % 64];\n"
            "}\n"
        ),
        "target": "sm_80",
    }


@dataclass
class Replicas:
    """Two replicas on one database and one data directory, and a token per test."""

    urls: list[str]
    db_url: str
    tokens: dict[str, str]

    def client(self, i: int, token: str) -> httpx.Client:
        return httpx.Client(
            base_url=self.urls[i % len(self.urls)],
            headers={"Authorization": f"Bearer {self.tokens[token]}"},
            timeout=300,
        )

    def charged(self, token: str) -> int:
        """What the database charges the token for: stored artifacts it caused to be compiled."""
        from kcache_server.quotas import stored_bytes_of

        engine = sa.create_engine(self.db_url, poolclass=sa.pool.NullPool)
        try:
            return stored_bytes_of(engine, f"token:{token}")
        finally:
            engine.dispose()

    def reservations(self, token: str) -> int:
        engine = sa.create_engine(self.db_url, poolclass=sa.pool.NullPool)
        try:
            with engine.connect() as conn:
                return int(
                    conn.execute(
                        sa.text("SELECT COUNT(*) FROM quota_reservations WHERE caller = :c"),
                        {"c": f"token:{token}"},
                    ).scalar_one()
                )
        finally:
            engine.dispose()


@pytest.fixture(
    scope="module", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def replicas(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Replicas]:
    """Two ``kcache serve`` processes with ``KCACHE_TOKEN_QUOTA_BYTES=16KiB``, once per backend."""
    from kcache_server.auth import TokenStore
    from kcache_server.db import open_database

    root = tmp_path_factory.mktemp(f"quota-{request.param}")
    data = root / "data"
    data.mkdir()
    with contextlib.ExitStack() as stack:
        if request.param == "sqlite":
            db_url = f"sqlite:///{data / 'kcache.db'}"
        else:
            db_url = stack.enter_context(pg_database())
        upgrade(db_url)
        engine = open_database(db_url)
        store = TokenStore(engine)
        tokens = {name: store.create(name, ["compile"]) for name in TOKENS}
        engine.dispose()
        env = {
            **os.environ,
            "KCACHE_TOKEN_QUOTA_BYTES": str(QUOTA),
            "KCACHE_COMPILE_WORKERS": "2",
            # Every compile of the test waits its turn rather than being refused as overload.
            "KCACHE_COMPILE_QUEUE_LIMIT": "256",
            "KCACHE_COMPILE_CALLER_QUEUE_LIMIT": "128",
            "KCACHE_AUDIT_FLUSH_S": "0.1",
        }
        procs = [
            ServerProcess(data, db_url=db_url, env=env, log=root / f"serve-{i}.log")
            for i in range(2)
        ]
        for proc in procs:
            stack.callback(proc.stop)
            proc.launch()
        for proc in procs:
            proc.wait_ready()
        yield Replicas([p.url for p in procs], db_url, tokens)


def _tally(results: list[dict[str, Any]]) -> tuple[Counter[str], set[int]]:
    """Outcomes (``compiled`` or the error code) and the sizes of what was compiled."""
    outcomes: Counter[str] = Counter()
    sizes: set[int] = set()
    for result in results:
        if result.get("status") == "compiled":
            outcomes["compiled"] += 1
            sizes.add(result["artifact"]["size"])
        else:
            outcomes[result.get("error", result.get("status", "?"))] += 1
    return outcomes, sizes


def _holds_exactly(replicas: Replicas, token: str, outcomes: Counter[str], sizes: set[int]) -> None:
    assert set(outcomes) <= {"compiled", "quota_exceeded"}, outcomes
    assert len(sizes) == 1, sizes  # the premise: every cubin is one size
    (size,) = sizes
    charged = replicas.charged(token)
    assert charged <= QUOTA, (charged, outcomes)  # never past the quota ...
    assert outcomes["compiled"] == QUOTA // size, (outcomes, size)  # ... and no fewer than fit
    assert charged == outcomes["compiled"] * size
    assert replicas.reservations(token) == 0  # every reservation settled or released


def test_concurrent_single_resolves_through_two_replicas_never_pass_the_quota(
    replicas: Replicas,
) -> None:
    tag = unique("single")

    def resolve(i: int) -> dict[str, Any]:
        with replicas.client(i, "single") as client:
            answer = client.post("/v1/resolve", json={"recipe": sized(f"{tag}-{i}")})
        assert answer.status_code in (200, 507), answer.text
        body: dict[str, Any] = answer.json()
        return body

    with ThreadPoolExecutor(max_workers=N) as pool:
        results = list(pool.map(resolve, range(N)))
    _holds_exactly(replicas, "single", *_tally(results))


def test_one_batch_never_passes_the_quota(replicas: Replicas) -> None:
    tag = unique("batch")
    with replicas.client(0, "batch") as client:
        answer = client.post(
            "/v1/resolve/batch", json={"recipes": [sized(f"{tag}-{i}") for i in range(N)]}
        )
    assert answer.status_code == 200, answer.text
    _holds_exactly(replicas, "batch", *_tally(answer.json()["results"]))


def test_failed_compiles_give_their_reservations_back(replicas: Replicas) -> None:
    tag = unique("fail")
    broken = [
        {"source": f"// {tag}-{i}\n__global__ void k() {{ undeclared(); }}\n", "target": "sm_80"}
        for i in range(6)
    ]

    def resolve(i: int) -> int:
        with replicas.client(i, "fail") as client:
            return client.post("/v1/resolve", json={"recipe": broken[i]}).status_code

    with ThreadPoolExecutor(max_workers=len(broken)) as pool:
        assert set(pool.map(resolve, range(len(broken)))) == {422}
    assert replicas.reservations("fail") == 0 and replicas.charged("fail") == 0
    # All of the quota is still there: as many kernels as fit compile, one at a time.
    outcomes: Counter[str] = Counter()
    sizes: set[int] = set()
    with replicas.client(0, "fail") as client:
        for i in range(N):
            body = client.post("/v1/resolve", json={"recipe": sized(f"{tag}-ok-{i}")}).json()
            more, seen = _tally([body])
            outcomes += more
            sizes |= seen
            if more["quota_exceeded"]:
                break
    (size,) = sizes
    assert outcomes == {"compiled": QUOTA // size, "quota_exceeded": 1}
