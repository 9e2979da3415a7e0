"""A kernel the server holds costs a rank one HTTP request, and its answer is checked.

Against a real ``kcache serve``: requests are counted by an ``httpx`` event hook on an
injected client (what left this process) and by a counting proxy (what reached the
server). Tampered answers are made by the proxy, on a real socket.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from client_harness import KcacheServer, Proxy, Seen, kernels, start_server
from kcache_client import (
    DigestMismatchError,
    KernelCache,
    MetadataError,
)

from kcache import Recipe
from kcache.artifact_header import decode_meta
from tests.support import QUIET

SCALE = """
template <typename T, int K> __global__ void scale(T* x) { x[threadIdx.x] *= K; }
"""

#: Compiles, with a warning NVRTC prints (an unused variable).
WARNS = """
extern "C" __global__ void warns(float* x) { int unused_here; x[threadIdx.x] += 1.0f; }
"""


class Seeded:
    """The module's server, its default toolchain, and a way to make kernels it holds."""

    def __init__(self, server: KcacheServer, toolchain: str, root: Path) -> None:
        self.server = server
        self.toolchain = toolchain
        self.root = root
        self._made = 0

    def held(self, n: int = 1, **fields: Any) -> list[Recipe]:
        """``n`` concrete recipes the server has compiled (through another node's cache)."""
        self._made += 1
        if fields:
            recipes = [Recipe(**fields) for _ in range(n)]  # type: ignore[arg-type]
        else:
            recipes = kernels(n, f"rt{self._made}", target="sm_80")
        concrete = [r.with_defaults(target="sm_80", toolchain=self.toolchain) for r in recipes]
        with KernelCache(
            self.server.url, cache_dir=self.root / f"seed-{self._made}", settings=QUIET
        ) as seed:
            for recipe in concrete:
                assert seed.get(recipe).origin == "compiled"
        return concrete


@pytest.fixture(scope="module")
def seeded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Seeded]:
    root = tmp_path_factory.mktemp("one-round-trip")
    server = start_server(root / "data")
    toolchain = httpx.get(f"{server.url}/v1/toolchains", timeout=10).json()["default"]
    yield Seeded(server, toolchain, root)
    server.stop()


@pytest.fixture
def proxy(seeded: Seeded) -> Iterator[Proxy]:
    p = Proxy(seeded.server.url)
    yield p
    p.close()


def _counting() -> tuple[httpx.Client, list[httpx.Request]]:
    sent: list[httpx.Request] = []
    return httpx.Client(timeout=30.0, event_hooks={"request": [sent.append]}), sent


def _metadata(url: str, key: str) -> dict[str, Any]:
    body: dict[str, Any] = httpx.get(f"{url}/v1/recipes/{key}", timeout=10).json()
    return body


def _tier_is_empty(root: Path) -> bool:
    blobs = [p for p in (root / "blobs").rglob("*") if p.is_file()] if root.exists() else []
    aliases = list((root / "index" / "recipes").rglob("*.json")) if root.exists() else []
    return not blobs and not aliases


