"""The shipped Kubernetes manifest's fleet, run here: two replicas that sign with one key from a
Secret behind one URL, every answer accepted by a client given only what an image carries.

Real parts: two pods as ``deploy/kubernetes.yaml`` describes them, each the init container's
command chain then the server container's ``kcache serve`` with the manifest's environment
(every variable read from the manifest, every path in it moved onto a directory of this
test: the pod's own emptyDirs, and one directory per Secret that both pods mount, as a
Secret volume is), and beside each server the nginx of its pod (``deploy/nginx/
kcache.conf.template`` as the manifest's nginx container fills it); one PostgreSQL
database (the ``kcache-db`` Secret), moto's S3 server (the bucket), and an nginx in front
of both pods that balances round-robin, as the Service does. The fleet's key is made the
way the manifest's header says (``kcache signing-key create ... --public fleet-key.pub``)
and put in the ``kcache-signing-key`` Secret; the client runs in a process of its own with
a fresh home, the Service's URL and a token, and for trust only what the header tells an
image to carry: ``KCACHE_TRUSTED_KEYS=@/etc/kcache/fleet-key.pub``, that file in the
image's place here.

What is not the manifest's: the cluster's MinIO endpoint (the S3 test server's, in a bucket
of its own under the manifest's prefix), one compile worker per server process (this
machine's cores), and the listening addresses (loopback and free ports instead of
0.0.0.0:8470 and 8480). Everything starts once for the module. Then a third pod given
another key in its Secret, and one from the manifest without the key (the manifest as it
was: each pod made its own key), refuse to start on the same database, in one line.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import httpx
import pytest

from kcache.artifact import ArtifactMeta
from kcache.signing import Signature, SigningKey, TrustedKeys
from tests.s3_server import CREDENTIALS, S3Server, s3_server
from tests.support import (
    KCACHE,
    NGINX,
    ROOT,
    VECTOR_ADD,
    NginxProcess,
    ServerProcess,
    free_port,
    pg_database,
    unique,
)

pytestmark = pytest.mark.postgres

yaml = pytest.importorskip("yaml")

MANIFEST = ROOT / "deploy" / "kubernetes.yaml"
TEMPLATE = ROOT / "deploy" / "nginx" / "kcache.conf.template"
#: Kernels the client compiles (each new to the fleet), then fetches from a fresh home.
KERNELS = 6
#: The client: a job's process, told only its server, its token and the image's trust.
CLIENT = """
import json, sys
from kcache_client import KernelCache
from kcache.recipe import Recipe

recipes = [Recipe.from_dict(body) for body in json.loads(sys.argv[1])]
home = sys.argv[2]
results = []
for phase in ("compile", "fetch"):
    for i, recipe in enumerate(recipes):
        # A fresh tier for each fetch: every answer comes from the fleet, none from disk.
        tier = f"{home}/tiers/{phase}" if phase == "compile" else f"{home}/tiers/fetch-{i}"
        try:
            with KernelCache(cache_dir=tier) as cache:
                art = cache.get(recipe)
                art.check()
            results.append({"phase": phase, "origin": art.origin, "digest": art.digest})
        except Exception as exc:
            results.append({"phase": phase, "error": f"{type(exc).__name__}: {exc}"})
