"""httpx is imported for a caller's own ``httpx.Client`` only (issue 46).

kcache's own requests go through the standard library (``_lean_http.LeanClient``), its
settings' timeouts are its own (``_waits.Waits``), its TLS context the standard
library's (``_lean_http.tls_context``) and its failures its own classes, named and ranked
as httpx's (``_lean_errors``): a process that imports the client, makes a cache and gets
a kernel from the server and from its node tier never imports httpx (nor what httpx's
command line drags in when installed). A transport given a caller's ``httpx.Client``
raises httpx's failures as kcache's of the same name, so the retry loop catches them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from client_harness import KcacheServer
from kcache_client import ServerUnavailableError
from kcache_client import _lean_errors as lean_errors
from kcache_client._http import Transport

from tests.support import FAST

#: httpx and what it imports or drags in (its command line's rich, click and pygments).
HTTPX_FAMILY = ("httpx", "httpcore", "h11", "anyio", "certifi", "rich", "click", "pygments")

#: A fresh process: the client imported, one cache made as the issue states it, a kernel
#: got from the server (the server compiles it), then from the node tier by a new cache.
GET_WITHOUT_HTTPX = """
import sys

from kcache import Recipe

import kcache_client
from kcache_client import ClientSettings, KernelCache

recipe = Recipe(source=sys.argv[2], target="sm_80")
origins = []
for _ in range(2):
    cache = KernelCache(cache_dir=sys.argv[1], settings=ClientSettings.from_env(send_events=False))
    with cache:
        origins.append(cache.get(recipe).origin)
family = set(sys.argv[3].split(","))
print(" ".join(origins))
print(" ".join(sorted(m for m in sys.modules if m.partition(".")[0] in family)) or "-")
"""


def test_a_process_that_gets_from_the_server_and_the_node_tier_never_imports_httpx(
    kserver: KcacheServer, tmp_path: Path
) -> None:
    source = 'extern "C" __global__ void no_httpx(float* x) { x[threadIdx.x] *= 3.0f; }\n'
    env = {**os.environ, "KCACHE_URL": kserver.url}
    family = ",".join(HTTPX_FAMILY)
    done = subprocess.run(
        [sys.executable, "-c", GET_WITHOUT_HTTPX, str(tmp_path / "tier"), source, family],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    origins, imported = done.stdout.splitlines()
    assert origins in ("compiled node", "server node"), origins
    assert imported == "-", f"imported on kcache's own path: {imported}"


def test_an_injected_clients_failure_is_raised_as_kcaches_of_its_name_and_retried() -> None:
    tries: list[httpx.Request] = []

    def refuse(request: httpx.Request) -> httpx.Response:
        tries.append(request)
        raise httpx.ConnectError("[Errno 111] Connection refused", request=request)

    with httpx.Client(transport=httpx.MockTransport(refuse)) as client:
        transport = Transport("http://kcache.test:8000", retry=FAST, client=client)
        with pytest.raises(ServerUnavailableError) as info:
            transport.request("GET", "/v1/toolchains")
    assert info.value.cause == "ConnectError: [Errno 111] Connection refused"
    assert len(tries) == FAST.attempts  # caught as a transport failure: retried


@pytest.mark.parametrize("name", sorted(lean_errors._BY_NAME))
def test_each_failure_has_httpx_s_name_and_place_in_its_hierarchy(name: str) -> None:
    ours, theirs = lean_errors._BY_NAME[name], getattr(httpx, name)
    assert [c.__name__ for c in ours.__mro__[:-2]] == [c.__name__ for c in theirs.__mro__[:-2]]
    assert isinstance(lean_errors.from_httpx(theirs("why")), ours)
    assert str(lean_errors.from_httpx(theirs("why"))) == "why"
