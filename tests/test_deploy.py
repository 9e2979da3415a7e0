"""``deploy/`` as shipped: the files parse, agree with each other, and their command lines run.

- Every ``kcache`` command line in them (the Dockerfile's CMD, compose's and Kubernetes'
  commands, ``sh -c`` chains included) parses with the real ``kcache`` parser, so a
  renamed flag fails here rather than in a cluster.
- Prometheus sends a bearer token read from a file (``authorization.credentials_file``)
  that compose mounts from a secret and the Kubernetes manifest from its token Secret;
  the migrate step (compose's ``migrate`` service, Kubernetes' init container) upgrades
  the database and stores the tokens before any replica starts, since a server bound to
  0.0.0.0 refuses to start without one.
- Replicas share no filesystem: compose's each mount a data volume of their own and
  Kubernetes' an emptyDir; every replica has ``KCACHE_STORE_URL`` and the ``AWS_*``
  variables, the key pair from a secret (compose: files the replica's command exports;
  Kubernetes: the documented ``kcache-s3`` Secret), and compose's replicas start only
  after the one-shot bucket job (``mc mb --ignore-existing``) and the migrate step.
- The container's entrypoint runs here: compose's migrate chain twice (the second run
  changes nothing), Kubernetes' init chain on the same directory, then the image's CMD on
  a free port with the image's environment (SQLite in a temporary data directory instead
  of the PostgreSQL service). ``/readyz`` answers, ``/metrics`` refuses a request without
  a token and answers Prometheus' token, and the image's HEALTHCHECK command passes.
- The secret files compose reads (``deploy/secrets/``) are ignored by git and kept out of
  the image's build context (``.dockerignore``).
- One fleet signing key: every replica (compose's and the Kubernetes Deployment's) reads
  the same private key file from one secret (``KCACHE_SIGNING_KEY_FILE``: compose's
  ``kcache-signing-key`` file, the ``kcache-signing-key`` Secret mounted read-only with a
  mode only its owner reads), never a key of its own data directory; the commands that
  make it, as the files' headers write them, run here and make a key a server loads.
- ``deploy/build-image`` (run here with a stand-in ``docker`` that records its commands)
  builds the image from the repository root and tags it ``kcache-server:VERSION``, the tag
  Kubernetes (``imagePullPolicy: IfNotPresent``) and compose run; ``--push`` pushes it;
  ``--fleet-key PUBFILE`` passes the fleet's public key(s), which the Dockerfile's steps
  (run here in a scratch root) write to ``/etc/kcache/fleet-key.pub`` and name in
  ``KCACHE_TRUSTED_KEYS``, as a client reads them.
- ``deploy/install-systemd`` runs here for real, in a copy of the clone, with stand-ins for
  ``useradd``/``id``/``systemctl``: it creates the user the unit names and the venv its
  commands live in, keeps the signing key an earlier install made in its data directory
  as the unit's credential (``LoadCredential``, mode 0600) with its public half beside it,
  installs the unit, and the unit's ``ExecStartPre`` runs from that venv.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import stat
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import pytest

from kcache._version import __version__ as VERSION
from kcache.signing import SigningKey, TrustedKeys
from tests.cli_harness import user_env
from tests.support import ROOT, ServerProcess, copy_sources

yaml = pytest.importorskip("yaml")

DEPLOY = ROOT / "deploy"
#: The venv's ``kcache`` (what an operator runs).
KCACHE_CMD = str(Path(sys.executable).with_name("kcache"))
TOKEN_PATH = "/run/secrets/kcache-metrics-token"
#: The fleet's signing key: the Kubernetes Secret's name and compose's secret's.
SIGNING_SECRET = "kcache-signing-key"
#: Where an image carries the fleet's public key (KCACHE_TRUSTED_KEYS=@FILE).
FLEET_KEY_FILE = "/etc/kcache/fleet-key.pub"


def _yaml(name: str) -> Any:
    return yaml.safe_load((DEPLOY / name).read_text())


def _k8s() -> dict[str, dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all((DEPLOY / "kubernetes.yaml").read_text()) if d]
    return {f"{d['kind']}/{d['metadata']['name']}": d for d in docs}


def _dockerfile_json(instruction: str) -> list[str]:
    """The exec-form (JSON) argument list of the Dockerfile's ``instruction`` (CMD, ...)."""
    text = (DEPLOY / "Dockerfile").read_text().replace("\\\n", " ")
    match = re.search(rf"^{instruction}\b.*?(\[.*\])\s*$", text, re.M)
    assert match, f"no exec-form {instruction} in the Dockerfile"
    argv: list[str] = json.loads(match.group(1))
    return argv


