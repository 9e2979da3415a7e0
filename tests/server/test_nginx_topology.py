"""The deploy topology: nginx (deploy/nginx/kcache.conf.template, as it is) in front of one
replica: nginx answers a warm fetch from its cache (per token, for 2 s) and logs it to the
edge log, which the replica reads into its audit; everything else is the replica's answer
(with ``X-Accel-Redirect`` where nginx sends the file).

Real parts: Debian's nginx (``nginx-light``, as tests/server/test_load_balancer.py),
``kcache serve`` with ``KCACHE_ACCEL_REDIRECT``, ``KCACHE_EDGE_LOG`` and tokens, its blobs
in a bucket on moto's S3 server (the replica's data directory holds the local copies nginx
reads), and the real client. Started once for the module. The edge log's reader alone
(:class:`~kcache_server.auditing.edge_log.EdgeLogTailer`: partial lines, rotation,
truncation, hostile lines) is also tested on files here, without nginx.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from kcache_client import ClientSettings, KernelCache
from kcache_server.accel_redirect import accel_path
from kcache_server.auditing.edge_log import MAX_LINE, EdgeHit, EdgeLogTailer, parse_line
from kcache_server.settings import Settings

from kcache.recipe import Recipe
from kcache.store.s3 import S3ArtifactStore
from tests.s3_server import s3_server
from tests.support import (
    NGINX,
    VECTOR_ADD,
    NginxProcess,
    ServerProcess,
    unique,
    wait_until,
)

TEMPLATE = Path(__file__).resolve().parents[2] / "deploy" / "nginx" / "kcache.conf.template"
PREFIX = "/_kcache_blobs/"
#: The headers a client relies on, which nginx must send as the replica does.
KEPT = (
    "etag",
    "cache-control",
    "x-kcache-meta",
    "x-kcache-signature",
    "x-kcache-digest",
    "x-kcache-withdrawals-through",
)


def render(template: str, values: dict[str, str]) -> str:
    """The template with its ``${NAME}`` filled in, as the nginx image's envsubst does."""
    for name, value in values.items():
        template = template.replace("${" + name + "}", value)
    assert "${" not in template, "a name the topology does not set"
    return template


class Nginx(NginxProcess):
    """nginx in the foreground: a minimal nginx.conf that includes the deploy's file."""

    def __init__(self, root: Path, replica: str, blobs: Path, edge_log: Path) -> None:
        super().__init__(root)
        cache = root / "cache"
        cache.mkdir(mode=0o700)
        values = {
            "KCACHE_LISTEN": f"127.0.0.1:{self.port}",
            "KCACHE_REPLICA": replica,
            "KCACHE_BLOBS": str(blobs),
            "KCACHE_EDGE_CACHE": str(cache),
            "KCACHE_EDGE_LOG": str(edge_log),
        }
        (root / "kcache.conf").write_text(render(TEMPLATE.read_text(), values))
        # As root, nginx's workers would run as nobody, who cannot enter pytest's 0700 dirs.
        user = "user root;\n" if os.geteuid() == 0 else ""
        temp = " ".join(
            f"{kind}_temp_path {root}/tmp;" for kind in ("client_body", "proxy", "fastcgi")
        )
        self.config.write_text(
            f"{user}daemon off;\nworker_processes 1;\npid {root}/nginx.pid;\n"
            f"error_log {root}/error.log warn;\nevents {{ worker_connections 256; }}\n"
            f"http {{ access_log off; {temp} uwsgi_temp_path {root}/tmp; "
            f"scgi_temp_path {root}/tmp; include {root}/kcache.conf; }}\n"
        )
        self.start()