def test_a_cold_get_is_one_request_with_everything_the_client_needs(
    seeded: Seeded, tmp_path: Path
) -> None:
    plain = seeded.held(2)
    (templated,) = seeded.held(source=SCALE, target="sm_80", name_expressions=["scale<float, 3>"])
    client, sent = _counting()
    with KernelCache(
        seeded.server.url, cache_dir=tmp_path, settings=QUIET, http_client=client
    ) as cache:
        for recipe in [*plain, templated]:
            before = len(sent)
            art = cache.get(recipe)
            key = recipe.key()
            assert [(r.method, r.url.path) for r in sent[before:]] == [
                ("GET", f"/v1/recipes/{key}/artifact")
            ]
            assert art.origin == "server" and art.outcome == "hit"
            assert hashlib.sha256(art.data).hexdigest() == art.digest == art.metadata.digest
            assert art.path.read_bytes() == art.data  # published into the node tier
            # The metadata route's, compile log included, in one answer.
            assert art.metadata.to_dict() == _metadata(seeded.server.url, key)
        assert art.lowered_names["scale<float, 3>"].startswith("_Z")  # usable: load() finds it
        assert art.metadata.dependencies_exact and art.kind == "cubin"
    assert not client.is_closed  # injected: used as it is, closed by its owner
    # Each answer said how far the server's withdrawals go (none yet), which the node knew:
    # it stood for a read of the feed, noted in the tier's file (kcache_client._withdrawals).
    state_file = tmp_path / "index" / "withdrawals.json"
    state = json.loads(state_file.read_bytes())
    assert state["servers"][seeded.server.url]["last_id"] == 0
    # Made older than the node shares (2 s), as a later process finds it:
    state["servers"][seeded.server.url]["checked_at"] -= 60
    state_file.write_text(json.dumps(state))
    before = len(sent)
    with KernelCache(
        seeded.server.url, cache_dir=tmp_path, settings=QUIET, http_client=client
    ) as again:
        assert again.get(plain[0]).origin == "node"  # another process of the node: no fetch,
    # only the withdrawals read before its first answer from the tier
    assert [r.url.path for r in sent[before:]] == ["/v1/withdrawals"]
    client.close()


def test_a_kernel_fetched_by_key_keeps_its_compile_warnings(seeded: Seeded, tmp_path: Path) -> None:
    # cuda.core's Program.compile(logs=) through kcache answered a hit with an empty log
    # where the compile that made the kernel had warned (the header left the log out).
    (warned,) = seeded.held(source=WARNS, target="sm_80")
    client, sent = _counting()
    with KernelCache(
        seeded.server.url, cache_dir=tmp_path, settings=QUIET, http_client=client
    ) as cache:
        art = cache.get(warned)
    assert art.origin == "server" and len(sent) == 1  # still one request
    assert "never referenced" in art.metadata.log
    assert art.metadata.log == _metadata(seeded.server.url, warned.key())["log"]
    client.close()


def test_the_route_and_the_fast_path_send_the_same_metadata(seeded: Seeded) -> None:
    (recipe,) = seeded.held()
    key = recipe.key()
    seeded.server.stop()  # a restarted server has nothing in memory: the route answers first
    seeded.server.start()
    url = f"{seeded.server.url}/v1/recipes/{key}/artifact"
    cold, warm = httpx.get(url, timeout=10), httpx.get(url, timeout=10)  # route, then fast path
    assert cold.status_code == warm.status_code == 200 and cold.content == warm.content
    names = ("etag", "x-kcache-digest", "x-kcache-size", "x-kcache-meta")
    assert [cold.headers[n] for n in names] == [warm.headers[n] for n in names]
    meta = decode_meta(cold.headers["x-kcache-meta"])
    assert (
        meta.digest == hashlib.sha256(cold.content).hexdigest() == cold.headers["x-kcache-digest"]
    )
    expected = _metadata(seeded.server.url, key)
    assert meta.to_dict() == expected
    # Documented where clients look: the route's OpenAPI description names the header.
    spec = httpx.get(f"{seeded.server.url}/openapi.json", timeout=10).json()
    answer = spec["paths"]["/v1/recipes/{recipe_key}/artifact"]["get"]["responses"]["200"]
    assert "base64url" in answer["headers"]["X-KCache-Meta"]["description"]


def _edit_meta(change: Callable[[dict[str, Any]], None], *, digest_too: bool = False) -> Any:
    """A proxy rewrite that edits the JSON inside X-KCache-Meta (and X-Kcache-Digest with it)."""

    def rewrite(seen: Seen, headers: dict[str, str], body: bytes) -> tuple[dict[str, str], bytes]:
        if not seen.path.endswith("/artifact"):
            return headers, body
        value = headers["x-kcache-meta"]
        data = json.loads(base64.urlsafe_b64decode(value + "=" * (-len(value) % 4)))
        change(data)
        text = base64.urlsafe_b64encode(json.dumps(data).encode()).rstrip(b"=").decode()
        headers = {**headers, "x-kcache-meta": text}
        if digest_too:
            headers["x-kcache-digest"] = data["digest"]
        return headers, body

    return rewrite


