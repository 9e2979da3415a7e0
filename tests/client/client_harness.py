"""Real HTTP servers for the client tests: the kcache server as a subprocess, a counting
(and fault-injecting) reverse proxy in front of it, and a scripted server for retry tests.

Nothing here mocks HTTP: every request crosses a real socket.
"""

from __future__ import annotations

import dataclasses
import hashlib
import http.server
import itertools
import json
import os
import socket
import sys
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from kcache_client import ClientSettings, KernelCache

from kcache import Recipe, signing
from kcache.artifact import ArtifactMeta
from tests.support import FAST, ServerProcess

ROOT = Path(__file__).resolve().parents[2]
KCACHE = Path(sys.executable).with_name("kcache")


class ServerUnavailable(Exception):
    """The kcache server package is not installed or cannot start here."""


class KcacheServer(ServerProcess):
    """``kcache serve`` as a client sees it: no token in its environment, run from its own
    data directory, and :class:`ServerUnavailable` when it cannot start here."""

    def __init__(self, data_dir: Path, *, env: dict[str, str] | None = None) -> None:
        merged = {**os.environ, **(env or {})}
        merged.pop("KCACHE_TOKEN", None)
        super().__init__(data_dir, env=merged, cwd=data_dir, log=data_dir.parent / "server.log")

    def start(self, timeout: float = 60.0, ready: str = "/healthz") -> KcacheServer:
        """Start and wait for ``ready``; ServerUnavailable with the log's end otherwise."""
        try:
            super().start(timeout, ready)
        except RuntimeError as exc:
            raise ServerUnavailable(str(exc)) from None
        return self


@dataclass
class Seen:
    """One request a proxy or scripted server received."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        """The body parsed as JSON."""
        return json.loads(self.body)


@dataclass
class Faults:
    """What a :class:`Proxy` does to traffic.

    ``busy``: answer that many next requests 503 with ``Retry-After: retry_after``.
    ``corrupt``: flip one byte of that many next responses whose path starts with
    ``corrupt_prefix``. ``cut_after``: once a request whose path starts with this
    prefix has been answered, drop every later connection without a reply (the
    server is lost). ``rewrite``: called with each upstream answer (the request, its
    headers with lower-case names, its body) for the headers and body to send instead.
    """

    busy: int = 0
    retry_after: str = "0"
    corrupt: int = 0
    corrupt_prefix: str = "/v1/blobs/"
    cut_after: str | None = None
    cut: bool = False
    rewrite: Callable[[Seen, dict[str, str], bytes], tuple[dict[str, str], bytes]] | None = None


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _HTTPServer

    def log_message(self, format: str, *args: Any) -> None:
        del format, args  # keep test output clean

    def _handle(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        seen = Seen(self.command, self.path, {k.lower(): v for k, v in self.headers.items()}, body)
        self.server.owner._record(seen)
        status, headers, payload = self.server.owner._respond(seen)
        if status < 0:  # drop the connection without an answer
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        self.send_response(status)
        for name, value in headers.items():
            if name.lower() not in (
                "content-length",
                "transfer-encoding",
                "connection",
                "content-encoding",
            ):
                self.send_header(name, value)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(payload)

    do_GET = do_POST = do_HEAD = do_PUT = do_DELETE = _handle


class _HTTPServer(http.server.ThreadingHTTPServer):
    daemon_threads = True
    owner: _Base


class _Base:
    def __init__(self) -> None:
        self._httpd = _HTTPServer(("127.0.0.1", 0), _Handler)
        self._httpd.owner = self
        self.port = int(self._httpd.server_address[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self.seen: list[Seen] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()

    def _record(self, seen: Seen) -> None:
        with self._lock:
            self.seen.append(seen)

    def _respond(self, seen: Seen) -> tuple[int, dict[str, str], bytes]:
        raise NotImplementedError

    def count(self, method: str | None = None, prefix: str = "") -> int:
        """Requests seen with this method (any if None) whose path starts with ``prefix``."""
        with self._lock:
            return sum(
                1
                for s in self.seen
                if (method is None or s.method == method) and s.path.startswith(prefix)
            )

    def paths(self, method: str, prefix: str) -> Counter[str]:
        """How often each path under ``prefix`` was requested."""
        with self._lock:
            return Counter(
                s.path for s in self.seen if s.method == method and s.path.startswith(prefix)
            )

    def close(self) -> None:
        """Stop listening."""
        self._httpd.shutdown()
        self._httpd.server_close()


class Proxy(_Base):
    """A counting reverse proxy in front of ``upstream`` that can inject :class:`Faults`."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.faults = Faults()
        self._client = httpx.Client(base_url=upstream, timeout=600.0)
        super().__init__()

    def retarget(self, upstream: str) -> None:
        """Send what comes next to ``upstream``: another server answering for this URL."""
        with self._lock:
            old, self._client = self._client, httpx.Client(base_url=upstream, timeout=600.0)
            self.upstream = upstream
        old.close()

    def _respond(self, seen: Seen) -> tuple[int, dict[str, str], bytes]:
        with self._lock:
            f = self.faults
            if f.cut:
                return -1, {}, b""
            if f.busy > 0:
                f.busy -= 1
                body = json.dumps(
                    {"error": "overloaded", "detail": "injected by the test proxy"}
                ).encode()
                return 503, {"Retry-After": f.retry_after, "Content-Type": "application/json"}, body
        headers = {k: v for k, v in seen.headers.items() if k not in ("host", "content-length")}
        response = self._client.request(seen.method, seen.path, content=seen.body, headers=headers)
        payload = response.content
        with self._lock:
            f = self.faults
            if (
                f.corrupt > 0
                and seen.path.startswith(f.corrupt_prefix)
                and response.status_code == 200
                and payload
            ):
                f.corrupt -= 1
                payload = bytes([payload[0] ^ 0xFF]) + payload[1:]
            if f.cut_after is not None and seen.path.startswith(f.cut_after):
                f.cut = True
            rewrite = f.rewrite
        headers = dict(response.headers)
        if rewrite is not None:
            headers, payload = rewrite(seen, headers, payload)
        return response.status_code, headers, payload