@dataclass
class Topology:
    nginx: Nginx
    replica: ServerProcess
    bucket: S3ArtifactStore
    blobs: Path
    reader: str
    recipe_key: str
    digest: str
    data: bytes
    env: dict[str, str]
    builder: str
    edge_log: Path
    db: Path

    def local(self, digest: str) -> Path:
        return self.blobs / digest[:2] / digest[2:4] / digest

    def token(self, scope: str = "read") -> str:
        """A token of its own: no other test's fetches are in nginx's cache under it."""
        return _kcache(self.env, "token", "create", unique("t"), "--scope", scope)

    def replica_fetches(self) -> float:
        """Fetches by key the replica itself answered (its request metrics; nginx's cache: not)."""
        return _metric(
            self, "kcache_http_requests_total", 'route="/v1/recipes/{recipe_key}/artifact"'
        )

    def audited(self, recipe_key: str) -> int:
        """Fetch hits of ``recipe_key`` in the audit's table (written, not queued)."""
        with contextlib.closing(sqlite3.connect(self.db)) as conn:
            row = conn.execute(
                "SELECT COALESCE(SUM(count), 0) FROM audit_events "
                "WHERE recipe_key = ? AND route = 'fetch' AND outcome = 'hit'",
                (recipe_key,),
            ).fetchone()
        return int(row[0])

    def new_recipe(self) -> tuple[str, str, str]:
        """A recipe compiled now, of a kernel named for it alone: (its key, the kernel's name,
        its digest)."""
        name = f"edge_{uuid.uuid4().hex[:12]}"
        body = {
            "recipe": {
                "source": VECTOR_ADD.replace("void add(", f"void {name}("),
                "target": "sm_90",
            },
            "compile": True,
        }
        got = httpx.post(
            f"{self.nginx.url}/v1/resolve", json=body, headers=_auth(self.builder), timeout=120
        )
        assert got.status_code == 200, got.text
        art = got.json()["artifact"]
        return got.json()["recipe_key"], art["kernel"], art["digest"]


def _metric(topology: Topology, name: str, selector: str) -> float:
    """The sum of ``name``'s samples whose labels contain ``selector``, from the replica."""
    text = httpx.get(f"{topology.replica.url}/metrics", headers=_auth(topology.reader)).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") and selector in line
    )


def _kcache(env: dict[str, str], *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "kcache.cli", *args], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.fixture(scope="module")
def topology(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Topology]:
    if not Path(NGINX).exists():
        pytest.skip(f"no nginx at {NGINX}: scripts/ensure-services installs Debian's nginx-light")
    server = s3_server()
    root = tmp_path_factory.mktemp("nginx-topology")
    data_dir = root / "data"
    store_url = f"s3://{server.new_bucket()}/kcache"
    env = {
        **os.environ,
        **server.env,
        "KCACHE_STORE_URL": store_url,
        "KCACHE_ACCEL_REDIRECT": PREFIX,
        "KCACHE_COMPILE_WORKERS": "1",
        "KCACHE_DATA_DIR": str(data_dir),
        "KCACHE_EDGE_LOG": str(root / "edge" / "edge.log"),
    }
    (root / "edge").mkdir()
    _kcache(env, "db", "upgrade")
    reader = _kcache(env, "token", "create", "reader", "--scope", "read")
    builder = _kcache(env, "token", "create", "builder", "--scope", "compile")
    bucket = S3ArtifactStore.from_url(
        store_url,
        endpoint_url=server.endpoint,
        access_key_id=server.env["AWS_ACCESS_KEY_ID"],
        secret_access_key=server.env["AWS_SECRET_ACCESS_KEY"],
    )
    replica = ServerProcess(data_dir, env=env)
    nginx: Nginx | None = None
    try:
        replica.start()
        nginx = Nginx(
            root / "nginx",
            replica.url.removeprefix("http://"),
            data_dir / "blobs",
            root / "edge" / "edge.log",
        )
        body = {"recipe": {"source": VECTOR_ADD, "target": "sm_90"}, "compile": True}
        resolved = httpx.post(
            f"{nginx.url}/v1/resolve",
            json=body,
            headers={"Authorization": f"Bearer {builder}"},
            timeout=120,
        )
        assert resolved.status_code == 200, resolved.text
        digest = resolved.json()["artifact"]["digest"]
        yield Topology(
            nginx,
            replica,
            bucket,
            data_dir / "blobs",
            reader,
            resolved.json()["recipe_key"],
            digest,
            bucket.get(digest),
            env,
            builder,
            root / "edge" / "edge.log",
            data_dir / "kcache.db",
        )
    finally:
        if nginx is not None:
            nginx.stop()
        replica.stop()


