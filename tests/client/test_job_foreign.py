"""A job's foreign groups travel with its kernels (issue 47 item 4, docs/design.md section 10).

One real server (a thread, real NVRTC and SQLite) behind a counting proxy. A job
compiles a kernel through kcache and its library hooks publish two foreign groups
(CuPy's one file, Triton's three) after a lookup that missed; the server's manifest of
the job names both, and a prefetch into an empty node tier brings kernel and groups in
one request, after which a hook's lookup is a node-tier hit with no request at all. A
group damaged, cut or signed by another key in the answer leaves nothing of itself.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from client_harness import Proxy, job_cache, kernels
from kcache_client._foreign import ForeignCache
from kcache_client.errors import UntrustedArtifactError
from kcache_server.settings import Settings

from kcache import Recipe
from kcache.bundle_format import BundleError
from kcache.foreign import ForeignName
from kcache.job_manifest import JobManifest
from tests.cli_harness import kcache, user_env
from tests.support import ServerThread

JOB = "job-47-foreign"


@dataclasses.dataclass
class World:
    server: ServerThread
    known: Path
    recipes: list[Recipe]
    keys: list[str]
    groups: dict[ForeignName, dict[str, bytes]]
    used: list[str]  # binding keys the writer's own manifest named


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    home = tmp_path_factory.mktemp("job-foreign")
    server = ServerThread(
        Settings(data_dir=home / "data", compile_workers=1, audit={"flush_s": 0.05})
    )
    known = home / "known.json"
    groups = {
        ForeignName("cupy", "14.2.0", "sm_80", "nvrtc-13.0", "k47cupy.cubin"): {
            "payload": os.urandom(3000)
        },
        ForeignName("triton", "3.5.0", "any", "any", "k47triton"): {
            "add.cubin": os.urandom(2000),
            "add.ptx": b"//\n.version 8.7\n",
            "__grp__add.json": b'{"child_paths": {}}',
        },
    }
    try:
        with job_cache(server.url, home / "writer", known, job_id=JOB) as cache:
            recipes = [cache.prepare(r) for r in kernels(1, "jf", target="sm_80")]
            arts = cache.get_many(recipes)
            assert all(not isinstance(a, Exception) for a in arts), arts
            hooks = ForeignCache(cache)
            for name, files in groups.items():
                assert hooks.get(name) is None  # a miss under the job: the library compiles
                assert hooks.put(name, files)
            assert hooks.flush(30) and hooks.counts["published"] == 2
            used = [g.binding_key for g in cache.manifest().foreign]
        yield World(
            server,
            known,
            recipes,
            [a.recipe_key for a in arts],  # type: ignore[union-attr]
            groups,
            used,
        )
    finally:
        server.stop()


@pytest.fixture(scope="module")
def manifest(world: World, tmp_path_factory: pytest.TempPathFactory) -> JobManifest:
    with job_cache(world.server.url, tmp_path_factory.mktemp("m"), world.known) as cache:
        return cache.job_manifest(JOB)


def _asked(proxy: Proxy) -> int:
    """Requests but the withdrawals reads (one before a process's first answer from its tiers)."""
    return int(proxy.count() - proxy.count("GET", "/v1/withdrawals"))


def _bundles_asked(proxy: Proxy) -> list[dict[str, Any]]:
    return [json.loads(s.body) for s in proxy.seen if s.path == "/v1/bundle"]


def test_the_jobs_manifest_names_the_foreign_groups_its_hooks_published(
    world: World, manifest: JobManifest
) -> None:
    assert manifest.version == 2 and manifest.recipe_keys == world.keys
    names = {name.binding_key: (name, files) for name, files in world.groups.items()}
    assert manifest.binding_keys == sorted(names)
    for group in manifest.foreign:
        name, files = names[group.binding_key]
        assert group.name == tuple(name)
        assert {(f.name, f.digest, f.size) for f in group.files} == {
            (n, hashlib.sha256(d).hexdigest(), len(d)) for n, d in files.items()
        }
    # The writer's own (process) manifest names what its hooks used, too.
    assert sorted(world.used) == sorted(names)
    # Another job's manifest names none of them: the lookups carried their job.
    with job_cache(world.server.url, world.known.parent / "other", world.known) as cache:
        assert cache.job_manifest("another-job").foreign == ()


def test_prefetch_brings_kernels_and_groups_in_one_request_then_hooks_ask_nothing(
    world: World, manifest: JobManifest, tmp_path: Path
) -> None:
    proxy = Proxy(world.server.url)
    try:
        with job_cache(proxy.url, tmp_path / "tier", world.known) as cache:
            done = cache.prefetch(manifest)
            assert (done.requests, done.fetched, done.held, done.missing) == (1, 3, 0, ())
            assert _asked(proxy) == 1 and proxy.count("POST", "/v1/bundle") == 1
            (body,) = _bundles_asked(proxy)
            assert body["recipe_keys"] == world.keys and len(body["foreign"]) == 2
            hooks = ForeignCache(cache)
            for name, files in world.groups.items():
                assert hooks.get(name) == files
            assert hooks.counts["node_hits"] == 2 and hooks.counts["server_hits"] == 0
            assert cache.get(world.recipes[0], compile=False).origin == "node"
            assert _asked(proxy) == 1  # the hooks and the kernel: no request more
        with job_cache(proxy.url, tmp_path / "tier", world.known) as cache:  # another process
            again = cache.prefetch(manifest)
            assert (again.requests, again.held, again.fetched) == (0, 3, 0)
            assert _asked(proxy) == 1  # the marker covers the groups: complete, no request
            # A group removed since: the marker no longer stands, and only it is asked for.
            cupy = next(n for n in world.groups if n.library == "cupy")
            cache.tier.remove([cupy.binding_key])
            third = cache.prefetch(manifest)
        assert (third.requests, third.held, third.fetched) == (1, 2, 1)
        last = _bundles_asked(proxy)[-1]
        assert last["recipe_keys"] == [] and [f["key"] for f in last["foreign"]] == [cupy.key]
    finally:
        proxy.close()


def _section_lines(body: bytes) -> tuple[int, int]:
    """Where the first group's bytes start in a bundle answer, and how many there are."""
    header_end = body.index(b"\n") + 1
    head_end = body.index(b"\n", header_end) + 1
    return head_end, json.loads(body[header_end:head_end])["size"]


def _flip_in_first_group(body: bytes) -> bytes:
    start, size = _section_lines(body)
    data = bytearray(body)
    data[start + size - 1] ^= 0x01  # the first group's last file no longer hashes right
    return bytes(data)


def _cut_in_second_group(body: bytes) -> bytes:
    start, size = _section_lines(body)
    second = start + size + 1  # its line, then half of its bytes
    head_end = body.index(b"\n", second) + 1
    return body[: head_end + json.loads(body[second:head_end])["size"] // 2]


def _other_writer(body: bytes) -> bytes:
    header_end = body.index(b"\n") + 1
    head_end = body.index(b"\n", header_end) + 1
    line = json.loads(body[header_end:head_end])
    line["binding"]["writer"] = "token:someone-else"  # what the signature does not cover
    text = json.dumps(line, separators=(",", ":"), sort_keys=True).encode() + b"\n"
    return body[:header_end] + text + body[head_end:]


@pytest.mark.parametrize(
    ("change", "error", "said"),
    [
        (_flip_in_first_group, BundleError, "does not hash"),
        (_cut_in_second_group, BundleError, "truncated"),
        (_other_writer, UntrustedArtifactError, None),
    ],
    ids=["damaged", "cut", "signed-for-another-writer"],
)
def test_a_group_that_does_not_check_is_refused_whole(
    world: World,
    manifest: JobManifest,
    tmp_path: Path,
    change: Callable[[bytes], bytes],
    error: type[Exception],
    said: str | None,
) -> None:
    proxy = Proxy(world.server.url)

    def rewrite(seen: Any, headers: dict[str, str], body: bytes) -> tuple[dict[str, str], bytes]:
        return headers, change(body) if seen.path == "/v1/bundle" else body

    proxy.faults.rewrite = rewrite
    first, second = sorted(manifest.foreign, key=lambda g: g.binding_key)  # in the order asked
    try:
        with job_cache(proxy.url, tmp_path / "tier", world.known) as cache:
            with pytest.raises(error, match=said):
                cache.prefetch(manifest)
            tier = cache.tier
            assert tier.marked(manifest.digest) is None
            assert tier.lookup(world.keys[0]) is None  # the kernels after it: not read
            refused = second if change is _cut_in_second_group else first
            assert tier.lookup(refused.binding_key) is None  # nothing of the group
            if change is _cut_in_second_group:  # the group before it came whole: kept
                assert tier.lookup(first.binding_key) is not None
            hooks = ForeignCache(cache)
            name = ForeignName(*refused.name)
            proxy.faults.rewrite = None
            assert hooks.get(name) == world.groups[name]  # from the server, whole
            assert hooks.counts["server_hits"] == 1
    finally:
        proxy.close()


def test_a_bundle_request_names_something(world: World) -> None:
    client = world.server.client()
    assert client.post("/v1/bundle", json={"recipe_keys": [], "foreign": []}).status_code == 422
    bad = {"library": "cupy", "version": "1", "target": "sm_80", "toolchain": "x", "key": "a/b"}
    assert client.post("/v1/bundle", json={"foreign": [bad]}).status_code == 422


def test_a_replayed_jobs_prefetch_names_the_groups_in_its_own_manifest(
    world: World, manifest: JobManifest, tmp_path: Path
) -> None:
    # The bundle's groups are audited as foreign lookups with the bundle's context: the
    # next run of the job, which only prefetched, has the same manifest.
    replay = "job-47-foreign-replay"
    with job_cache(world.server.url, tmp_path / "tier", world.known, job_id=replay) as cache:
        assert cache.prefetch(manifest).fetched == 3
        again = cache.job_manifest(replay)
    assert again.digest == manifest.digest and again.job_id == replay


def test_the_cli_diff_names_the_foreign_groups_that_differ(
    world: World, manifest: JobManifest, tmp_path: Path
) -> None:
    with_groups = manifest.save(tmp_path / "with.json")
    kernels_only = JobManifest.of(manifest.kernels, manifest.job_id).save(tmp_path / "without.json")
    out = kcache("manifest", "diff", str(kernels_only), str(with_groups), env=user_env(tmp_path))
    assert out.returncode == 1, out.stderr  # they differ: by their groups alone
    added = [line for line in out.stdout.splitlines() if line.startswith("+ foreign ")]
    assert sorted(line.split()[-1] for line in added) == sorted(manifest.binding_keys)
    assert f"{len(manifest.foreign)} foreign groups differ" in out.stderr
