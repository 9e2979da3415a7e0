"""Bounded server storage (issue 12): the byte cap with LRU eviction, pins, quotas, on real servers.

Kernels are vector adds carrying a 48 KiB string, so each cubin is about 53 KB and
about 60 of them overflow a 2 MiB cap; NVRTC compiles one in a few tens of ms. Blobs
live in the data directory, in an S3 bucket, or in a backend only these tests know
(:mod:`tests.memory_store`), which the server evicts through all the same.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from kcache_server.index import SqlIndex

from tests.support import KCACHE, ServerProcess, ServerThread, unique, upgrade, wait_until

CAP = 2 << 20
HIGH, LOW = 0.9, 0.7
PAD = 48 << 10
#: The settings of a capped server, over the test servers' own (``make_settings``).
CAPPED: dict[str, Any] = {
    "max_store_bytes": CAP,
    "store_high_water": HIGH,
    "store_low_water": LOW,
    "eviction_interval_s": 1.0,
    "eviction_blob_grace_s": 0.5,
}


def padded(tag: str) -> dict[str, Any]:
    """A vector add whose cubin carries ``PAD`` bytes of initialised data (about 53 KB in all)."""
    seed = hashlib.sha256(tag.encode()).hexdigest()  # distinct bytes per tag: distinct digests
    text = (seed * (PAD // len(seed) + 1))[:PAD]
    return {
        "source": (
            f"// {tag}\n"
            f'extern "C" __device__ const char kc_pad[{PAD + 1}] = "{text}";\n'
            'extern "C" __global__ void vadd(float* out, const float* a, const float* b, int n) {\n'
            "  int i = blockIdx.x * blockDim.x + threadIdx.x;\n"
            "  if (i < n) out[i] = a[i] + b[i] + kc_pad[i % 7];\n"
            "}\n"
        ),
        "target": "sm_80",
    }


def verify(data_dir: Path, db_url: str) -> dict[str, Any]:
    """`kcache verify` of a server's data directory: every blob re-hashed, every row's blob present."""
    done = subprocess.run(
        [KCACHE, "verify", "--data-dir", str(data_dir), "--db-url", db_url],
        capture_output=True,
        text=True,
        timeout=120,
    )
    report: dict[str, Any] = json.loads(done.stdout)
    assert done.returncode == 0, (report, done.stderr)
    return report


def metric(text: str, name: str) -> float:
    """The value of an unlabelled sample in Prometheus text."""
    found = re.search(rf"^{name} (\S+)$", text, re.M)
    assert found is not None, name
    return float(found.group(1))


@pytest.fixture
def server(make_settings: Callable[..., Any], serve: Callable[[Any], ServerThread]) -> ServerThread:
    """A capped server on SQLite (open: loopback, no tokens yet)."""
    return serve(make_settings(**CAPPED))


def _info(client: httpx.Client) -> dict[str, Any]:
    response = client.get("/v1/cache")
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def test_cap_holds_recent_stay_pinned_survive_evicted_recompile(server: ServerThread) -> None:
    tag = unique("lru")
    recipes = [padded(f"{tag}-{i}") for i in range(60)]
    high = int(CAP * HIGH)
    keys: dict[int, str] = {}
    digests: dict[int, str] = {}
    sizes: dict[int, int] = {}
    statuses: Counter[str] = Counter()
    with server.client() as client:

        def resolve(i: int, compile: bool = True) -> httpx.Response:
            response = client.post("/v1/resolve", json={"recipe": recipes[i], "compile": compile})
            if response.status_code == 200:
                body = response.json()
                keys[i] = body["recipe_key"]
                assert (
                    digests.setdefault(i, body["artifact"]["digest"]) == body["artifact"]["digest"]
                )
                sizes[i] = body["artifact"]["size"]
                statuses[body["status"]] += 1
            return response

        # Three kernels a release needs: compiled first, pinned, never used again.
        pinned = [0, 1, 2]
        for i in pinned:
            assert resolve(i).json()["status"] == "compiled"
        answer = client.post(
            "/v1/pins", json={"recipe_keys": [keys[i] for i in pinned], "group": "release-1"}
        )
        assert answer.status_code == 200 and answer.json() == {"requested": 3, "pinned": 3}

        # The rest in a random order, each followed by repeats of recently used ones.
        rng = random.Random(12)
        order = list(range(3, 60))
        rng.shuffle(order)
        recent: list[int] = []
        for i in order:
            assert resolve(i).status_code == 200
            recent = [j for j in recent if j != i] + [i]
            for j in rng.sample(recent[-6:], min(3, len(recent))):
                response = resolve(j)
                assert response.status_code == 200 and response.json()["status"] in (
                    "hit",
                    "compiled",
                )
                recent = [k for k in recent if k != j] + [j]
            # Over the high-water mark for at most one pass: the compile woke the evictor.
            wait_until(
                lambda: _info(client)["bytes_used"] <= high,
                "the store back under its high-water mark",
            )

        info = _info(client)
        assert info["bytes_cap"] == CAP and info["high_water_bytes"] == high
        assert info["pinned_artifacts"] == 3 and info["pins"] == 3
        assert info["evictions"] > 0 and info["bytes_freed"] > 0
        assert (
            int(CAP * LOW) - 60_000 <= info["bytes_used"] <= high
        )  # evicted down near the low mark

        # The most recently used stay hits (without compiling).
        for i in recent[-10:]:
            response = resolve(i, compile=False)
            assert response.status_code == 200 and response.json()["status"] == "hit", i
        # Pinned ones survived all that pressure although nobody used them since.
        for i in pinned:
            response = resolve(i, compile=False)
            assert response.status_code == 200 and response.json()["status"] == "hit", i
        # An evicted recipe is a plain miss, by key and by resolve, and comes back compiled.
        evicted = [i for i in order[:10] if i not in recent[-10:]]
        gone = next(
            i for i in evicted if client.get(f"/v1/recipes/{keys[i]}/artifact").status_code == 404
        )
        assert resolve(gone, compile=False).status_code == 404
        again = resolve(gone)
        assert (
            again.json()["status"] == "compiled"
            and again.json()["artifact"]["digest"] == digests[gone]
        )

        stats = client.get("/v1/stats").json()["store"]
        assert stats["bytes_cap"] == CAP and stats["evictions"] == info["evictions"]
        assert stats["bytes_freed"] == info["bytes_freed"] and stats["pinned_artifacts"] == 3
        metrics = client.get("/metrics").text
        assert metric(metrics, "kcache_store_bytes_cap") == CAP
        assert metric(metrics, "kcache_store_pinned_artifacts") == 3
        assert metric(metrics, "kcache_evictions_total") == info["evictions"]
        assert metric(metrics, "kcache_evicted_bytes_total") == info["bytes_freed"]
    assert statuses["compiled"] > 60  # evicted kernels that were asked for again compiled again
    assert sum(sizes.values()) > 1.4 * CAP  # far more was compiled than the cap holds
    report = verify(server.settings.data_dir, server.settings.database_url)
    assert report["missing"] == [] and report["corrupt"] == [] and report["checked"] > 20


def test_fetch_path_memory_never_serves_an_evicted_artifact(server: ServerThread) -> None:
    recipe = padded(unique("fast"))
    with server.client() as client:
        body = client.post("/v1/resolve", json={"recipe": recipe}).json()
        key, digest = body["recipe_key"], body["artifact"]["digest"]
        for _ in range(2):  # the second is answered by the fast path from memory
            fetched = client.get(f"/v1/recipes/{key}/artifact")
            assert (
                fetched.status_code == 200 and hashlib.sha256(fetched.content).hexdigest() == digest
            )
        assert server.state.resolver.cached_blob(digest) is not None
        removed = client.post("/v1/cache/remove", json={"keys": [key]}).json()
        assert removed["evicted"] == 1 and removed["pinned"] == [] and removed["unknown"] == []
        assert server.state.resolver.cached_blob(digest) is None
        assert client.get(f"/v1/recipes/{key}/artifact").status_code == 404
        assert client.get(f"/v1/recipes/{key}").status_code == 404
        assert (
            client.post("/v1/resolve", json={"recipe": recipe, "compile": False}).status_code == 404
        )
    wait_until(lambda: not server.state.backends.store.has(digest), "the evicted blob deleted")


def test_pins_are_listed_removable_and_block_removal(server: ServerThread) -> None:
    recipe = padded(unique("pin"))
    with server.client() as client:
        key = client.post("/v1/resolve", json={"recipe": recipe}).json()["recipe_key"]
        never_compiled = hashlib.sha256(unique("future").encode()).hexdigest()
        assert (
            client.post(
                "/v1/pins", json={"recipe_keys": [key, never_compiled], "group": "g2"}
            ).json()["pinned"]
            == 2
        )
        assert (
            client.post("/v1/pins", json={"recipe_keys": [key], "group": "g2"}).json()["pinned"]
            == 0
        )
        listed = {
            p["recipe_key"]: p
            for p in client.get("/v1/pins", params={"group": "g2"}).json()["pins"]
        }
        assert set(listed) == {key, never_compiled}
        assert listed[key]["size"] is not None and listed[never_compiled]["digest"] is None
        refused = client.post("/v1/cache/remove", json={"keys": [key]}).json()
        assert refused["evicted"] == 0 and refused["pinned"] == [key]
        # Bad input is named precisely.
        bad = client.post("/v1/pins", json={"recipe_keys": ["ABC"]})
        assert bad.status_code == 422 and bad.json()["field"] == "recipe_keys[0]"
        bad = client.post("/v1/pins", json={"recipe_keys": [key], "group": "x\x1b[31m"})
        assert bad.status_code == 422 and bad.json()["field"] == "group"
        # A stored artifact's digest is not a recipe key: pinning it would protect nothing.
        digest = listed[key]["digest"]
        bad = client.post("/v1/pins", json={"recipe_keys": [never_compiled, digest]})
        assert bad.status_code == 422 and bad.json()["field"] == "recipe_keys"
        assert f"{digest} is the digest of a stored artifact" in bad.json()["detail"]
        assert key in bad.json()["detail"]  # the recipe key to pin instead
        # A DELETE naming neither keys nor a group removes nothing (never the whole list).
        assert client.delete("/v1/pins").json() == {"unpinned": 0}
        assert client.delete("/v1/pins", params={"group": "g2"}).json() == {"unpinned": 2}
        assert client.post("/v1/cache/remove", json={"keys": [key]}).json()["evicted"] == 1


def kcache(*args: str) -> subprocess.CompletedProcess[str]:
    """The real ``kcache`` command (no server or token from the environment)."""
    env = {k: v for k, v in os.environ.items() if k not in ("KCACHE_URL", "KCACHE_TOKEN")}
    return subprocess.run([KCACHE, *args], capture_output=True, text=True, env=env, timeout=60)


def test_cli_pins_and_server_cache(server: ServerThread) -> None:
    """`kcache pin`, `kcache cache info|ls --server` and `kcache stats` show what the API holds."""
    with server.client() as client:
        key = client.post("/v1/resolve", json={"recipe": padded(unique("cli"))}).json()[
            "recipe_key"
        ]
    pinned = kcache("pin", key, "--group", "cli-release", "--server", server.url)
    assert pinned.returncode == 0 and "pinned 1 recipe keys in group cli-release" in pinned.stdout
    listed = json.loads(
        kcache("pin", "--list", "--group", "cli-release", "--server", server.url, "--json").stdout
    )
    assert [p["recipe_key"] for p in listed["pins"]] == [key]
    info = kcache("cache", "info", "--server", server.url, "--json")
    body = json.loads(info.stdout)
    assert body["bytes_cap"] == CAP and body["pinned_artifacts"] >= 1
    ls = kcache("cache", "ls", "--server", server.url, "--limit", "5")
    assert ls.returncode == 0 and key[:16] in ls.stdout and "pinned" in ls.stdout
    stats = kcache("stats", "--server", server.url)
    assert stats.returncode == 0 and "of 2.0 MiB" in stats.stdout, stats.stdout + stats.stderr
    typo = kcache("unpin", "--group", "cli-relaese", "--server", server.url)  # unpins nothing
    assert typo.returncode != 0 and "the groups: cli-release" in typo.stderr, typo.stderr
    unpinned = kcache("unpin", "--group", "cli-release", "--server", server.url)
    assert unpinned.returncode == 0 and "unpinned 1" in unpinned.stdout
    bad = kcache("pin", "not-a-key", "--server", server.url)
    assert bad.returncode != 0 and "not a recipe key" in bad.stderr
    digest = listed["pins"][0]["digest"]
    for given, said in (
        (digest, "is the digest of a stored artifact"),
        (digest[:12], "begins no recipe key"),
    ):
        bad = kcache("pin", given, "--server", server.url)  # a whole digest, or the start of one
        assert bad.returncode != 0 and said in bad.stderr and "Traceback" not in bad.stderr, (
            bad.stderr
        )
    assert (
        json.loads(kcache("pin", "--list", "--server", server.url, "--json").stdout)["pins"] == []
    )


def test_admin_scope_and_per_token_quota(
    make_settings: Callable[..., Any], serve: Callable[[Any], ServerThread]
) -> None:
    """Pins and store maintenance need admin; a token's compiles stop at its quota (507)."""
    settings = make_settings(**CAPPED, token_quota_bytes=120_000)
    subprocess.run(
        [KCACHE, "db", "upgrade", "--data-dir", str(settings.data_dir)],
        check=True,
        capture_output=True,
    )

    def token(name: str, scope: str) -> str:
        made = subprocess.run(
            [
                KCACHE,
                "token",
                "create",
                name,
                "--scope",
                scope,
                "--data-dir",
                str(settings.data_dir),
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        return made.stdout.strip()

    admin, ci, other = token("ops", "admin"), token("ci", "compile"), token("dev", "compile")
    server = serve(settings)
    with server.client(ci) as client:
        assert client.get("/v1/pins").status_code == 403
        assert client.get("/v1/cache").status_code == 403
        assert client.post("/v1/cache/clear").status_code == 403
        first = client.post("/v1/resolve", json={"recipe": padded(unique("q1"))}).json()
        assert client.post("/v1/resolve", json={"recipe": padded(unique("q2"))}).status_code == 200
        # 2 x 53 KB stored; a third would take "ci" past 120 KB: refused, nothing stored.
        refused = client.post("/v1/resolve", json={"recipe": padded(unique("q3"))})
        assert refused.status_code == 507 and refused.json()["error"] == "quota_exceeded"
        assert (
            "token ci" in refused.json()["detail"]
            and "token_quota_bytes" in refused.json()["detail"]
        )
        # Over it now, so the next is refused before compiling; hits are still served.
        assert client.post("/v1/resolve", json={"recipe": padded(unique("q4"))}).status_code == 507
        assert client.get(f"/v1/recipes/{first['recipe_key']}/artifact").status_code == 200
    with server.client(other) as client:  # another token has its own quota
        assert client.post("/v1/resolve", json={"recipe": padded(unique("q5"))}).status_code == 200
    with server.client(admin) as client:
        assert _info(client)["artifacts"] == 3
        cleared = client.post("/v1/cache/clear").json()
        assert cleared["evicted"] == 3
    with server.client(ci) as client:  # evicted bytes no longer count against the quota
        again = client.post("/v1/resolve", json={"recipe": padded(unique("q6"))})
        assert again.status_code == 200 and again.json()["status"] == "compiled"


def test_evicted_blob_leaves_the_bucket(
    make_settings: Callable[..., Any],
    serve: Callable[[Any], ServerThread],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With blobs in an S3 bucket, an evicted artifact's object is deleted after the grace."""
    from kcache.store.s3 import S3ArtifactStore
    from tests.s3_server import s3_server

    bucket_server = s3_server()
    for name, value in bucket_server.env.items():
        monkeypatch.setenv(name, value)
    store_url = f"s3://{bucket_server.new_bucket()}/blobs"
    bucket = S3ArtifactStore.from_url(store_url)
    server = serve(make_settings(**CAPPED, store_url=store_url))
    with server.client() as client:
        kept = client.post("/v1/resolve", json={"recipe": padded(unique("s3k"))}).json()
        gone = client.post("/v1/resolve", json={"recipe": padded(unique("s3g"))}).json()
        assert bucket.has(gone["artifact"]["digest"]) and bucket.has(kept["artifact"]["digest"])
        removed = client.post("/v1/cache/remove", json={"keys": [gone["recipe_key"]]}).json()
        assert removed["evicted"] == 1
        wait_until(lambda: not bucket.has(gone["artifact"]["digest"]), "the object deleted")
        assert bucket.has(kept["artifact"]["digest"])
        assert client.get(f"/v1/recipes/{gone['recipe_key']}/artifact").status_code == 404
        again = client.post("/v1/resolve", json={"recipe": padded(unique("s3k"))})
        assert again.status_code == 200


def test_a_new_blob_backend_is_one_line_and_the_server_evicts_through_it(
    make_settings: Callable[..., Any],
    serve: Callable[[Any], ServerThread],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A backend no server module names (tests/memory_store.py), plugged in with one line.

    The server serves from it, asks it whether it is ready, and evicts through it: rows
    first, then the objects once the grace is over, every row still naming a blob.
    """
    from kcache.store import STORE_URL_SCHEMES
    from tests.memory_store import MEMORY_BACKEND, MemoryArtifactStore

    monkeypatch.setitem(STORE_URL_SCHEMES, "mem", MEMORY_BACKEND)  # the one line
    name = unique("evict")
    bucket = MemoryArtifactStore(name)
    server = serve(make_settings(**CAPPED, store_url=f"mem://{name}"))
    index = server.state.backends.index
    tag = unique("mem")
    recipes = [padded(f"{tag}-{i}") for i in range(45)]
    keys: dict[int, str] = {}
    digests: dict[int, str] = {}
    with server.client() as client:
        ready = client.get("/readyz")
        assert ready.status_code == 200, ready.text
        assert ready.json()["checks"]["bucket"] == "ok"
        for i, recipe in enumerate(recipes):
            body = client.post("/v1/resolve", json={"recipe": recipe}).json()
            keys[i], digests[i] = body["recipe_key"], body["artifact"]["digest"]
            assert digests[i] in bucket.objects  # published to the backend first
        wait_until(lambda: _info(client)["bytes_used"] <= int(CAP * HIGH), "a pass")
        info = _info(client)
        assert info["evictions"] > 0 and info["bytes_used"] >= int(CAP * LOW) - 60_000
        # Evicted objects leave the backend once their grace is over; named ones stay.
        wait_until(
            lambda: set(bucket.digests()) == index.digests(),
            "the backend to hold exactly the blobs rows name",
        )
        evicted = [i for i in keys if digests[i] not in bucket.objects]
        assert evicted == list(range(len(evicted)))  # the least recently used went
        # The most recent is served (from the replica's local copy, verified).
        fetched = client.get(f"/v1/recipes/{keys[44]}/artifact")
        assert fetched.status_code == 200
        assert hashlib.sha256(fetched.content).hexdigest() == digests[44]
        # An evicted recipe is a miss, compiled again into the backend.
        assert client.get(f"/v1/recipes/{keys[evicted[0]]}/artifact").status_code == 404
        again = client.post("/v1/resolve", json={"recipe": recipes[evicted[0]]}).json()
        assert again["status"] == "compiled" and digests[evicted[0]] in bucket.objects
        # An admin removal goes through the same blob protocol.
        removed = client.post("/v1/cache/remove", json={"keys": [keys[44]]}).json()
        assert removed["evicted"] == 1
        wait_until(lambda: digests[44] not in bucket.objects, "the removed object deleted")
        # The backend's own probe is the readiness check of the store behind the replica.
        bucket.set_down(True)
        try:
            wait_until(
                lambda: client.get("/readyz").json()["checks"]["bucket"].startswith("failed"),
                "readiness to see the backend down",
            )
        finally:
            bucket.set_down(False)


# ---------------------------------------------------------------------- two replicas
def _replica(data_dir: Path, db_url: str) -> ServerProcess:
    """``kcache serve`` capped at 2 MiB on the shared data directory and database."""
    env = {
        **os.environ,
        "KCACHE_COMPILE_WORKERS": "1",
        "KCACHE_AUDIT_FLUSH_S": "0.1",
        "KCACHE_STORE_HIGH_WATER": str(HIGH),
        "KCACHE_STORE_LOW_WATER": str(LOW),
        "KCACHE_EVICTION_INTERVAL_S": "1",
        "KCACHE_EVICTION_BLOB_GRACE_S": "0.5",
    }
    return ServerProcess(data_dir, db_url=db_url, env=env, args=["--max-store-bytes", "2MiB"])


@pytest.mark.postgres
def test_two_replicas_on_postgres_evict_while_fetches_run(tmp_path: Path, pg_url: str) -> None:
    upgrade(pg_url)
    data_dir = tmp_path / "shared"
    replicas = [_replica(data_dir, pg_url) for _ in range(2)]
    urls = [replica.url for replica in replicas]
    tag = unique("rep")
    recipes = [padded(f"{tag}-{i}") for i in range(50)]
    known: dict[str, tuple[int, str]] = {}  # recipe key -> (recipe index, digest)
    known_lock = threading.Lock()
    failures: list[str] = []
    fetches = Counter[str]()
    done = threading.Event()
    try:
        for replica in replicas:
            replica.launch()
        for replica in replicas:
            replica.wait_ready(ready="/readyz")
        clients = [httpx.Client(base_url=url, timeout=120) for url in urls]

        def resolve(i: int, replica: int) -> None:
            response = clients[replica].post("/v1/resolve", json={"recipe": recipes[i]})
            if response.status_code != 200:
                failures.append(
                    f"resolve {i} on {replica}: {response.status_code} {response.text[:200]}"
                )
                return
            body = response.json()
            with known_lock:
                previous = known.setdefault(body["recipe_key"], (i, body["artifact"]["digest"]))
            if previous[1] != body["artifact"]["digest"]:
                failures.append(f"recipe {i} changed digest")

        def fetcher(seed: int) -> None:
            rng = random.Random(seed)
            with httpx.Client(timeout=120) as http:
                while not done.is_set():
                    with known_lock:
                        choices = list(known.items())
                    if not choices:
                        time.sleep(0.01)
                        continue
                    key, (i, digest) = rng.choice(choices)
                    url = rng.choice(urls)
                    response = http.get(f"{url}/v1/recipes/{key}/artifact")
                    if response.status_code == 404:  # evicted: a plain miss, compiled on demand
                        fetches["miss"] += 1
                        response = http.post(f"{url}/v1/resolve", json={"recipe": recipes[i]})
                        if (
                            response.status_code == 200
                            and response.json()["artifact"]["digest"] == digest
                        ):
                            continue
                    elif (
                        response.status_code == 200
                        and hashlib.sha256(response.content).hexdigest() == digest
                    ):
                        fetches["ok"] += 1
                        continue
                    failures.append(
                        f"fetch {key[:12]} from {url}: {response.status_code} {response.text[:200]}"
                    )

        threads = [threading.Thread(target=fetcher, args=(s,)) for s in range(3)]
        for thread in threads:
            thread.start()
        rng = random.Random(7)
        order = [*range(50), *rng.choices(range(50), k=20)]
        rng.shuffle(order)
        for n, i in enumerate(order):
            resolve(i, n % 2)
        done.set()
        for thread in threads:
            thread.join(timeout=60)
        for client in clients:
            client.close()
        engine = sa.create_engine(pg_url, poolclass=sa.pool.NullPool)
        try:
            with engine.connect() as conn:
                evicted = conn.execute(sa.text("SELECT count(*) FROM evictions")).scalar_one()
            wait_until(
                lambda: SqlIndex(engine).usage().bytes <= int(CAP * HIGH),
                "the shared store under its mark",
            )
        finally:
            engine.dispose()
    finally:
        for replica in replicas:
            replica.stop()
    assert failures == []
    # Thousands of fetches, some of them of artifacts evicted a moment before (compiled again).
    assert fetches["ok"] > 200 and fetches["miss"] > 0 and evicted > 0
    report = verify(data_dir, pg_url)
    assert report["missing"] == [] and report["corrupt"] == [] and report["checked"] > 20