def _auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_a_fetch_by_key_is_the_replicas_answer_with_nginx_sending_the_bytes(
    topology: Topology,
) -> None:
    path = f"/v1/recipes/{topology.recipe_key}/artifact"
    for _ in range(2):  # the route's answer, then the fast path's (warm)
        got = httpx.get(topology.nginx.url + path, headers=_auth(topology.reader), timeout=30)
        assert got.status_code == 200, got.text
        assert got.content == topology.data
        assert got.headers["server"] == "nginx" and "x-accel-redirect" not in got.headers
        # The replica's own answer (bytes sent by itself, as nginx's fallback asks) has the
        # same headers a client checks: the signature, the metadata, the digest, the ETag.
        direct = httpx.get(
            topology.replica.url + path,
            headers={**_auth(topology.reader), "X-KCache-Accel": "off"},
            timeout=30,
        )
        assert direct.content == topology.data
        for name in KEPT:
            assert got.headers.get(name) == direct.headers[name], name
        assert got.headers["x-kcache-size"] == str(len(topology.data))
    # Without nginx, the replica would have sent no bytes: nginx carried them.
    redirected = httpx.get(topology.replica.url + path, headers=_auth(topology.reader))
    assert redirected.content == b""
    assert redirected.headers["x-accel-redirect"] == accel_path(PREFIX, topology.digest)
    # And the real client, which refuses an answer without a valid signature, takes it.
    settings = ClientSettings.from_env(
        url=topology.nginx.url,
        token=topology.reader,
        cache_dir=topology.nginx.root / unique("client"),
        send_events=False,
    )
    with KernelCache(settings=settings) as cache:
        art = cache.get(Recipe.from_dict({"source": VECTOR_ADD, "target": "sm_90"}))
    assert art.digest == topology.digest and art.data == topology.data


def test_a_fetch_by_digest_and_its_head_go_through_nginx(topology: Topology) -> None:
    url = f"{topology.nginx.url}/v1/blobs/{topology.digest}"
    got = httpx.get(url, headers=_auth(topology.reader), timeout=30)
    assert got.status_code == 200 and got.content == topology.data
    assert got.headers["etag"] == f'"{topology.digest}"'
    assert got.headers["x-kcache-digest"] == topology.digest
    assert got.headers["cache-control"] == "public, max-age=31536000, immutable"
    head = httpx.head(url, headers=_auth(topology.reader), timeout=30)
    assert head.status_code == 200 and head.headers["content-length"] == str(len(topology.data))


@pytest.mark.parametrize("token", [None, "kc_wrong"])
def test_no_token_or_a_wrong_one_gets_no_bytes_through_nginx(
    topology: Topology, token: str | None
) -> None:
    headers = _auth(token) if token else {}
    for path in (
        f"/v1/recipes/{topology.recipe_key}/artifact",
        f"/v1/blobs/{topology.digest}",
    ):
        for _ in range(2):  # warm in the fast path's caches too
            got = httpx.get(topology.nginx.url + path, headers=headers, timeout=30)
            assert got.status_code == 401, (path, got.status_code)
            assert topology.data not in got.content


def test_if_none_match_is_a_304_with_the_signature(topology: Topology) -> None:
    etag = {"If-None-Match": f'"{topology.digest}"', **_auth(topology.reader)}
    by_key = httpx.get(
        f"{topology.nginx.url}/v1/recipes/{topology.recipe_key}/artifact", headers=etag
    )
    assert by_key.status_code == 304 and by_key.content == b""
    assert by_key.headers["x-kcache-signature"] and by_key.headers["x-kcache-meta"]
    assert by_key.headers["etag"] == f'"{topology.digest}"'
    by_digest = httpx.get(f"{topology.nginx.url}/v1/blobs/{topology.digest}", headers=etag)
    assert by_digest.status_code == 304 and by_digest.content == b""


