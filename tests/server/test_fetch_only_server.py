"""A server that cannot compile starts and serves what is compiled; only compiles are refused.

The GPU image's NVRTC is 13.0, older than the 13.3 kcache compiles with (bundled headers):
``kcache serve`` there used to fail to start, though a replica behind a build farm or a
read-only edge needs no compiler. These tests run real ``kcache serve`` processes over one
data directory: a compiling server stores a kernel, then a server that cannot compile
serves it by key and as a resolve hit, answers what would compile with 501
``cannot_compile`` naming the reason and the fix, says so on ``GET /v1/toolchains``,
``/readyz`` (ready, the compiler ``degraded``), ``/metrics`` and ``GET /v1/verification``.

The server that cannot compile runs the real NVRTC 13.0 library: the
``nvidia-cuda-nvrtc==13.0.*`` wheel, fetched once with pip into a cache directory
(``KCACHE_TEST_CACHE``, default ``~/.cache/kcache-tests``) and preloaded into the server
process (``LD_PRELOAD``), where cuda-pathfinder finds it already loaded and cuda-bindings
uses it. Where pip cannot fetch it (an offline CI), those tests skip saying so; the same
behaviour through ``compiler = "off"`` runs everywhere.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.cli_harness import kcache, user_env
from tests.support import ServerProcess, unique, vector_add

#: The NVRTC the GPU image has: older than kcache's 13.3.
OLD_NVRTC = "13.0"
#: A foreign group's name beside its key (what a CuPy hook publishes).
FOREIGN = {"version": "13.6.0", "target": "sm_90", "toolchain": "nvrtc-13.0"}


def _test_cache() -> Path:
    return Path(os.environ.get("KCACHE_TEST_CACHE") or Path.home() / ".cache" / "kcache-tests")


def _fetch_old_nvrtc(dest: Path) -> Path:
    """``libnvrtc.so.13`` of NVRTC 13.0 under ``dest`` (fetched once); skip when pip cannot."""
    lib = dest / "libnvrtc.so.13"
    if lib.exists():
        return lib
    wheels = dest.parent / f".wheel-{os.getpid()}"
    try:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--only-binary=:all:",
                "--disable-pip-version-check",
                "-d",
                str(wheels),
                f"nvidia-cuda-nvrtc=={OLD_NVRTC}.*",
            ],
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
    except subprocess.TimeoutExpired:
        pytest.skip(f"pip could not fetch nvidia-cuda-nvrtc=={OLD_NVRTC}.* within 600 s")
    found = sorted(wheels.glob("nvidia_cuda_nvrtc-*.whl"))
    if done.returncode != 0 or not found:
        pytest.skip(
            f"pip could not fetch nvidia-cuda-nvrtc=={OLD_NVRTC}.* (offline?): "
            f"{(done.stderr or done.stdout).strip()[-300:]}"
        )
    staging = dest.parent / f".staging-{os.getpid()}"
    staging.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(found[0]) as wheel:
        for name in wheel.namelist():
            base = name.rsplit("/", 1)[-1]
            if base == "libnvrtc.so.13" or base.startswith("libnvrtc-builtins.so."):
                (staging / base).write_bytes(wheel.read(name))
    for path in wheels.iterdir():
        path.unlink()
    wheels.rmdir()
    if not (staging / "libnvrtc.so.13").exists():
        pytest.skip(f"the nvidia-cuda-nvrtc {OLD_NVRTC} wheel holds no libnvrtc.so.13")
    with contextlib.suppress(OSError):  # another process put it there first
        staging.rename(dest)
    return lib


@pytest.fixture(scope="module")
def old_nvrtc() -> Path:
    """The real NVRTC 13.0 library (see the module docstring)."""
    return _fetch_old_nvrtc(_test_cache() / f"nvrtc-{OLD_NVRTC}")


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A data directory where a compiling server stored one kernel: its recipe, key, digest."""
    data = tmp_path_factory.mktemp("fetch-only") / "data"
    with (
        ServerProcess(data, args=["--compile-workers", "1"]) as compiling,
        httpx.Client(base_url=compiling.url, timeout=120) as http,
    ):
        toolchain = http.get("/v1/toolchains").json()["default"]
        recipe = {**vector_add(unique("held")), "toolchain": toolchain}
        answer = http.post("/v1/resolve", json={"recipe": recipe, "compile": True})
        assert answer.status_code == 200, answer.text
        foreign_key, cubin = unique("cupy") + ".cubin", os.urandom(300)
        digest = hashlib.sha256(cubin).hexdigest()
        blob = http.put(
            f"/v1/blobs/{digest}",
            content=cubin,
            headers={"content-type": "application/octet-stream"},
        )
        assert blob.status_code == 200, blob.text
        files = [{"name": "kernel.cubin", "digest": digest, "size": len(cubin)}]
        published = http.put(f"/v1/foreign/cupy/{foreign_key}", json={**FOREIGN, "files": files})
        assert published.status_code == 200, published.text
    body = answer.json()
    return {
        "foreign_key": foreign_key,
        "data": data,
        "toolchain": toolchain,
        "recipe": recipe,
        "key": body["recipe_key"],
        "digest": body["artifact"]["digest"],
    }


