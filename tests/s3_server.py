"""A real S3 HTTP server on loopback for the tests: moto's standalone server, once per session.

moto is an emulator of the S3 API (no MinIO, Ceph RGW or s3rver is installable from
the registries this project uses that is more faithful and still light: MinIO ships
no Debian or PyPI package, radosgw needs a Ceph cluster, s3rver implements neither
conditional writes nor checksums). It speaks S3 over real HTTP, so the store's
client, its signing, retries, conditional ``If-None-Match`` PUTs and error
translation are exercised as against a real bucket.

``scripts/ensure-services`` installs it into ``.venv/s3-server`` (its own environment,
so its many dependencies never move the project's). ``KCACHE_TEST_MOTO_SERVER`` names
another ``moto_server`` executable.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import re
import secrets
import shutil
import signal
import subprocess
import threading
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

_REPO = Path(__file__).resolve().parents[1]
_RUNNING = re.compile(r"Running on (http://127\.0\.0\.1:[0-9]+)")

#: Fake credentials: moto accepts any, but the client signs every request with them.
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "kcache-test",
    "AWS_SECRET_ACCESS_KEY": "kcache-test-secret",
    "AWS_REGION": "us-east-1",
}


@dataclass(frozen=True)
class S3Server:
    """A running S3 endpoint and the environment a client needs to reach it."""

    endpoint: str
    process: subprocess.Popen[str]

    @property
    def env(self) -> dict[str, str]:
        """``AWS_ENDPOINT_URL`` and credentials, for ``os.environ`` or a subprocess."""
        return {"AWS_ENDPOINT_URL": self.endpoint, **CREDENTIALS}

    def new_bucket(self, stem: str = "kcache-test") -> str:
        """Create a bucket with a fresh name and return the name."""
        name = f"{stem}-{secrets.token_hex(4)}"
        request = urllib.request.Request(f"{self.endpoint}/{name}", method="PUT")
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.status == 200, response.status
        return name


def _executable() -> str | None:
    explicit = os.environ.get("KCACHE_TEST_MOTO_SERVER")
    if explicit:
        return explicit
    local = _REPO / ".venv" / "s3-server" / "bin" / "moto_server"
    if local.exists():
        return str(local)
    return shutil.which("moto_server")


_MISSING = (
    "no S3 server: moto_server is not installed (scripts/ensure-services installs it "
    "into .venv/s3-server; or set KCACHE_TEST_MOTO_SERVER)"
)
_NO_CLIENT = "no S3 client: obstore is not installed (pip install 'kcache-core[s3]')"


def _skip_without_client() -> None:
    """Skip, saying why, where the store's S3 client is missing: every test of a bucket needs it."""
    try:
        import obstore  # noqa: F401
    except ImportError:
        pytest.skip(_NO_CLIENT)


@functools.cache
def _start() -> S3Server | str:
    exe = _executable()
    if exe is None:
        return _MISSING
    return _launch(exe)


def own_s3_server() -> S3Server:
    """A new S3 server for one test module alone (one it may stop, kill or restart), or skip.

    The caller stops it (:func:`stop_s3_server`); the session's server is never touched.
    """
    _skip_without_client()
    exe = _executable()
    if exe is None:
        pytest.skip(_MISSING)
    return _launch(exe)


def stop_s3_server(server: S3Server) -> None:
    """Stop a server from :func:`own_s3_server` (continued first, if it was stopped)."""
    if server.process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(server.process.pid, signal.SIGCONT)
    _stop(server.process)


def _launch(exe: str) -> S3Server:
    proc = subprocess.Popen(
        [exe, "-H", "127.0.0.1", "-p", "0"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **CREDENTIALS},
    )
    atexit.register(_stop, proc)
    assert proc.stderr is not None
    seen: list[str] = []
    for line in proc.stderr:  # Werkzeug prints the bound address once it listens
        seen.append(line)
        match = _RUNNING.search(line)
        if match:
            # Keep draining stderr so the server never blocks on a full pipe.
            threading.Thread(target=proc.stderr.read, daemon=True).start()
            return S3Server(match.group(1), proc)
        if len(seen) > 50:
            break
    _stop(proc)
    raise RuntimeError("moto_server did not start:\n" + "".join(seen[-20:]))


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


def s3_server() -> S3Server:
    """The session's S3 server (started on first use), or skip the test saying why."""
    _skip_without_client()
    started = _start()
    if isinstance(started, str):
        pytest.skip(started)
    return started