def test_a_blob_only_in_the_bucket_is_filled_locally_and_its_bytes_sent_through_nginx(
    topology: Topology,
) -> None:
    data = os.urandom(4096)
    digest = topology.bucket.put(data)  # straight into the bucket, as another replica would
    local = topology.local(digest)
    assert not local.exists()
    url = f"{topology.nginx.url}/v1/blobs/{digest}"
    got = httpx.get(url, headers=_auth(topology.reader), timeout=30)
    assert got.status_code == 200 and got.content == data
    assert local.read_bytes() == data  # the replica filled its local copy
    # The local copy evicted: nginx's cache, or (another token, or the entry gone) the
    # replica from memory, still sends the right bytes.
    local.unlink()
    for token in (topology.reader, topology.token()):
        again = httpx.get(url, headers=_auth(token), timeout=30)
        assert again.status_code == 200 and again.content == data
    # The same for a fetch by key whose local copy went while the key is warm.
    topology.local(topology.digest).unlink()
    for token in (topology.reader, topology.token()):
        by_key = httpx.get(
            f"{topology.nginx.url}/v1/recipes/{topology.recipe_key}/artifact",
            headers=_auth(token),
            timeout=30,
        )
        assert by_key.status_code == 200 and by_key.content == topology.data


def _raw_get(url: str, path: str, headers: dict[str, str]) -> tuple[int, bytes]:
    """``GET path`` sent exactly as written (httpx would resolve dot segments first)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("GET", path, headers=headers)
        answer = conn.getresponse()
        return answer.status, answer.read()
    finally:
        conn.close()


def test_no_path_through_nginx_bypasses_the_token_or_reaches_another_file(
    topology: Topology,
) -> None:
    digest, key = topology.digest, topology.recipe_key
    fanned = f"{digest[:2]}/{digest[2:4]}/{digest}"
    paths = [
        f"/_kcache_blobs/{fanned}",  # the internal location, asked for directly
        f"/v1/blobs/../../_kcache_blobs/{fanned}",
        f"/v1/blobs/%2e%2e/%2e%2e/_kcache_blobs/{fanned}",
        f"/healthz/../v1/recipes/{key}/artifact",  # a public prefix, then dot segments
        f"/healthz/..%2Fv1%2Fblobs%2F{digest}",
        f"/v1/blobs/{digest}%2F..%2F..%2Fkcache.db",
        "/v1/blobs/..%2Fkcache.db",
        f"/v1/blobs/{digest[:63]}",  # not 64 hex
        f"/v1/blobs/{digest.upper()}",
        f"/v1/blobs/{digest}0",
        "/_kcache_blobs/../kcache.db",
        "/_kcache_blobs/%2e%2e/kcache.db",
    ]
    for path in paths:
        for headers in ({}, _auth(topology.reader)):
            status, body = _raw_get(topology.nginx.url, path, headers)
            assert topology.data not in body, (path, status)
            assert b"SQLite format" not in body, (path, status)
            assert status in (400, 401, 404, 422), (path, headers, status)
    # An encoded slash reaches the replica as sent; uvicorn decodes it into the path the
    # token gate checks, so it is the same fetch, refused without a token as any other.
    encoded = f"/v1/recipes/{key}%2Fartifact"
    assert _raw_get(topology.nginx.url, encoded, {})[0] == 401
    assert _raw_get(topology.nginx.url, encoded, _auth(topology.reader)) == (200, topology.data)


def test_the_setting_names_an_internal_location_and_a_path_is_built_from_a_digest_only() -> None:
    with pytest.raises(ValueError):
        Settings(accel_redirect="_kcache_blobs")  # neither starts nor ends with /
    with pytest.raises(ValueError):
        Settings(accel_redirect="/a b/")
    assert Settings(accel_redirect=PREFIX).accel_redirect == PREFIX
    with pytest.raises(ValueError):
        accel_path(PREFIX, "../" + "a" * 61)
    assert accel_path(PREFIX, "ab" * 32) == PREFIX + "ab/ab/" + "ab" * 32


# nginx's cache of fetches, and their audit --------------------------------------------


def _twice_from_one_fill(
    topology: Topology, fetch: Callable[[], httpx.Response]
) -> tuple[httpx.Response, httpx.Response]:
    """A fetch that fills nginx's entry, then one it answers: the replica counted one of them.

    An entry lasts 1-2 s (nginx's whole seconds): on a loaded machine the two may straddle
    its end, so up to five tries.
    """
    for _ in range(5):
        before = topology.replica_fetches()
        first, second = fetch(), fetch()
        if topology.replica_fetches() - before == 1:
            return first, second
        time.sleep(2.1)  # the entry's end: the next try fills a fresh one
    raise AssertionError("nginx never answered the second fetch from its cache")


def test_a_second_fetch_with_the_same_token_is_nginxs_cached_answer_with_every_header(
    topology: Topology,
) -> None:
    token = topology.token()
    url = f"{topology.nginx.url}/v1/recipes/{topology.recipe_key}/artifact"
    filled, cached = _twice_from_one_fill(
        topology, lambda: httpx.get(url, headers=_auth(token), timeout=30)
    )
    for got in (filled, cached):
        assert got.status_code == 200 and got.content == topology.data
        assert got.headers["x-kcache-size"] == str(len(topology.data))
        assert got.headers["x-content-type-options"] == "nosniff"
        assert "x-accel-redirect" not in got.headers and "x-accel-expires" not in got.headers
    for name in (*KEPT, "x-kcache-size", "content-type", "content-length"):
        assert cached.headers.get(name) == filled.headers[name], name
    # The cached answer names the request that filled it.
    assert cached.headers["x-request-id"] == filled.headers["x-request-id"]
    # The real client takes the cached answer (its signature and metadata check out).
    settings = ClientSettings.from_env(
        url=topology.nginx.url,
        token=token,
        cache_dir=topology.nginx.root / unique("client"),
        send_events=False,
    )
    recipe = Recipe.from_dict({"source": VECTOR_ADD, "target": "sm_90"})
    with KernelCache(settings=settings) as cache:
        for _ in range(2):
            art = cache.get(recipe)
            assert art.digest == topology.digest and art.data == topology.data


def test_another_token_no_token_or_a_bad_one_is_never_answered_from_a_tokens_entry(
    topology: Topology,
) -> None:
    owner, other = topology.token(), topology.token()
    for path in (
        f"/v1/recipes/{topology.recipe_key}/artifact",
        f"/v1/blobs/{topology.digest}",
    ):
        url = topology.nginx.url + path
        assert httpx.get(url, headers=_auth(owner), timeout=30).status_code == 200  # the entry
        for headers in ({}, _auth("kc_wrong"), {"Authorization": "Basic eDp5"}):
            got = httpx.get(url, headers=headers, timeout=30)
            assert got.status_code == 401, (path, headers, got.status_code)
            assert topology.data not in got.content
    # Another valid token is answered by the replica (counted there), not by the entry.
    url = f"{topology.nginx.url}/v1/recipes/{topology.recipe_key}/artifact"
    before = topology.replica_fetches()
    assert httpx.get(url, headers=_auth(other), timeout=30).content == topology.data
    assert topology.replica_fetches() - before == 1


def test_a_revoked_token_stops_fetching_within_the_token_cache_and_the_entrys_life(
    topology: Topology,
) -> None:
    name = unique("revoked")
    token = _kcache(topology.env, "token", "create", name, "--scope", "read")
    url = f"{topology.nginx.url}/v1/recipes/{topology.recipe_key}/artifact"
    assert httpx.get(url, headers=_auth(token), timeout=30).status_code == 200
    _kcache(topology.env, "token", "revoke", name)
    revoked = time.monotonic()
    statuses: list[int] = []

    def refused() -> bool:
        statuses.append(httpx.get(url, headers=_auth(token), timeout=30).status_code)
        return statuses[-1] == 401

    # KCACHE_AUTH_CACHE_S (2 s) in the replica + 2 s in nginx, and some slack for this machine.
    wait_until(refused, "the revoked token to be refused", timeout=10)
    assert time.monotonic() - revoked < 10 and set(statuses) <= {200, 401}


def test_if_none_match_is_answered_304_from_nginxs_cache(topology: Topology) -> None:
    token = topology.token()
    url = f"{topology.nginx.url}/v1/recipes/{topology.recipe_key}/artifact"
    etag = {"If-None-Match": f'"{topology.digest}"', **_auth(token)}
    # The first asks the replica for the 200 nginx keeps, and is answered 304 from it.
    first, second = _twice_from_one_fill(topology, lambda: httpx.get(url, headers=etag, timeout=30))
    for got in (first, second):
        assert got.status_code == 304 and got.content == b""
        assert got.headers["etag"] == f'"{topology.digest}"'
        assert got.headers["x-kcache-signature"] and got.headers["x-kcache-meta"]
        assert got.headers["x-kcache-digest"] == topology.digest
    # Another ETag is no match: the bytes, from the same entry.
    other = httpx.get(url, headers={**etag, "If-None-Match": '"' + "0" * 64 + '"'}, timeout=30)
    assert other.status_code == 200 and other.content == topology.data


def _stats_hits(topology: Topology, kernel: str) -> int:
    got = httpx.get(
        f"{topology.nginx.url}/v1/stats", params={"kernel": kernel}, headers=_auth(topology.reader)
    )
    assert got.status_code == 200, got.text
    return int(got.json()["totals"].get("hit", 0))


def test_fetches_nginx_answered_from_its_cache_are_audited_as_the_replicas_are(
    topology: Topology,
) -> None:
    recipe_key, kernel, _ = topology.new_recipe()
    token = topology.token()
    url = f"{topology.nginx.url}/v1/recipes/{recipe_key}/artifact"
    before_replica = topology.replica_fetches()
    fetches = 40
    for _ in range(fetches):
        assert httpx.get(url, headers=_auth(token), timeout=30).status_code == 200
    by_replica = topology.replica_fetches() - before_replica
    assert by_replica < fetches  # most came from nginx's cache
    # Every fetch is in the audit once: the replica's own, and nginx's read from its log.
    wait_until(lambda: topology.audited(recipe_key) >= fetches, "the audit", timeout=20)
    assert topology.audited(recipe_key) == fetches
    assert _stats_hits(topology, kernel) == fetches
    hits = _metric(topology, "kcache_edge_log_lines_total", 'result="hit"')
    assert hits >= fetches - by_replica


def _edge_line(recipe_key: str, digest: str, status: int = 200) -> bytes:
    return (
        f"1 {time.time():.3f} {status} 0.000 /v1/recipes/{recipe_key}/artifact {digest}\n".encode()
    )


def test_a_hostile_edge_log_line_is_skipped_and_counted(topology: Topology) -> None:
    recipe_key, _, digest = topology.new_recipe()
    bad_before = _metric(topology, "kcache_edge_log_lines_total", 'result="bad"')
    hostile = [
        b"garbage\n",
        b"\x00\xff\xfe binary \x1b[31m\n",
        f"1 {time.time():.3f} 200 0.000 /v1/recipes/{recipe_key.upper()}/artifact {topology.digest}\n".encode(),
        f"1 {time.time():.3f} 200 0.000 /v1/recipes/../../{recipe_key}/artifact {topology.digest}\n".encode(),
        f"2 {time.time():.3f} 200 0.000 /v1/recipes/{recipe_key}/artifact {topology.digest}\n".encode(),
        f"1 nan 200 0.000 /v1/recipes/{recipe_key}/artifact {topology.digest}\n".encode(),
        f"1 {time.time():.3f} 200 0.000 /v1/recipes/{recipe_key}/artifact -\n".encode(),
        b"1 " + b"9" * (MAX_LINE * 4) + b"\n",
    ]
    with open(topology.edge_log, "ab") as log:  # O_APPEND, as nginx writes it
        # The good line names the recipe's own digest: a line the index cannot confirm (a
        # key bound to another digest) is not counted (tests/audit/test_edge_lines.py).
        log.write(b"".join(hostile) + _edge_line(recipe_key, digest))
    wait_until(
        lambda: (
            _metric(topology, "kcache_edge_log_lines_total", 'result="bad"') - bad_before
            >= len(hostile)
        ),
        "the bad lines to be counted",
        timeout=15,
    )
    assert _metric(topology, "kcache_edge_log_lines_total", 'result="bad"') - bad_before == len(
        hostile
    )
    # The one good line after them is audited; the server lives on and answers.
    wait_until(lambda: topology.audited(recipe_key) == 1, "the good line's audit", timeout=15)
    assert httpx.get(f"{topology.replica.url}/healthz").status_code == 200


def test_a_rotated_edge_log_is_followed(topology: Topology) -> None:
    recipe_key, _, digest = topology.new_recipe()
    token = topology.token()
    url = f"{topology.nginx.url}/v1/recipes/{recipe_key}/artifact"
    rotated = topology.edge_log.with_name("edge.log.1")
    os.replace(topology.edge_log, rotated)
    # A line nginx flushes into the old file before it reopens: read too.
    with open(rotated, "ab") as old:
        old.write(_edge_line(recipe_key, digest))
    topology.nginx.proc.send_signal(signal.SIGUSR1)  # nginx -s reopen
    wait_until(topology.edge_log.exists, "nginx to reopen its log", timeout=10)
    fetches = 20
    for _ in range(fetches):
        assert httpx.get(url, headers=_auth(token), timeout=30).status_code == 200
    wait_until(lambda: topology.audited(recipe_key) >= fetches + 1, "the audit", timeout=20)
    assert topology.audited(recipe_key) == fetches + 1


# The edge log's reader, on files ------------------------------------------------------

KEY, DIGEST = "a" * 64, "b" * 64


class _Read:
    def __init__(self, tmp_path: Path) -> None:
        self.path = tmp_path / "edge.log"
        self.hits: list[EdgeHit] = []
        self.tailer = EdgeLogTailer(
            self.path, tmp_path / "state", self.hits.extend, rotate_grace_s=0.0
        )
        (tmp_path / "state").mkdir()

    def count(self) -> int:
        """Fetches handed to the audit (alike lines come as one hit with their count)."""
        return sum(hit.count for hit in self.hits)

    def write(self, data: bytes, path: Path | None = None) -> None:
        with open(path or self.path, "ab") as f:
            f.write(data)


def test_the_reader_waits_for_a_partial_line_and_parses_what_nginx_writes(tmp_path: Path) -> None:
    read = _Read(tmp_path)
    assert read.tailer.poll() == 0  # no file yet
    line = _edge_line(KEY, DIGEST)
    read.write(line[:30])
    read.tailer.poll()
    assert read.hits == []  # no newline yet
    read.write(line[30:] + _edge_line(KEY, DIGEST, 304) + _edge_line(KEY, DIGEST, 499))
    read.tailer.poll()
    assert [(h.recipe_key, h.digest, h.status, h.count) for h in read.hits] == [
        (KEY, DIGEST, 200, 1),
        (KEY, DIGEST, 304, 1),
    ]
    assert read.tailer.counts == {"hit": 2, "ignored": 1, "unknown": 0, "bad": 0}
    hit = parse_line(f"1 1796158110.358 200 0.004 /v1/recipes/{KEY}/artifact {DIGEST}".encode())
    assert hit == EdgeHit(1796158110.358, KEY, DIGEST, 200, 4.0)
    for bad in (b"", b"1 2 3", f"1 1 200 0.0 /v1/recipes/{KEY}/artifact {DIGEST} x".encode()):
        with pytest.raises(ValueError):
            parse_line(bad)


def test_the_reader_follows_a_truncation_and_a_rotation_and_resumes_where_it_got_to(
    tmp_path: Path,
) -> None:
    read = _Read(tmp_path)
    read.write(_edge_line(KEY, DIGEST) * 3)
    read.tailer.poll()
    assert read.count() == 3
    # Truncated (copytruncate): what is written after is read from the start.
    with open(read.path, "r+b") as f:
        f.truncate(0)
    read.write(_edge_line(KEY, DIGEST))
    read.tailer.poll()
    assert read.count() == 4
    # Renamed, a last line into the old file, then a new file: both read, none twice.
    old = tmp_path / "edge.log.1"
    os.replace(read.path, old)
    read.write(_edge_line(KEY, DIGEST), old)
    read.write(_edge_line(KEY, DIGEST) * 2)
    for _ in range(3):
        read.tailer.poll()
    assert read.count() == 7 and read.tailer.reopened == 2
    # Another reader (a restart, another worker) goes on from the saved offset.
    state = json.loads((tmp_path / "state" / "edge-log.offset").read_text())
    assert state["inode"] == os.stat(read.path).st_ino
    read.write(_edge_line(KEY, DIGEST))
    again = EdgeLogTailer(read.path, tmp_path / "state", read.hits.extend)
    again._load_state()
    again.poll()
    assert read.count() == 8


def test_the_reader_survives_hostile_bytes_and_an_endless_line(tmp_path: Path) -> None:
    read = _Read(tmp_path)
    read.write(b"\xff" * (MAX_LINE * 3))  # no newline, ever longer
    read.tailer.poll()
    read.write(b"\x00" * 100 + b"\n" + _edge_line(KEY, DIGEST))
    read.tailer.poll()
    assert read.tailer.counts["bad"] == 1 and read.count() == 1

    def boom(_: list[EdgeHit]) -> None:
        raise RuntimeError("the audit is down")

    read.tailer.on_hits = boom
    read.write(_edge_line(KEY, DIGEST))
    read.tailer.poll()  # logged, not raised
    assert read.tailer.counts["hit"] == 2


def _random_line(rng: random.Random) -> bytes:
    """An edge log line: well-formed mostly, else broken in one of the ways a line can be."""
    keys, digests = ["a" * 64, "b" * 63 + "c", KEY], ["d" * 64, DIGEST]
    fields = [
        b"1",
        rng.choice([b"1796158110.358", b"1796158110.4", b"1796158111", b"1796158109.001"]),
        rng.choice([b"200", b"200", b"304", b"499"]),
        rng.choice([b"0.000", b"0.004", b"1.5", b"0"]),
        f"/v1/recipes/{rng.choice(keys)}/artifact".encode(),
        rng.choice(digests).encode(),
    ]
    if rng.random() < 0.85:
        return b" ".join(fields)
    at = rng.randrange(6)
    breaks: list[Callable[[], list[bytes]]] = [
        lambda: fields[:5],  # a field short
        lambda: [*fields, b"x"],  # a field over
        lambda: [*fields[:at], b"", *fields[at:]],  # a double space
        lambda: [*fields[:at], fields[at].upper() + b"\r", *fields[at + 1 :]],
        lambda: [*fields[:at], b"1e5", *fields[at + 1 :]],  # no number of the format
        lambda: [b"2", *fields[1:]],  # another version
        lambda: [*fields[:5], fields[5][:63]],  # a digest a digit short
        lambda: [*fields[:5], b"\n".join([fields[5], b"1"])],  # a line of one field next
        lambda: [],  # an empty line
    ]
    return b" ".join(rng.choice(breaks)())


def test_the_columns_fast_path_counts_every_block_as_the_line_by_line_match() -> None:
    """A block read as columns (what nginx writes) gives what matching each line gives.

    Blocks of random lines, well-formed and broken (a field short or over, an empty field,
    an upper-case digest, a line cut in two so that the fields still add up): the fast
    path returns the same groups, or gives the block up whenever a line is not in the
    format, where line by line takes the good lines and counts the rest bad.
    """
    from kcache_server.auditing.edge_log import _LINE, _tally_lines, _tally_whole

    rng = random.Random(35)
    taken = given_up = 0
    for _ in range(3000):
        block = b"\n".join(_random_line(rng) for _ in range(rng.choice([1, 2, 3, 8, 40])))
        lines = block.count(b"\n") + 1
        whole = _tally_whole(block, lines)
        every_line_good = all(_LINE.fullmatch(line) for line in block.split(b"\n"))
        if not every_line_good:
            assert whole is None, block
            given_up += 1
            continue
        taken += 1
        expected = _tally_lines(block)
        assert whole is not None and whole.keys() == expected.keys(), block
        for group, (at, seconds, n) in whole.items():
            assert (at, n) == (expected[group][0], expected[group][2])
            assert seconds == pytest.approx(expected[group][1])
    assert taken > 300 and given_up > 300  # both ways, many times