def _fetch_only_server(
    stored: dict[str, Any], tmp_path: Path, env: dict[str, str], *args: str
) -> ServerProcess:
    server = ServerProcess(
        stored["data"],
        env={**os.environ, "KCACHE_TOOLCHAIN_DIR": str(tmp_path / "toolchain"), **env},
        args=["--compile-workers", "1", *args],
        log=tmp_path / "serve.log",
    )
    server.start(ready="/readyz")
    return server


@pytest.fixture
def old_nvrtc_server(
    stored: dict[str, Any], old_nvrtc: Path, tmp_path: Path
) -> Iterator[ServerProcess]:
    """A server over ``stored``'s data whose NVRTC is the real 13.0 library."""
    server = _fetch_only_server(stored, tmp_path, {"LD_PRELOAD": str(old_nvrtc)})
    try:
        yield server
    finally:
        server.stop()


def _refused(answer: httpx.Response) -> str:
    """The detail of a 501 ``cannot_compile`` answer (asserting it is one)."""
    assert answer.status_code == 501, answer.text
    body = answer.json()
    assert body["error"] == "cannot_compile", body
    assert "retry-after" not in answer.headers  # asking again changes nothing
    return str(body["detail"])


def _serves_fetches_and_refuses_compiles(
    server: ServerProcess, stored: dict[str, Any], reason: str
) -> None:
    """What every server that cannot compile does; ``reason`` is a phrase of why."""
    with httpx.Client(base_url=server.url, timeout=60) as http:
        # No default toolchain is advertised: the reason instead.
        assert reason in _refused(http.get("/v1/toolchains"))

        # Fetches by key and digest, and a resolve hit, are served.
        fetched = http.get(f"/v1/recipes/{stored['key']}/artifact")
        assert fetched.status_code == 200, fetched.text
        assert http.get(f"/v1/blobs/{stored['digest']}").status_code == 200
        for compile in (False, True):
            hit = http.post("/v1/resolve", json={"recipe": stored["recipe"], "compile": compile})
            assert hit.status_code == 200, hit.text
            assert hit.json()["status"] == "hit"
            assert hit.json()["artifact"]["digest"] == stored["digest"]

        foreign = http.get(f"/v1/foreign/cupy/{stored['foreign_key']}", params=FOREIGN)
        assert foreign.status_code == 200, foreign.text

        # A miss compiles nothing: 501 with the reason (404 when no compile was asked).
        new = {**vector_add(unique("miss")), "toolchain": stored["toolchain"]}
        detail = _refused(http.post("/v1/resolve", json={"recipe": new, "compile": True}))
        assert "this server cannot compile" in detail and reason in detail
        assert http.post("/v1/resolve", json={"recipe": new, "compile": False}).status_code == 404
        batch = http.post(
            "/v1/resolve/batch", json={"recipes": [stored["recipe"], new], "compile": True}
        )
        assert batch.status_code == 200, batch.text
        first, second = batch.json()["results"]
        assert first["status"] == "hit"
        assert second["status"] == "error" and second["error"] == "cannot_compile", second
        # A recipe naming no toolchain cannot even be keyed here.
        unnamed = vector_add(unique("unnamed"))
        detail = _refused(http.post("/v1/resolve", json={"recipe": unnamed, "compile": False}))
        assert "names no toolchain" in detail and reason in detail

        # Ready: it serves fetches; the compiler reads degraded, with the reason.
        ready = http.get("/readyz")
        assert ready.status_code == 200, ready.text
        checks = ready.json()["checks"]
        assert checks["compile_workers"].startswith("degraded: this server cannot compile")
        assert reason in checks["compile_workers"]
        assert checks["compile_sandbox"].startswith("degraded")

        verification = http.get("/v1/verification").json()
        assert verification["enabled"] is False
        assert reason in verification["disabled_reason"]

        metrics = http.get("/metrics").text
        assert "kcache_compiler_available 0.0" in metrics
        assert http.get("/v1/stats").status_code == 200
        assert http.get("/dashboard").status_code == 200
        spec = http.get("/openapi.json")
        assert spec.status_code == 200
        assert "501" in spec.json()["paths"]["/v1/resolve"]["post"]["responses"]