def _kcache_lines(argv: list[str]) -> list[list[str]]:
    """The ``kcache`` invocations an argument list runs (one, or each of an ``sh -c`` chain).

    ``export`` steps of a chain (secrets read into variables) are left out; ``exec`` is dropped.
    """
    if argv[:2] == ["sh", "-c"]:
        parts = [shlex.split(part) for part in argv[2].split("&&") if part.strip()]
        return [p[1:] if p[0] == "exec" else p for p in parts if p[0] != "export"]
    return [argv]


def _compose_replicas() -> list[str]:
    """compose's kcache replicas: the services built from the image that serve on 8470."""
    services = _yaml("compose.yaml")["services"]
    return [
        name
        for name, svc in services.items()
        if "build" in svc and any(p.endswith(":8470") for p in svc.get("ports", []))
    ]


def _kcache_containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    """The pod's kcache containers (not the nginx beside them, deploy/nginx/)."""
    return [c for c in pod["containers"] if c["name"] != "nginx"]


def _all_commands() -> dict[str, list[str]]:
    compose = _yaml("compose.yaml")["services"]
    k8s = _k8s()["Deployment/kcache"]["spec"]["template"]["spec"]
    return {
        "Dockerfile CMD": _dockerfile_json("CMD"),
        "compose migrate": compose["migrate"]["command"],
        **{f"compose {name}": compose[name]["command"] for name in _compose_replicas()},
        "kubernetes init": k8s["initContainers"][0]["command"],
        "kubernetes server": k8s["containers"][0]["command"],
    }


def test_every_kcache_command_line_parses() -> None:
    from kcache.cli import build_parser

    parser = build_parser()
    seen = 0
    for where, argv in _all_commands().items():
        for words in _kcache_lines(argv):
            assert words[0] == "kcache", f"{where}: {words}"
            try:
                parser.parse_args(words[1:])
            except SystemExit:
                pytest.fail(f"{where}: `{shlex.join(words)}` does not parse")
            seen += 1
    assert seen >= 10
    commands = _all_commands()
    assert commands["kubernetes server"] == _dockerfile_json("CMD")
    for name in _compose_replicas():  # the image's server command, after the secrets
        assert _kcache_lines(commands[f"compose {name}"]) == [_dockerfile_json("CMD")]


def test_migrate_steps_upgrade_and_store_the_tokens_first() -> None:
    for where, argv in _all_commands().items():
        if "migrate" not in where and "init" not in where:
            continue
        steps = [words[1:3] for words in _kcache_lines(argv)]
        assert steps[0] == ["db", "upgrade"], where
        stores = [w for w in _kcache_lines(argv) if w[1:3] == ["token", "create"]]
        assert {w[3] for w in stores} == {"admin", "prometheus"}, where
        for words in stores:
            assert "--token-file" in words and "--exist-ok" in words, where
    compose = _yaml("compose.yaml")["services"]
    for replica in ("kcache-a", "kcache-b"):
        assert compose[replica]["depends_on"]["migrate"] == {
            "condition": "service_completed_successfully"
        }


def test_prometheus_sends_a_token_from_a_mounted_secret() -> None:
    compose = _yaml("compose.yaml")
    configs = {
        "prometheus.yml": _yaml("prometheus.yml"),
        "kubernetes ConfigMap": yaml.safe_load(
            _k8s()["ConfigMap/kcache-prometheus"]["data"]["prometheus.yml"]
        ),
    }
    for where, config in configs.items():
        (job,) = config["scrape_configs"]
        assert job["metrics_path"] == "/metrics", where
        assert job["authorization"] == {"type": "Bearer", "credentials_file": TOKEN_PATH}, where
    # compose mounts secret NAME at /run/secrets/NAME: the metrics token, made by migrate.
    assert TOKEN_PATH.rsplit("/", 1)[1] in compose["services"]["prometheus"]["secrets"]
    assert "/etc/prometheus/prometheus.yml" in compose["services"]["prometheus"]["volumes"][0]
    targets = configs["prometheus.yml"]["scrape_configs"][0]["static_configs"][0]["targets"]
    assert {t.split(":")[0] for t in targets} == {"kcache-a", "kcache-b"}
    (sd,) = configs["kubernetes ConfigMap"]["scrape_configs"][0]["dns_sd_configs"]
    assert sd["names"][0].startswith("kcache-metrics.")
    assert _k8s()["Service/kcache-metrics"]["spec"]["clusterIP"] == "None"