def _replace_header(value: str) -> Any:
    def rewrite(seen: Seen, headers: dict[str, str], body: bytes) -> tuple[dict[str, str], bytes]:
        return (
            {**headers, "x-kcache-meta": value} if "x-kcache-meta" in headers else headers
        ), body

    return rewrite


TAMPERED = {
    "another target": (_edit_meta(lambda m: m.update(target="sm_90")), MetadataError, "target"),
    "another kind": (_edit_meta(lambda m: m.update(kind="ptx")), MetadataError, "kind"),
    "another toolchain": (
        _edit_meta(lambda m: m.update(toolchain="tc-x")),
        MetadataError,
        "toolchain",
    ),
    "another size": (_edit_meta(lambda m: m.update(size=m["size"] + 1)), MetadataError, "size"),
    "a digest the response does not name": (
        _edit_meta(lambda m: m.update(digest="0" * 64)),
        MetadataError,
        "digest",
    ),
    "a digest nobody has, consistently": (
        _edit_meta(lambda m: m.update(digest="0" * 64), digest_too=True),
        DigestMismatchError,
        "0" * 64,
    ),
    "malformed dependencies": (
        _edit_meta(lambda m: m.update(dependencies=[{"name": "a.h"}])),
        MetadataError,
        "dependencies",
    ),
    "not base64url JSON": (_replace_header("%%not-base64%%"), MetadataError, "base64url"),
}


@pytest.mark.parametrize("case", sorted(TAMPERED))
def test_tampered_metadata_is_refused_and_nothing_is_stored(
    seeded: Seeded, proxy: Proxy, tmp_path: Path, case: str
) -> None:
    rewrite, error, words = TAMPERED[case]
    (recipe,) = seeded.held()
    proxy.faults.rewrite = rewrite
    with KernelCache(proxy.url, cache_dir=tmp_path, settings=QUIET) as cache:
        with pytest.raises(error) as info:
            cache.get(recipe)
        assert words in str(info.value) and proxy.url in str(info.value)
        assert _tier_is_empty(tmp_path)
        proxy.faults.rewrite = None  # the honest answer is taken afterwards
        art = cache.get(recipe)
    assert art.origin == "server" and hashlib.sha256(art.data).hexdigest() == art.digest


def test_bytes_damaged_on_the_way_are_fetched_again_by_digest(
    seeded: Seeded, proxy: Proxy, tmp_path: Path
) -> None:
    (recipe,) = seeded.held()
    proxy.faults.corrupt, proxy.faults.corrupt_prefix = 1, "/v1/recipes/"
    with KernelCache(proxy.url, cache_dir=tmp_path, settings=QUIET) as cache:
        art = cache.get(recipe)
        assert cache.stats.digest_mismatches == 1
    assert hashlib.sha256(art.data).hexdigest() == art.digest
    assert [s.path for s in proxy.seen] == [
        f"/v1/recipes/{recipe.key()}/artifact",
        f"/v1/blobs/{art.digest}",
    ]
    proxy.faults.corrupt, proxy.faults.corrupt_prefix = 100, "/v1/"  # damaged every time
    (other,) = seeded.held()
    with (
        KernelCache(proxy.url, cache_dir=tmp_path / "t2", settings=QUIET) as cache,
        pytest.raises(DigestMismatchError),
    ):
        cache.get(other)
    assert _tier_is_empty(tmp_path / "t2")


def test_without_the_header_the_metadata_route_is_read(
    seeded: Seeded, proxy: Proxy, tmp_path: Path
) -> None:
    # What a server sends for metadata too long for a header (design §5).
    (recipe,) = seeded.held()
    proxy.faults.rewrite = lambda seen, headers, body: (
        {k: v for k, v in headers.items() if k != "x-kcache-meta"},
        body,
    )
    with KernelCache(proxy.url, cache_dir=tmp_path, settings=QUIET) as cache:
        art = cache.get(recipe)
    key = recipe.key()
    assert [s.path for s in proxy.seen] == [f"/v1/recipes/{key}/artifact", f"/v1/recipes/{key}"]
    assert art.origin == "server" and hashlib.sha256(art.data).hexdigest() == art.digest