print(json.dumps(results))
"""


def _manifest() -> tuple[dict[str, Any], str]:
    """The Deployment's pod spec and the header's comments (what an operator is told)."""
    text = MANIFEST.read_text()
    docs = [d for d in yaml.safe_load_all(text) if d]
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    return deployment["spec"]["template"]["spec"], text.split("apiVersion", 1)[0]


def _documented(header: str, pattern: str) -> str:
    """The one command or setting of the header matching ``pattern``."""
    (found,) = re.findall(pattern, header, re.M)
    return str(found)


class PodNginx(NginxProcess):
    """The pod's nginx: the manifest's template filled from its container's environment."""

    def __init__(self, root: Path, values: dict[str, str]) -> None:
        super().__init__(root)
        values = {**values, "KCACHE_LISTEN": f"127.0.0.1:{self.port}"}
        text = TEMPLATE.read_text()
        for name, value in values.items():
            text = text.replace("${" + name + "}", value)
        assert "${" not in text, "a name the pod does not set"
        (root / "kcache.conf").write_text(text)
        (root / "tmp").mkdir(exist_ok=True)
        # As root, nginx's workers would run as nobody, who cannot enter pytest's 0700 dirs.
        user = "user root;\n" if os.geteuid() == 0 else ""
        temp = " ".join(
            f"{kind}_temp_path {root}/tmp;"
            for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
        )
        self.config.write_text(
            f"{user}daemon off;\nworker_processes 1;\npid {root}/nginx.pid;\n"
            f"error_log {root}/error.log warn;\nevents {{ worker_connections 256; }}\n"
            f"http {{ access_log off; {temp} include {root}/kcache.conf; }}\n"
        )
        self.start()


class ServiceNginx(NginxProcess):
    """The Service: one URL, round-robin over the pods, each request's pod in its log."""

    def __init__(self, root: Path, pods: list[str]) -> None:
        super().__init__(root)
        (root / "tmp").mkdir(exist_ok=True)
        self.log = root / "routed.log"
        servers = " ".join(f"server {pod};" for pod in pods)
        temp = " ".join(
            f"{kind}_temp_path {root}/tmp;"
            for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
        )
        user = "user root;\n" if os.geteuid() == 0 else ""
        self.config.write_text(
            f"{user}daemon off;\nworker_processes 1;\npid {root}/nginx.pid;\n"
            f"error_log {root}/error.log warn;\nevents {{ worker_connections 256; }}\n"
            f"http {{ {temp}\n"
            "  log_format routed '$upstream_addr|$request_method|$uri|$status';\n"
            f"  access_log {self.log} routed;\n"
            f"  upstream pods {{ {servers} }}\n"
            f"  server {{ listen 127.0.0.1:{self.port}; client_max_body_size 64m;\n"
            "    location / { proxy_pass http://pods; proxy_http_version 1.1;\n"
            '      proxy_set_header Connection ""; proxy_set_header Host $http_host;\n'
            "      proxy_read_timeout 300s; } }\n"
            "}\n"
        )
        self.start()

    def routed(self) -> list[tuple[str, str, str, str]]:
        """(pod, method, path, status) of every request so far."""
        lines = self.log.read_text().splitlines() if self.log.exists() else []
        return [tuple(line.split("|")) for line in lines]  # type: ignore[misc]


@dataclass
class Pod:
    """One pod of the Deployment, here: its directories, environment and commands."""

    name: str
    root: Path
    env: dict[str, str]
    #: The manifest's mount paths -> this pod's directories (emptyDirs, Secrets).
    mounts: dict[str, Path]

    def moved(self, text: str) -> str:
        """``text`` with every mount path of the pod replaced by its directory here."""
        for mount, local in sorted(self.mounts.items(), key=lambda item: -len(item[0])):
            text = re.sub(rf"{re.escape(mount)}(?![\w.-])", str(local), text)
        return text


@dataclass
class Fleet:
    service: ServiceNginx
    pods: list[Pod]
    replicas: list[ServerProcess]
    pod_nginx: list[PodNginx]
    fleet_key: SigningKey
    #: The image's /etc/kcache/fleet-key.pub, here.
    image_key_file: Path
    trusted_setting: str
    token: str
    metrics_token: str
    db_url: str
    root: Path
    s3: S3Server
    store_url: str
    pod_spec: dict[str, Any]
    header: str


def _secret_dir(root: Path, name: str, files: dict[str, str | Path], mode: int) -> Path:
    """A Secret's volume: one file per key, mode the volume's defaultMode (0644 without one)."""
    where = root / "secrets" / name
    where.mkdir(parents=True, exist_ok=True)
    for key, value in files.items():
        path = where / key
        if isinstance(value, Path):
            shutil.copyfile(value, path)
        else:
            path.write_text(value)
        path.chmod(mode)
    return where