class Scripted(_Base):
    """Answers every request with ``route(seen) -> (status, headers, body)``."""

    def __init__(self, route: Callable[[Seen], tuple[int, dict[str, str], bytes]]) -> None:
        self.route = route
        super().__init__()

    def _respond(self, seen: Seen) -> tuple[int, dict[str, str], bytes]:
        return self.route(seen)


class CountingVerifier(signing.Ed25519Verifier):
    """The process's real Ed25519 verifier, counting its verifications (install it as
    ``kcache.signing._verifier`` with monkeypatch)."""

    def __init__(self, real: signing.Ed25519Verifier) -> None:
        self.real, self.calls = real, 0

    def verify(self, public_raw: bytes, signature: bytes, message: bytes) -> bool:
        self.calls += 1
        return self.real.verify(public_raw, signature, message)


def artifact_meta(data: bytes, target: str = "sm_90") -> ArtifactMeta:
    """Metadata naming ``data`` (hashed with hashlib: tests that count the tier's hashes
    must not see these)."""
    digest = hashlib.sha256(data).hexdigest()
    return ArtifactMeta(digest=digest, size=len(data), kind="cubin", target=target, toolchain="t")


def tier_entry(name: str) -> tuple[str, str, ArtifactMeta, bytes]:
    """A synthetic entry to publish into a tier: recipe key, base key, metadata, bytes."""
    data = f"cubin {name} ".encode() * 100
    key = hashlib.sha256(f"key {name}".encode()).hexdigest()
    base = hashlib.sha256(f"base {name}".encode()).hexdigest()
    return key, base, artifact_meta(data), data


def json_response(status: int, body: Any, **headers: str) -> tuple[int, dict[str, str], bytes]:
    """A JSON answer for :class:`Scripted` routes."""
    return status, {"Content-Type": "application/json", **headers}, json.dumps(body).encode()


_counter = itertools.count()


def start_server(data_dir: Path) -> KcacheServer:
    """A fresh server, or a skip when the server package cannot run here."""
    try:
        return KcacheServer(data_dir).start()
    except ServerUnavailable as exc:
        pytest.skip(f"kcache server not available: {exc}")


def job_cache(url: str | None, tier: Path, known: Path, **kw: Any) -> KernelCache:
    """A quiet cache on ``tier`` (sm_80, fast retries, no events) that pins server keys in
    ``known``; ``job_id`` and any other settings field in ``kw``."""
    settings = dataclasses.replace(
        ClientSettings.from_env(
            auto_target="sm_80", retry=FAST, send_events=False, job_id=kw.pop("job_id", None)
        ),
        known_servers=known,
        **kw,
    )
    return KernelCache(url, cache_dir=tier, settings=settings)


def kernels(n: int, tag: str = "", *, target: str = "auto") -> list[Recipe]:
    """``n`` distinct small kernels nobody has compiled yet in this session."""
    run = next(_counter)
    out = []
    for i in range(n):
        name = f"k{tag.replace('-', '_')}_{run}_{i}"
        src = f'extern "C" __global__ void {name}(float* x) {{ x[threadIdx.x] *= {i + 2}.0f; }}\n'
        out.append(Recipe(source=src, target=target))
    return out
