"""The deploy topology: nginx (deploy/nginx/kcache.conf.template, as it is) in front of one
replica that answers fetches with ``X-Accel-Redirect``, so nginx sends the bytes.

Real parts: Debian's nginx (``nginx-light``, as tests/server/test_load_balancer.py),
``kcache serve`` with ``KCACHE_ACCEL_REDIRECT`` and tokens, its blobs in a bucket on
moto's S3 server (the replica's data directory holds the local copies nginx reads),
and the real client. Started once for the module.
"""

from __future__ import annotations

import http.client
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from kcache_client import ClientSettings, KernelCache
from kcache_server.accel_redirect import accel_path
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
)

TEMPLATE = Path(__file__).resolve().parents[2] / "deploy" / "nginx" / "kcache.conf.template"
PREFIX = "/_kcache_blobs/"
#: The headers a client relies on, which nginx must send as the replica does.
KEPT = ("etag", "cache-control", "x-kcache-meta", "x-kcache-signature", "x-kcache-digest")


def render(template: str, values: dict[str, str]) -> str:
    """The template with its ``${NAME}`` filled in, as the nginx image's envsubst does."""
    for name, value in values.items():
        template = template.replace("${" + name + "}", value)
    assert "${" not in template, "a name the topology does not set"
    return template


class Nginx(NginxProcess):
    """nginx in the foreground: a minimal nginx.conf that includes the deploy's file."""

    def __init__(self, root: Path, replica: str, blobs: Path) -> None:
        super().__init__(root)
        values = {
            "KCACHE_LISTEN": f"127.0.0.1:{self.port}",
            "KCACHE_REPLICA": replica,
            "KCACHE_BLOBS": str(blobs),
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

    def local(self, digest: str) -> Path:
        return self.blobs / digest[:2] / digest[2:4] / digest


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
    }
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
        nginx = Nginx(root / "nginx", replica.url.removeprefix("http://"), data_dir / "blobs")
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


def test_a_blob_only_in_the_bucket_is_filled_locally_and_sent_by_nginx(
    topology: Topology,
) -> None:
    data = os.urandom(4096)
    digest = topology.bucket.put(data)  # straight into the bucket, as another replica would
    local = topology.local(digest)
    assert not local.exists()
    url = f"{topology.nginx.url}/v1/blobs/{digest}"
    got = httpx.get(url, headers=_auth(topology.reader), timeout=30)
    assert got.status_code == 200 and got.content == data
    assert local.read_bytes() == data  # the replica filled its local copy; nginx sent it
    # The local copy evicted (the replica still has the bytes in memory): put back again.
    local.unlink()
    again = httpx.get(url, headers=_auth(topology.reader), timeout=30)
    assert again.status_code == 200 and again.content == data
    assert local.exists()
    # The same for a fetch by key whose local copy went while the key is warm.
    key_local = topology.local(topology.digest)
    key_local.unlink()
    by_key = httpx.get(
        f"{topology.nginx.url}/v1/recipes/{topology.recipe_key}/artifact",
        headers=_auth(topology.reader),
        timeout=30,
    )
    assert by_key.status_code == 200 and by_key.content == topology.data
    assert key_local.read_bytes() == topology.data


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