def _pod(
    name: str,
    root: Path,
    spec: dict[str, Any],
    secrets: dict[str, dict[str, str]],
    secret_dirs: dict[str, Path],
    overrides: dict[str, str],
    *,
    drop: tuple[str, ...] = (),
) -> Pod:
    """A pod's directories and the kcache container's environment, read from the manifest."""
    pod_root = root / name
    volumes: dict[str, Path] = {}
    for volume in spec["volumes"]:
        if "emptyDir" in volume:
            volumes[volume["name"]] = pod_root / volume["name"]
            volumes[volume["name"]].mkdir(parents=True, mode=0o700)
        elif "secret" in volume:
            volumes[volume["name"]] = secret_dirs[volume["secret"]["secretName"]]
    mounts: dict[str, Path] = {}
    for container in (*spec["initContainers"], *spec["containers"]):
        for mount in container.get("volumeMounts", []):
            if mount["name"] in volumes:
                mounts[mount["mountPath"]] = volumes[mount["name"]]
    pod = Pod(name, pod_root, {}, mounts)
    (server,) = [c for c in spec["containers"] if c["name"] == "kcache"]
    env: dict[str, str] = {}
    for entry in server["env"]:
        if entry["name"] in drop:
            continue
        if "value" in entry:
            env[entry["name"]] = pod.moved(str(entry["value"]))
        else:
            ref = entry["valueFrom"]["secretKeyRef"]
            env[entry["name"]] = secrets[ref["name"]][ref["key"]]
    env.update(overrides)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("KCACHE_", "AWS_"))}
    base["PATH"] = str(Path(sys.executable).parent) + os.pathsep + base.get("PATH", "")
    base["HOME"] = str(pod_root / "home")
    if os.environ.get("KCACHE_TOOLCHAIN_DIR"):  # the NVRTC headers, extracted once a run
        base["KCACHE_TOOLCHAIN_DIR"] = os.environ["KCACHE_TOOLCHAIN_DIR"]
    pod.env = {**base, **env}
    return pod


