"""GPU-image proof that a server whose NVRTC is older than 13.3 serves fetches (issue 47).

    python3 tests/gpu/fetch_only_server_check.py URL STORED_JSON

``URL`` is a ``kcache serve`` started in the GPU machines' image, whose NVRTC is 13.0,
over a data directory a compiling server (NVRTC 13.3 or later, elsewhere) filled;
``STORED_JSON`` names what that server stored: ``{"recipe", "key", "digest"}`` (a recipe
naming its toolchain, compiled for the GPU's ``sm_90``). The server must have started,
answer ``GET /v1/toolchains`` and a miss with 501 ``cannot_compile`` (no Retry-After),
serve the kernel by key and as a resolve hit, read ready with the compiler degraded, have
verification off and ``kcache_compiler_available`` 0; a ``KernelCache`` gets the kernel
and says why a miss was refused; the fetched cubin loads on the GPU. Prints one JSON line
per check; exits non-zero if any fails. fetch_only_server_last_run.jsonl beside it is the
last run's output (an H200 in the GPU machines' image, its NVRTC 13.0.88, over data a
NVRTC 13.5 server compiled here; the server ran from the source tree on PYTHONPATH with the
server's wheels, as bench/gpu_foreign_acceptance/device_server.sh installs them, and no
header directory filled by hand).
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
import urllib.error
import urllib.request
from typing import Any

FAILURES: list[str] = []


def _request(url: str, method: str, body: Any = None) -> tuple[int, bytes, dict[str, str]]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(
        url, data=data, method=method, headers={"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, answer.read(), {k.lower(): v for k, v in answer.headers.items()}
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), {k.lower(): v for k, v in exc.headers.items()}


def _check(name: str, ok: bool, **info: Any) -> None:
    if not ok:
        FAILURES.append(name)
    print(json.dumps({"check": name, "ok": ok, **info}), flush=True)


def _refused(status: int, body: bytes, headers: dict[str, str]) -> bool:
    return (
        status == 501
        and json.loads(body)["error"] == "cannot_compile"
        and "retry-after" not in headers
    )


def main(url: str, stored: dict[str, Any]) -> int:
    from cuda.bindings import driver, nvrtc
    from kcache_client import ClientSettings, KernelCache
    from kcache_client.errors import ServerResponseError

    from kcache.recipe import Recipe

    _check("nvrtc", True, version=".".join(str(v) for v in nvrtc.nvrtcVersion()[1:]))
    status, body, headers = _request(f"{url}/v1/toolchains", "GET")
    _check("toolchains refused", _refused(status, body, headers), answer=json.loads(body))
    status, cubin, _ = _request(f"{url}/v1/recipes/{stored['key']}/artifact", "GET")
    same = hashlib.sha256(cubin).hexdigest() == stored["digest"]
    _check("fetch by key", status == 200 and same, status=status, size=len(cubin))
    status, body, _ = _request(f"{url}/v1/resolve", "POST", {"recipe": stored["recipe"]})
    _check("resolve hit", status == 200 and json.loads(body)["status"] == "hit", status=status)
    miss = {**stored["recipe"], "source": stored["recipe"]["source"] + "\n// a miss\n"}
    status, body, headers = _request(f"{url}/v1/resolve", "POST", {"recipe": miss, "compile": True})
    _check("miss refused", _refused(status, body, headers), answer=json.loads(body))
    status, body, _ = _request(f"{url}/readyz", "GET")
    _check("ready", status == 200, answer=json.loads(body))
    status, body, _ = _request(f"{url}/v1/verification", "GET")
    _check("verification off", json.loads(body)["enabled"] is False, answer=json.loads(body))
    _, body, _ = _request(f"{url}/metrics", "GET")
    _check("kcache_compiler_available 0", b"kcache_compiler_available 0.0" in body)

    settings = ClientSettings.from_env(url=url, cache_dir=tempfile.mkdtemp(), local_compile=False)
    with KernelCache(settings=settings) as cache:
        got = cache.get(Recipe.from_dict(stored["recipe"]))
        _check("client gets the kernel", got.digest == stored["digest"])
        try:
            cache.get(Recipe.from_dict(miss))
            _check("client says why a miss was refused", False)
        except ServerResponseError as exc:
            text = str(exc)
            _check(
                "client says why a miss was refused", "HTTP 501 cannot_compile" in text, said=text
            )

    driver.cuInit(0)
    _, device = driver.cuDeviceGet(0)
    _, context = driver.cuDevicePrimaryCtxRetain(device)
    driver.cuCtxSetCurrent(context)
    loaded, module = driver.cuModuleLoadData(cubin)
    found, _ = driver.cuModuleGetFunction(module, b"vadd")
    success = driver.CUresult.CUDA_SUCCESS
    _check("the fetched cubin loads on the GPU", loaded == success and found == success)
    return 1 if FAILURES else 0


if __name__ == "__main__":
    with open(sys.argv[2]) as handle:
        sys.exit(main(sys.argv[1], json.load(handle)))