def test_kubernetes_takes_its_secrets_from_the_secrets_it_documents() -> None:
    k8s = _k8s()
    pod = k8s["Deployment/kcache"]["spec"]["template"]["spec"]
    header = (DEPLOY / "kubernetes.yaml").read_text().split("apiVersion", 1)[0]
    volumes = {v["name"]: v for v in pod["volumes"]}
    secret = volumes["tokens"]["secret"]["secretName"]
    assert f"kubectl create secret generic {secret}" in header
    (init,) = pod["initContainers"]
    mount = next(m for m in init["volumeMounts"] if m["name"] == "tokens")["mountPath"]
    token_files = [
        w[w.index("--token-file") + 1]
        for w in _kcache_lines(init["command"])
        if "--token-file" in w
    ]
    for path in token_files:
        assert (
            path.startswith(mount + "/") and f"--from-literal={path.rsplit('/', 1)[1]}=" in header
        )
    for container in (init, pod["containers"][0]):
        env = {e["name"]: e for e in container["env"]}
        db = env["KCACHE_DB_URL"]["valueFrom"]["secretKeyRef"]
        assert f"kubectl create secret generic {db['name']}" in header and db["key"] in header
        assert "postgresql+psycopg://" in header
    server = pod["containers"][0]
    assert server["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert server["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert _yaml("compose.yaml")["x-kcache-env"]["KCACHE_DB_URL"].startswith(
        "postgresql+psycopg://"
    )


SECRET_DIR = "/run/secrets/"
AWS_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")


def _exported_secrets(argv: list[str]) -> dict[str, str]:
    """``export NAME="$(cat /run/secrets/FILE)"`` steps of an ``sh -c`` chain: NAME -> FILE."""
    found: dict[str, str] = {}
    for part in argv[2].split("&&") if argv[:2] == ["sh", "-c"] else []:
        match = re.fullmatch(r'\s*export (\w+)="\$\$\(cat /run/secrets/([\w.-]+)\)"\s*', part)
        if match:
            found[match.group(1)] = match.group(2)
    return found


def test_compose_replicas_share_no_filesystem_and_reach_the_bucket() -> None:
    compose = _yaml("compose.yaml")
    services, secrets = compose["services"], compose["secrets"]
    replicas = _compose_replicas()
    assert len(replicas) >= 2
    bucket_job = services["bucket"]
    assert bucket_job["image"].split(":")[0] == "minio/mc"
    assert bucket_job["depends_on"] == {"minio": {"condition": "service_healthy"}}
    mb = [w for w in _kcache_lines(bucket_job["entrypoint"]) if w[:2] == ["mc", "mb"]]
    assert mb and "--ignore-existing" in mb[0], bucket_job["entrypoint"]
    minio = services["minio"]
    assert minio["image"].split(":")[0] == "minio/minio" and minio["command"] == ["server", "/data"]
    # MinIO's root key pair is the secret pair the bucket job and the replicas use.
    minio_files = {
        minio["environment"][f"MINIO_ROOT_{v}_FILE"].removeprefix(SECRET_DIR)
        for v in ("USER", "PASSWORD")
    }
    assert minio_files <= set(minio["secrets"]) and minio_files <= set(secrets)
    assert all(f"/run/secrets/{name}" in bucket_job["entrypoint"][2] for name in minio_files)
    data_volumes: list[str] = []
    for name in replicas:
        svc = services[name]
        env = svc["environment"]
        store_url = env["KCACHE_STORE_URL"]
        assert store_url.startswith("s3://") and mb[0][-1] == "minio/" + store_url[5:].split("/")[0]
        assert env["AWS_ENDPOINT_URL"] == "http://minio:9000" and env["AWS_REGION"], name
        assert env["KCACHE_DB_URL"].startswith("postgresql+psycopg://"), name
        exported = _exported_secrets(svc["command"])
        assert set(exported) == set(AWS_KEYS), (name, svc["command"])
        assert set(exported.values()) == minio_files, name
        assert set(exported.values()) <= set(svc["secrets"]), name
        assert svc["depends_on"]["bucket"] == {"condition": "service_completed_successfully"}
        assert svc["depends_on"]["migrate"] == {"condition": "service_completed_successfully"}
        mounts = [v.split(":") for v in svc["volumes"]]
        # Its data directory, and the directory of its nginx's edge log, read-only.
        edge_dir = str(PurePosixPath(env["KCACHE_EDGE_LOG"]).parent)
        assert [m[1] for m in mounts] == [env["KCACHE_DATA_DIR"], edge_dir], name
        assert mounts[1][-1] == "ro", name  # nginx writes the edge log, the replica reads it
        assert all(m[0] in compose["volumes"] for m in mounts), name  # named, not a host path
        data_volumes += [m[0] for m in mounts]
    assert len(set(data_volumes)) == len(data_volumes), f"replicas share a volume: {data_volumes}"
    # Nothing else mounts a replica's volumes (the migrate step needs none) but the nginx in
    # front of that replica: its data read-only (deploy/nginx/: it sends the replica's files),
    # its edge log's directory read-write (nginx writes the log), at the same path.
    for name, svc in services.items():
        if name not in replicas:
            shared = [
                v.split(":") for v in svc.get("volumes", []) if v.split(":")[0] in data_volumes
            ]
            if name.startswith("nginx-"):
                replica = services[svc["environment"]["KCACHE_REPLICA"].split(":")[0]]
                data, edge = (v.split(":") for v in replica["volumes"])
                assert [m[0] for m in shared] == [data[0], edge[0]], name
                assert shared[0][-1] == "ro" and len(shared[1]) == 2, name
                assert shared[1][1] == edge[1], name
                assert (
                    svc["environment"]["KCACHE_EDGE_LOG"]
                    == replica["environment"]["KCACHE_EDGE_LOG"]
                ), name
            else:
                assert not shared, name


def test_kubernetes_pods_keep_their_own_data_and_reach_the_bucket() -> None:
    k8s = _k8s()
    header = (DEPLOY / "kubernetes.yaml").read_text().split("apiVersion", 1)[0]
    assert "bucket is external" in header
    assert not [d for d in k8s.values() if d["kind"] == "PersistentVolumeClaim"]
    pod = k8s["Deployment/kcache"]["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    for container in (*pod["initContainers"], *_kcache_containers(pod)):
        env = {e["name"]: e for e in container["env"]}
        assert env["KCACHE_STORE_URL"]["value"].startswith("s3://")
        assert env["AWS_ENDPOINT_URL"]["value"].startswith("http") and env["AWS_REGION"]["value"]
        for key in AWS_KEYS:
            ref = env[key]["valueFrom"]["secretKeyRef"]
            assert f"kubectl create secret generic {ref['name']}" in header, key
            assert f"--from-literal={ref['key']}=" in header, key
        data = next(m for m in container["volumeMounts"] if m["mountPath"] == "/data")
        assert env["KCACHE_DATA_DIR"]["value"] == "/data"
        assert "emptyDir" in volumes[data["name"]], "the data directory must be the pod's own"


def _comment_commands(name: str) -> list[list[str]]:
    """The command lines a deploy file's comments show (``#   cmd \\`` continued), as words."""
    lines = [
        line.lstrip("#").strip()
        for line in (DEPLOY / name).read_text().splitlines()
        if line.startswith("#")
    ]
    joined: list[str] = []
    for line in lines:
        if joined and joined[-1].endswith("\\"):
            joined[-1] = joined[-1][:-1] + " " + line
        else:
            joined.append(line)
    found = []
    for line in joined:
        try:
            found.append(shlex.split(line))
        except ValueError:  # prose with an apostrophe
            continue
    return found


def _signing_key_commands(name: str) -> list[list[str]]:
    """The ``kcache signing-key ...`` commands a deploy file's comments tell an operator to
    run (on a line of their own, or through ``docker compose run``)."""
    return [
        words[words.index("kcache") :]
        for words in _comment_commands(name)
        if words[:1] == ["kcache"] or words[:3] == ["docker", "compose", "run"]
        if "kcache" in words and words[words.index("kcache") :][1:2] == ["signing-key"]
    ]


def test_every_replica_reads_the_one_fleet_signing_key() -> None:
    k8s = _k8s()
    header = (DEPLOY / "kubernetes.yaml").read_text().split("apiVersion", 1)[0]
    pod = k8s["Deployment/kcache"]["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    for container in _kcache_containers(pod):
        env = {e["name"]: e for e in container["env"]}
        key = PurePosixPath(env["KCACHE_SIGNING_KEY_FILE"]["value"])
        assert not key.is_relative_to(env["KCACHE_DATA_DIR"]["value"])  # not a pod's own
        (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == str(key.parent)]
        assert mount["readOnly"] is True
        secret = volumes[mount["name"]]["secret"]
        assert secret["secretName"] == SIGNING_SECRET
        assert secret["defaultMode"] & 0o077 == 0, "the server refuses a key others may read"
        # The Secret as the header makes it: its one key is the file the replica reads.
        assert f"kubectl create secret generic {SIGNING_SECRET} --from-file={key.name}" in header
    (init,) = pod["initContainers"]  # the migrate step signs nothing: no private key there
    assert all(
        volumes[m["name"]].get("secret", {}).get("secretName") != SIGNING_SECRET
        for m in init["volumeMounts"]
    )
    assert f"KCACHE_TRUSTED_KEYS=@{FLEET_KEY_FILE}" in header

    compose = _yaml("compose.yaml")
    replicas = _compose_replicas()
    for name in replicas:
        svc = compose["services"][name]
        assert svc["environment"]["KCACHE_SIGNING_KEY_FILE"] == f"/run/secrets/{SIGNING_SECRET}"
        assert SIGNING_SECRET in svc["secrets"], name
    for name, svc in compose["services"].items():  # the private key: the replicas' alone
        if name not in replicas:
            assert SIGNING_SECRET not in svc.get("secrets", []), name
    assert compose["secrets"][SIGNING_SECRET]["file"].startswith("./secrets/")


@pytest.mark.parametrize("deploy_file", ["kubernetes.yaml", "compose.yaml"])
def test_the_documented_key_commands_make_a_key_a_server_loads(
    deploy_file: str, tmp_path: Path
) -> None:
    from kcache.cli import build_parser

    commands = _signing_key_commands(deploy_file)
    (create,) = [c for c in commands if c[2] == "create"]
    build_parser().parse_args(create[1:])
    # Paths as written (compose's run in a container with secrets/ at /out), made here.
    out = "/out/"
    words = [w.replace(out, f"{tmp_path}/") if w.startswith(out) else w for w in create]
    done = subprocess.run(
        [KCACHE_CMD, *words[1:]], cwd=tmp_path, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    private = tmp_path / PurePosixPath(create[3]).name
    public = tmp_path / PurePosixPath(create[create.index("--public") + 1]).name
    key = SigningKey.load(private)  # the server's own check: mode 0600, an Ed25519 PEM
    assert oct(private.stat().st_mode & 0o777) == oct(0o600)
    assert done.stdout.strip() == key.public_key
    assert TrustedKeys.parse(f"@{public}").key_ids == [key.key_id]  # KCACHE_TRUSTED_KEYS=@FILE
    if deploy_file == "compose.yaml":  # the file compose's secret names, under deploy/secrets
        secret = _yaml("compose.yaml")["secrets"][SIGNING_SECRET]["file"]
        assert PurePosixPath(secret).name == private.name
    again = subprocess.run([KCACHE_CMD, *words[1:]], cwd=tmp_path, capture_output=True, text=True)
    assert again.returncode != 0 and "never replaces a key" in again.stderr
    assert SigningKey.load(private).key_id == key.key_id


# ---------------------------------------------------------------------------- run them here
@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, str]]]:
    """The image's environment with its secrets here, after the migrate steps; the server running."""
    root = tmp_path_factory.mktemp("deploy")
    tokens = {"admin": "kc_" + "a" * 40, "metrics": "kc_" + "m" * 40}
    secret_files: dict[str, Path] = {}
    compose = _yaml("compose.yaml")
    for name, spec in compose["secrets"].items():  # compose: /run/secrets/NAME from a file
        path = root / "compose-secrets" / Path(spec["file"]).name
        path.parent.mkdir(exist_ok=True)
        if name == SIGNING_SECRET:
            SigningKey.load_or_create(path)
        else:
            path.write_text(tokens["admin" if "admin" in name else "metrics"] + "\n")
        secret_files[f"/run/secrets/{name}"] = path
    pod = _k8s()["Deployment/kcache"]["spec"]["template"]["spec"]
    mount = next(m for m in pod["initContainers"][0]["volumeMounts"] if m["name"] == "tokens")
    for key, value in tokens.items():  # Kubernetes: the Secret's keys as files under the mount
        path = root / "k8s-secrets" / key
        path.parent.mkdir(exist_ok=True)
        path.write_text(value)
        secret_files[f"{mount['mountPath']}/{key}"] = path
    image_env = {"KCACHE_DATA_DIR": str(root / "data")}  # the Dockerfile's ENV, moved here
    env = user_env(root, **image_env)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")

    def run(argv: list[str]) -> subprocess.CompletedProcess[str]:
        script = argv[2]
        for where, path in sorted(secret_files.items(), key=lambda item: -len(item[0])):
            script = script.replace(where, str(path))
        return subprocess.run(
            [*argv[:2], script], env=env, cwd=root, capture_output=True, text=True, check=False
        )

    for argv in (
        compose["services"]["migrate"]["command"],
        compose["services"]["migrate"]["command"],  # again: --exist-ok, nothing changes
        pod["initContainers"][0]["command"],  # another replica's init, same tokens
    ):
        done = run(argv)
        assert done.returncode == 0, done.stderr
        assert "Traceback" not in done.stderr
    cmd = _dockerfile_json("CMD")
    served = ServerProcess(
        root / "data",
        # Two compile workers per server process would only slow this machine down.
        env={**env, "KCACHE_COMPILE_WORKERS": "1"},
        cwd=root,
        log=root / "serve.log",
        command=lambda port: [str(port) if word == "8470" else word for word in cmd],
    )
    try:
        served.start(timeout=90, ready="/readyz")
        yield served.url, {**env, "PORT": str(served.port), "METRICS_TOKEN": tokens["metrics"]}
    finally:
        served.stop()


def _status(url: str, token: str | None = None) -> int:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as r:
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def test_the_image_serves_after_its_migrate_step(image: tuple[str, dict[str, str]]) -> None:
    url, env = image
    assert _status(f"{url}/readyz") == 200
    assert _status(f"{url}/metrics") == 401
    assert _status(f"{url}/metrics", env["METRICS_TOKEN"]) == 200  # what Prometheus sends
    healthcheck = [w.replace("8470", env["PORT"]) for w in _dockerfile_json("HEALTHCHECK.*?CMD")]
    assert subprocess.run(healthcheck, env=env, check=False, timeout=30).returncode == 0


# ---------------------------------------------------------------------------- secrets, image
def test_the_secret_files_are_ignored_by_git_and_the_image_build() -> None:
    compose = _yaml("compose.yaml")
    files = [(DEPLOY / spec["file"]).resolve() for spec in compose["secrets"].values()]
    assert files and all(f.parent == DEPLOY / "secrets" for f in files), files
    for path in files:
        relative = path.relative_to(ROOT).as_posix()
        ignored = subprocess.run(
            ["git", "check-ignore", "-q", "--no-index", relative], cwd=ROOT, check=False
        )
        assert ignored.returncode == 0, f"{relative} is not ignored by git"
    # compose builds from the repository root (context ..): its .dockerignore applies.
    assert compose["services"]["migrate"]["build"]["context"] == ".."
    patterns = [
        line.strip().rstrip("/")
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert "deploy/secrets" in patterns, patterns


def _fake_docker(where: Path) -> tuple[Path, Path]:
    """A ``docker`` that records each command line (one JSON list a line) and does nothing."""
    log = where / "docker.log"
    fake = where / "docker"
    fake.write_text(
        "#!/usr/bin/env python3\n"
        "import json, os, sys\n"
        f"with open({str(log)!r}, 'a') as f:\n"
        "    f.write(json.dumps([os.getcwd(), *sys.argv[1:]]) + '\\n')\n"
    )
    fake.chmod(0o755)
    return fake, log


def test_build_image_tags_the_release_that_kubernetes_and_compose_run(tmp_path: Path) -> None:
    fake, log = _fake_docker(tmp_path)
    image = f"kcache-server:{VERSION}"
    env = {**os.environ, "DOCKER": str(fake)}
    built = subprocess.run(
        [str(DEPLOY / "build-image")], env=env, capture_output=True, text=True, check=False
    )
    assert built.returncode == 0, built.stderr
    assert built.stdout.splitlines()[-1] == image
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert calls == [[str(ROOT), "build", "--file", "deploy/Dockerfile", "--tag", image, "."]]

    log.unlink()
    pushed = subprocess.run(
        [str(DEPLOY / "build-image"), "--push", "registry.example/ml/"],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert pushed.returncode == 0, pushed.stderr
    assert pushed.stdout.splitlines()[-1] == f"registry.example/ml/{image}"
    calls = [json.loads(line)[1:] for line in log.read_text().splitlines()]
    assert calls[1:] == [
        ["tag", image, f"registry.example/ml/{image}"],
        ["push", f"registry.example/ml/{image}"],
    ]
    refused = subprocess.run(
        [str(DEPLOY / "build-image"), "--push"], env=env, capture_output=True, text=True
    )
    assert refused.returncode != 0 and "--push needs a registry" in refused.stderr

    pod = _k8s()["Deployment/kcache"]["spec"]["template"]["spec"]
    for container in (*pod["initContainers"], *_kcache_containers(pod)):
        assert container["image"] == image, container["name"]
        assert container["imagePullPolicy"] == "IfNotPresent", container["name"]
    assert "deploy/build-image --push REGISTRY" in (DEPLOY / "kubernetes.yaml").read_text()
    services = _yaml("compose.yaml")["services"]
    for name in ("migrate", *_compose_replicas()):
        assert services[name]["image"] == image, name


def _dockerfile_fleet_steps() -> tuple[str, str]:
    """The Dockerfile's step that writes the fleet's public key, and the value its ENV gives
    KCACHE_TRUSTED_KEYS (the build argument KCACHE_FLEET_KEY, which it declares, in both)."""
    text = (DEPLOY / "Dockerfile").read_text().replace("\\\n", " ")
    assert re.search(r"^ARG KCACHE_FLEET_KEY$", text, re.M), "no ARG KCACHE_FLEET_KEY"
    (run,) = [
        line[len("RUN ") :]
        for line in text.splitlines()
        if line.startswith("RUN ") and FLEET_KEY_FILE in line
    ]
    match = re.search(r"^ENV KCACHE_TRUSTED_KEYS=(\S+)$", text, re.M)
    assert match, "no ENV KCACHE_TRUSTED_KEYS"
    return run, match.group(1)


def test_the_image_carries_the_fleet_public_key_it_is_built_with(tmp_path: Path) -> None:
    fake, log = _fake_docker(tmp_path)
    env = {**os.environ, "DOCKER": str(fake)}
    old, new = (SigningKey.load_or_create(tmp_path / f"{n}.pem") for n in ("old", "new"))
    caller = tmp_path / "ops"
    caller.mkdir()
    # During a rotation the file holds both keys, one a line, as KCACHE_TRUSTED_KEYS=@FILE reads.
    (caller / "fleet-key.pub").write_text(
        f"# the fleet's keys\n{old.public_key}\n\n{new.public_key}  # since the rotation\n"
    )
    built = subprocess.run(
        [str(DEPLOY / "build-image"), "--fleet-key", "fleet-key.pub"],  # the caller's path
        cwd=caller,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert built.returncode == 0, built.stderr
    (call,) = [json.loads(line) for line in log.read_text().splitlines()]
    assert call[:5] == [str(ROOT), "build", "--file", "deploy/Dockerfile", "--build-arg"]
    assert call[6:] == ["--tag", f"kcache-server:{VERSION}", "."]
    name, value = call[5].split("=", 1)
    assert name == "KCACHE_FLEET_KEY"

    # The Dockerfile's steps with that argument, /etc/kcache in a scratch root: the file a
    # client reads through KCACHE_TRUSTED_KEYS trusts exactly the given keys.
    run, trusted = _dockerfile_fleet_steps()
    scratch = tmp_path / "image-root"
    moved = {"PATH": os.environ["PATH"], "KCACHE_FLEET_KEY": value}
    step = run.replace("/etc/kcache", f"{scratch}/etc/kcache")
    subprocess.run(["sh", "-c", step], env=moved, check=True)
    # Docker's ${NAME:+word} is the shell's: word when the argument is given, else empty.
    given = subprocess.run(
        ["sh", "-c", f'printf %s "{trusted}"'], env=moved, capture_output=True, text=True
    ).stdout
    assert given == f"@{FLEET_KEY_FILE}"
    parsed = TrustedKeys.parse(given.replace("/etc/kcache", f"{scratch}/etc/kcache"))
    assert set(parsed.key_ids) == {old.key_id, new.key_id}
    unset = subprocess.run(
        ["sh", "-c", f'printf %s "{trusted}"'],
        env={"PATH": os.environ["PATH"]},
        capture_output=True,
        text=True,
    ).stdout
    assert unset == ""  # no --fleet-key: the variable is empty, clients pin on first contact

    (caller / "empty.pub").write_text("# no key here\n")
    (caller / "private.pub").write_text((tmp_path / "old.pem").read_text())
    for wrong, said in (("empty.pub", "holds no public key"), ("private.pub", "not a public key")):
        refused = subprocess.run(
            [str(DEPLOY / "build-image"), "--fleet-key", wrong],
            cwd=caller,
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        assert refused.returncode == 2 and said in refused.stderr, refused.stderr
    assert len(log.read_text().splitlines()) == 1  # nothing built for them


# ---------------------------------------------------------------------------- systemd
def _unit() -> dict[str, list[str]]:
    """deploy/kcache.service's keys (each may repeat) -> values."""
    found: dict[str, list[str]] = {}
    for line in (DEPLOY / "kcache.service").read_text().splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, value = line.split("=", 1)
            found.setdefault(key, []).append(value)
    return found


def test_the_systemd_units_commands_parse() -> None:
    from kcache.cli import build_parser

    unit = _unit()
    for key in ("ExecStartPre", "ExecStart"):
        (line,) = unit[key]
        words = shlex.split(line)
        assert words[0] == "/opt/kcache/.venv/bin/kcache", line
        build_parser().parse_args(words[1:])
    assert unit["User"] == ["kcache"] and unit["StateDirectory"] == ["kcache"]
    assert unit["Environment"] == [
        "KCACHE_DATA_DIR=/var/lib/kcache",
        "KCACHE_SIGNING_KEY_FILE=/run/credentials/kcache.service/signing-key",
    ]
    # systemd hands the root-only key to the service as the credential the variable names.
    assert unit["LoadCredential"] == ["signing-key:/etc/kcache/signing-key.pem"]


STAND_INS = {
    # The user exists once useradd made it (nothing is created on this machine).
    "id": '[ -e "$STATE/user" ] && [ "$1" = -u ] && [ "$2" = "$(cat "$STATE/user")" ]',
    "useradd": 'echo "$@" >>"$STATE/useradd.log"; echo "${@: -1}" >"$STATE/user"',
    "systemctl": 'echo "$@" >>"$STATE/systemctl.log"',
}


def test_install_systemd_makes_the_user_and_venv_the_unit_needs(tmp_path: Path) -> None:
    clone = tmp_path / "clone"
    clone.mkdir()
    copy_sources(clone, "deploy")
    stand_ins, state = tmp_path / "bin", tmp_path / "state"
    stand_ins.mkdir()
    state.mkdir()
    for name, body in STAND_INS.items():
        (stand_ins / name).write_text(f"#!/usr/bin/env bash\n{body}\n")
        (stand_ins / name).chmod(0o755)
    prefix, units = tmp_path / "opt" / "kcache", tmp_path / "units"
    config, data = tmp_path / "etc-kcache", tmp_path / "var-lib-kcache"
    # An earlier install's server made its key at its first start, in its data directory.
    earlier = SigningKey.load_or_create(data / "signing-key.pem")
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("KCACHE_", "PYTHON", "VIRTUAL"))
    }
    env.update(
        PATH=f"{stand_ins}{os.pathsep}{env['PATH']}",
        STATE=str(state),
        KCACHE_PREFIX=str(prefix),
        KCACHE_UNIT_DIR=str(units),
        KCACHE_CONFIG_DIR=str(config),
        KCACHE_STATE_DIR=str(data),
        PYTHON=sys.executable,
    )
    done = subprocess.run(
        [str(clone / "deploy" / "install-systemd")],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=540,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    # The key clients pinned is kept, as the unit's credential: root's alone, its public half beside.
    key = config / "signing-key.pem"
    assert SigningKey.load(key).key_id == earlier.key_id
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert TrustedKeys.parse(f"@{config / 'fleet-key.pub'}").key_ids == [earlier.key_id]
    assert stat.S_IMODE((config / "fleet-key.pub").stat().st_mode) == 0o644
    useradd = (state / "useradd.log").read_text().split()
    assert useradd[-1] == "kcache" and "--system" in useradd, useradd
    assert useradd[useradd.index("--home-dir") + 1] == "/var/lib/kcache"  # the StateDirectory
    # systemd is not running here: the script says how to start it, and starts nothing.
    assert not (state / "systemctl.log").exists()
    assert "systemctl daemon-reload && systemctl enable --now kcache" in done.stderr

    installed = (units / "kcache.service").read_text()
    assert installed == (DEPLOY / "kcache.service").read_text().replace(
        "/opt/kcache/", f"{prefix}/"
    ).replace("/etc/kcache/", f"{config}/")
    assert f"LoadCredential=signing-key:{key}" in installed.splitlines()
    kcache = prefix / ".venv" / "bin" / "kcache"
    run_env = {k: v for k, v in env.items() if k not in ("KCACHE_PREFIX", "KCACHE_UNIT_DIR")}
    run_env["KCACHE_DATA_DIR"] = str(data)  # the unit's Environment=, moved here
    (pre,) = [
        line.split("=", 1)[1] for line in installed.splitlines() if line.startswith("ExecStartPre=")
    ]
    words = shlex.split(pre)
    assert words[0] == str(kcache)
    upgraded = subprocess.run(
        words, env=run_env, cwd=tmp_path, capture_output=True, text=True, check=False
    )
    assert upgraded.returncode == 0, upgraded.stderr
    assert (data / "kcache.db").exists()
    versions = subprocess.run(
        [
            str(prefix / ".venv" / "bin" / "python"),
            "-c",
            "import importlib.metadata as m; print(*(m.version(d) for d in "
            "('kcache-core', 'kcache-client', 'kcache-server', 'psycopg')))",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert versions[:3] == [VERSION] * 3, versions

    # On a host with no key yet (a first install), one is made.
    fresh = tmp_path / "etc-2"
    again = subprocess.run(
        [str(clone / "deploy" / "install-systemd")],
        env={**env, "KCACHE_CONFIG_DIR": str(fresh), "KCACHE_STATE_DIR": str(state)},
        capture_output=True,
        text=True,
        check=False,
        timeout=540,
    )
    assert again.returncode == 0, again.stdout + again.stderr
    made = SigningKey.load(fresh / "signing-key.pem")
    assert made.key_id != earlier.key_id
    assert stat.S_IMODE((fresh / "signing-key.pem").stat().st_mode) == 0o600
    assert TrustedKeys.parse(f"@{fresh / 'fleet-key.pub'}").key_ids == [made.key_id]