def _init(pod: Pod, spec: dict[str, Any]) -> None:
    """The init container's command chain, on this pod's directories."""
    (init,) = spec["initContainers"]
    argv = init["command"]
    assert argv[:2] == ["sh", "-c"]
    done = subprocess.run(
        ["sh", "-c", pod.moved(argv[2])],
        env=pod.env,
        cwd=pod.root,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr


def _serve_argv(spec: dict[str, Any], port: int) -> list[str]:
    """The server container's command, listening on loopback at ``port``."""
    (server,) = [c for c in spec["containers"] if c["name"] == "kcache"]
    argv = list(server["command"])
    assert argv[:2] == ["kcache", "serve"]
    argv[argv.index("--host") + 1] = "127.0.0.1"
    argv[argv.index("--port") + 1] = str(port)
    return [KCACHE, *argv[1:]]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    if not Path(NGINX).exists():
        pytest.skip(f"no nginx at {NGINX}: scripts/ensure-services installs Debian's nginx-light")
    s3 = s3_server()
    spec, header = _manifest()
    root = tmp_path_factory.mktemp("fleet")

    # The fleet's key, made as the header says, in an operator's directory.
    operator = root / "operator"
    operator.mkdir()
    create = _documented(header, r"^#\s+(kcache signing-key create .*)$").split()
    made = subprocess.run(
        [KCACHE, *create[1:]], cwd=operator, capture_output=True, text=True, check=False
    )
    assert made.returncode == 0, made.stderr
    from_file = _documented(
        header, r"kubectl create secret generic kcache-signing-key --from-file=(\S+)$"
    )
    fleet_key = SigningKey.load(operator / from_file)
    public = operator / create[create.index("--public") + 1]
    # The image that runs jobs: the public half at the place the header names.
    in_image = PurePosixPath(_documented(header, r"KCACHE_TRUSTED_KEYS=@(/[\w./-]*\w)"))
    trusted_setting = f"KCACHE_TRUSTED_KEYS=@{in_image}"
    image_key_file = root / "image" / in_image.relative_to("/")
    image_key_file.parent.mkdir(parents=True)
    shutil.copyfile(public, image_key_file)

    with pg_database("kcache_fleet") as db_url:
        volumes = {v["name"]: v for v in spec["volumes"]}
        modes = {
            v["secret"]["secretName"]: v["secret"].get("defaultMode", 0o644)
            for v in volumes.values()
            if "secret" in v
        }
        tokens = {"admin": "kc_" + "a" * 40, "metrics": "kc_" + "m" * 40}
        secrets = {
            "kcache-db": {"url": db_url},
            "kcache-s3": {
                "access-key-id": CREDENTIALS["AWS_ACCESS_KEY_ID"],
                "secret-access-key": CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            },
        }
        secret_dirs = {
            "kcache-tokens": _secret_dir(
                root, "kcache-tokens", dict(tokens), modes["kcache-tokens"]
            ),
            "kcache-signing-key": _secret_dir(
                root,
                "kcache-signing-key",
                {from_file: operator / from_file},
                modes["kcache-signing-key"],
            ),
        }
        (server,) = [c for c in spec["containers"] if c["name"] == "kcache"]
        store_url = next(e["value"] for e in server["env"] if e["name"] == "KCACHE_STORE_URL")
        bucket, _, prefix = store_url.removeprefix("s3://").partition("/")
        store_url = f"s3://{s3.new_bucket(bucket)}/{prefix}"
        overrides = {
            "AWS_ENDPOINT_URL": s3.endpoint,
            "KCACHE_STORE_URL": store_url,
            "KCACHE_COMPILE_WORKERS": "1",
        }
        pods = [
            _pod(name, root, spec, secrets, secret_dirs, overrides) for name in ("pod-a", "pod-b")
        ]
        replicas: list[ServerProcess] = []
        pod_nginx: list[PodNginx] = []
        service: ServiceNginx | None = None
        try:
            for pod in pods:
                _init(pod, spec)
            for pod in pods:
                replica = ServerProcess(
                    pod.mounts["/data"],
                    env=pod.env,
                    cwd=pod.root,
                    log=pod.root / "serve.log",
                    command=lambda port: _serve_argv(spec, port),
                )
                replica.launch()
                replicas.append(replica)
            for pod, replica in zip(pods, replicas, strict=True):
                replica.wait_ready(timeout=180, ready="/readyz")
                (nginx,) = [c for c in spec["containers"] if c["name"] == "nginx"]
                values = {e["name"]: pod.moved(str(e["value"])) for e in nginx["env"]}
                values["KCACHE_REPLICA"] = replica.url.removeprefix("http://")
                pod_nginx.append(PodNginx(pod.root / "nginx", values))
            service = ServiceNginx(root / "service", [f"127.0.0.1:{n.port}" for n in pod_nginx])
            token = subprocess.run(
                [KCACHE, "token", "create", "job", "--scope", "compile"],
                env=pods[0].env,
                capture_output=True,
                text=True,
                check=True,
            ).stdout.strip()
            yield Fleet(
                service,
                pods,
                replicas,
                pod_nginx,
                fleet_key,
                image_key_file,
                trusted_setting,
                token,
                tokens["metrics"],
                db_url,
                root,
                s3,
                store_url,
                spec,
                header,
            )
        finally:
            for process in (service, *pod_nginx):
                if process is not None:
                    process.stop()
            for replica in replicas:
                replica.stop()


def _kernels(tag: str) -> list[dict[str, Any]]:
    """Recipes new to the fleet, each a kernel of its own name."""
    return [
        {
            "source": VECTOR_ADD.replace("void add(", f"void {tag}_{i}_{unique('k')[2:14]}("),
            "target": "sm_90",
        }
        for i in range(KERNELS)
    ]


def _client_env(fleet: Fleet, home: Path) -> dict[str, str]:
    """A job's environment: a fresh home, the fleet's URL and a token, and for trust only
    what the image carries (the header's KCACHE_TRUSTED_KEYS, its file here)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KCACHE_", "AWS_", "XDG_"))}
    name, value = fleet.trusted_setting.split("=", 1)
    assert name == "KCACHE_TRUSTED_KEYS" and value.startswith("@/")
    env.update(
        HOME=str(home),
        KCACHE_URL=fleet.service.url,
        KCACHE_TOKEN=fleet.token,
        KCACHE_TRUSTED_KEYS=f"@{fleet.image_key_file}",  # the image's file, here
    )
    return env


SIGNED = re.compile(r"^/v1/(resolve|recipes/[0-9a-f]{64}(/artifact)?|bundle.*|batch.*)$")


def test_every_first_time_compile_and_fetch_through_one_url_is_accepted(fleet: Fleet) -> None:
    home = fleet.root / unique("job-home")
    home.mkdir()
    before = len(fleet.service.routed())
    recipes = _kernels("accepted")
    ran = subprocess.run(
        [sys.executable, "-c", CLIENT, json.dumps(recipes), str(home)],
        env=_client_env(fleet, home),
        cwd=home,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert ran.returncode == 0, ran.stderr
    results = json.loads(ran.stdout.splitlines()[-1])
    errors = [r["error"] for r in results if "error" in r]
    assert errors == [], errors  # 100 %: not one answer refused
    compiled = [r for r in results if r["phase"] == "compile"]
    fetched = [r for r in results if r["phase"] == "fetch"]
    assert len(compiled) == len(fetched) == KERNELS
    assert {r["origin"] for r in compiled} <= {"compiled", "waited"}  # new to the fleet
    assert {r["origin"] for r in fetched} == {"server"}  # each from a fresh home
    assert [r["digest"] for r in compiled] == [r["digest"] for r in fetched]
    # Both pods answered signed requests (the Service's log says which pod took each).
    signed = [
        (pod, path)
        for pod, method, path, status in fleet.service.routed()[before:]
        if status == "200" and SIGNED.match(path)
    ]
    by_pod = Counter(pod for pod, _ in signed)
    assert set(by_pod) == {f"127.0.0.1:{n.port}" for n in fleet.pod_nginx}, by_pod


def test_consecutive_answers_from_both_replicas_verify_by_the_fleet_key(fleet: Fleet) -> None:
    trusted = TrustedKeys.parse(f"@{fleet.image_key_file}")
    assert trusted.key_ids == [fleet.fleet_key.key_id]
    (recipe,) = _kernels("probe")[:1]
    headers = {"Authorization": f"Bearer {fleet.token}"}
    before = len(fleet.service.routed())
    answers = [
        httpx.post(
            f"{fleet.service.url}/v1/resolve",
            json={"recipe": recipe},
            headers=headers,
            timeout=300,
        )
        for _ in range(4)  # round-robin: consecutive requests go to alternate pods
    ]
    pods = [pod for pod, method, path, _ in fleet.service.routed()[before:] if method == "POST"]
    assert len(set(pods)) == 2 and pods[0::2] == [pods[0]] * 2, pods
    for answer in answers:
        assert answer.status_code == 200, answer.text
        body = answer.json()
        signature = Signature.from_dict(body["signature"])
        assert signature.key_id == fleet.fleet_key.key_id
        trusted.verify(body["recipe_key"], ArtifactMeta.from_dict(body["artifact"]), signature)
    keys = {
        json.dumps(
            httpx.get(f"{fleet.service.url}/v1/keys", headers=headers, timeout=30).json(),
            sort_keys=True,
        )
        for _ in range(2)
    }
    assert len(keys) == 1  # both pods publish the one key
    (published,) = keys
    assert json.loads(published)["signing_key_id"] == fleet.fleet_key.key_id


def _third_pod(fleet: Fleet, name: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    """A pod more on the fleet's database: its init, then its server (which must not serve)."""
    secrets = {
        "kcache-db": {"url": fleet.db_url},
        "kcache-s3": {
            "access-key-id": CREDENTIALS["AWS_ACCESS_KEY_ID"],
            "secret-access-key": CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        },
    }
    secret_dirs = {
        "kcache-tokens": fleet.pods[0].mounts["/run/secrets/kcache"],
        "kcache-signing-key": kw.pop("signing_dir", None)
        or fleet.pods[0].mounts[next(m for m in fleet.pods[0].mounts if "signing" in m)],
    }
    overrides = {
        "AWS_ENDPOINT_URL": fleet.s3.endpoint,
        "KCACHE_STORE_URL": fleet.store_url,
        "KCACHE_COMPILE_WORKERS": "1",
    }
    pod = _pod(name, fleet.root, fleet.pod_spec, secrets, secret_dirs, overrides, **kw)
    _init(pod, fleet.pod_spec)
    return subprocess.run(
        _serve_argv(fleet.pod_spec, free_port()),
        env=pod.env,
        cwd=pod.root,
        capture_output=True,
        text=True,
        timeout=120,  # it refuses at start-up; a server that served would run into this
        check=False,
    )


def _keys_recorded(fleet: Fleet) -> list[dict[str, Any]]:
    listed = subprocess.run(
        [KCACHE, "db", "signing-keys", "--json"],
        env=fleet.pods[0].env,
        capture_output=True,
        text=True,
        check=True,
    )
    rows: list[dict[str, Any]] = json.loads(listed.stdout)
    return rows


def test_a_replica_given_another_key_refuses_to_start_in_one_line(fleet: Fleet) -> None:
    # Someone's Secret with a key of its own (made as the header says, somewhere else).
    other_dir = fleet.root / "other-operator"
    other_dir.mkdir()
    other = SigningKey.load_or_create(other_dir / "signing-key.pem")
    mode = next(
        v["secret"]["defaultMode"]
        for v in fleet.pod_spec["volumes"]
        if v.get("secret", {}).get("secretName") == "kcache-signing-key"
    )
    signing_dir = _secret_dir(
        fleet.root / "other",
        "kcache-signing-key",
        {"signing-key.pem": other_dir / "signing-key.pem"},
        mode,
    )
    ran = _third_pod(fleet, "pod-other-key", signing_dir=signing_dir)
    assert ran.returncode == 2, ran.stdout + ran.stderr
    lines = [line for line in ran.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in ran.stderr, ran.stderr
    (line,) = lines
    assert line.startswith("kcache: refusing to start:")
    assert f"names key {fleet.fleet_key.key_id} as the signing key" in line
    assert f"signs with key {other.key_id} (KCACHE_SIGNING_KEY_FILE=" in line
    assert f"`kcache db signing-keys retire {fleet.fleet_key.key_id}`" in line
    rows = _keys_recorded(fleet)
    assert [(r["key_id"], r["state"]) for r in rows] == [(fleet.fleet_key.key_id, "in use")]


def test_a_replica_without_the_fleet_key_refuses_to_start_in_one_line(fleet: Fleet) -> None:
    # The manifest as it was: no KCACHE_SIGNING_KEY_FILE, so the pod made a key of its own.
    ran = _third_pod(fleet, "pod-own-key", drop=("KCACHE_SIGNING_KEY_FILE",))
    assert ran.returncode == 2, ran.stdout + ran.stderr
    (line,) = [line for line in ran.stderr.splitlines() if line.strip()]
    assert "KCACHE_SIGNING_KEY_FILE is unset, so it was made as" in line
    assert f"names key {fleet.fleet_key.key_id} as the signing key" in line
    # And the fleet serves on, with its one key.
    assert httpx.get(f"{fleet.service.url}/healthz", timeout=30).status_code == 200
    assert [r["state"] for r in _keys_recorded(fleet)] == ["in use"]