def test_a_server_with_nvrtc_older_than_13_3_starts_serves_fetches_and_refuses_compiles(
    old_nvrtc_server: ServerProcess, stored: dict[str, Any]
) -> None:
    reason = f"NVRTC {OLD_NVRTC}"
    _serves_fetches_and_refuses_compiles(old_nvrtc_server, stored, reason)
    log = old_nvrtc_server.log.read_text()
    warnings = [line for line in log.splitlines() if "this server cannot compile" in line]
    assert len(warnings) == 2, log[-3000:]  # the start, and verification being off
    start = warnings[0]
    assert f"NVRTC {OLD_NVRTC} (" in start and "is older than 13.3" in start
    assert "pip install 'kcache-core[nvrtc]==" in start


def test_the_client_says_why_a_server_that_cannot_compile_refused(
    old_nvrtc_server: ServerProcess, stored: dict[str, Any], tmp_path: Path
) -> None:
    from kcache_client import ClientSettings, KernelCache
    from kcache_client.errors import ServerResponseError

    from kcache.recipe import Recipe

    settings = ClientSettings.from_env(
        url=old_nvrtc_server.url, cache_dir=tmp_path / "tier", local_compile=False
    )
    with KernelCache(settings=settings) as cache:
        held = cache.get(Recipe.from_dict(stored["recipe"]))
        assert held.digest == stored["digest"]
        new = Recipe.from_dict({**vector_add(unique("client")), "toolchain": stored["toolchain"]})
        with pytest.raises(ServerResponseError) as refused:
            cache.get(new)
    text = str(refused.value)
    assert "HTTP 501 cannot_compile" in text
    assert f"NVRTC {OLD_NVRTC}" in text and "pip install 'kcache-core[nvrtc]==" in text


def test_compiler_required_keeps_the_refusal_to_start(
    stored: dict[str, Any], old_nvrtc: Path, tmp_path: Path
) -> None:
    env = {"LD_PRELOAD": str(old_nvrtc), "KCACHE_COMPILER": "required"}
    with pytest.raises(RuntimeError, match="exited") as failed:
        _fetch_only_server(stored, tmp_path, env)
    assert f"NVRTC {OLD_NVRTC}" in str(failed.value) and "older than 13.3" in str(failed.value)


def test_compiler_off_serves_fetches_only_whatever_is_installed(
    stored: dict[str, Any], tmp_path: Path
) -> None:
    server = _fetch_only_server(stored, tmp_path, {"KCACHE_COMPILER": "off"})
    try:
        _serves_fetches_and_refuses_compiles(server, stored, "compiler = off")
        # kcache doctor says what the server is, not that the token failed.
        doctor = kcache("doctor", "--server", server.url, env=user_env(tmp_path / "home"))
        token = next(line for line in doctor.stdout.splitlines() if " token " in f" {line} ")
        assert "warn" in token and "serves fetches only" in token, doctor.stdout
        assert "compiler = off" in token
    finally:
        server.stop()
