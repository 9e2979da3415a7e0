"""An admin's removal of a foreign group reaches every copy a client holds (docs/design.md
section 3, "What a binding rests on", and section 10).

One real server (SQLite) for the module, with a ``publish``, a ``read`` and an ``admin``
token. ``DELETE /v1/foreign/...`` removes the binding and writes a withdrawal naming its
binding key and the group's content digest, in one transaction; a process's memory, the
node tier read by a later process and a prefetch's held groups then refuse the removed
group and ask the server. The same bytes published again are the server's word: used
after one more request per process, not refused for ever.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from kcache_client import KernelCache
from kcache_client._foreign import ForeignCache
from kcache_client._foreign_groups import read_group

from kcache.foreign import ForeignName, group_digest, refs_of
from kcache.job_manifest import JobManifest, ManifestForeign
from tests.support import ServerThread, unique


@dataclass
class Fleet:
    server: ServerThread
    publish: str
    read: str
    admin: str
    root: Path

    def node(self) -> Path:
        """A node's cache directory, empty."""
        return self.root / unique("node")

    def process(self, node: Path) -> ForeignCache:
        """A process of ``node`` that reads (a fresh cache: nothing in memory, no check made)."""
        return ForeignCache(KernelCache(self.server.url, self.read, node))

    def publish_group(self, name: ForeignName, files: dict[str, bytes]) -> None:
        writer = ForeignCache(KernelCache(self.server.url, self.publish, self.node()))
        assert writer.put(name, files)
        assert writer.flush(30) and writer.counts["published"] == 1

    def remove(self, name: ForeignName) -> None:
        answer = httpx.delete(
            f"{self.server.url}{name.path()}",
            params=name.query(),
            headers={"Authorization": f"Bearer {self.admin}"},
        )
        assert answer.status_code == 200 and answer.json() == {"removed": True}

    def feed(self) -> list[tuple[str, str, str]]:
        answer = httpx.get(
            f"{self.server.url}/v1/withdrawals",
            params={"after": 0},
            headers={"Authorization": f"Bearer {self.read}"},
        )
        assert answer.status_code == 200
        return [(r["recipe_key"], r["digest"], r["reason"]) for r in answer.json()["withdrawals"]]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    from kcache_server import Settings

    root = tmp_path_factory.mktemp("foreign-withdrawals")
    server = ServerThread(
        Settings(data_dir=root / "data", compile_workers=1, audit={"flush_s": 0.05}, auth_cache_s=0)
    )
    try:
        tokens = server.state.tokens
        yield Fleet(
            server,
            tokens.create("hook-writer", ["publish"]),
            tokens.create("hook-reader", ["read"]),
            tokens.create("operator", ["admin"]),
            root,
        )
    finally:
        server.stop()


@pytest.fixture(autouse=True)
def _checks_due_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every lookup from memory or a tier is due a read of the feed (none is shared)."""
    monkeypatch.setenv("KCACHE_WITHDRAWAL_CHECK_S", "0.001")
    monkeypatch.setattr("kcache_client._withdrawal_watch.SHARED_S", 0.0)


def _name() -> ForeignName:
    return ForeignName("cupy", "14.2.0", "sm_90", "nvrtc-13.0", unique("k") + ".cubin")


def test_a_removal_is_a_withdrawal_of_the_group_by_its_content(fleet: Fleet) -> None:
    name, files = _name(), {"kernel.cubin": os.urandom(1500), "meta.json": b"{}"}
    fleet.publish_group(name, files)
    fleet.remove(name)
    (row,) = [r for r in fleet.feed() if r[0] == name.binding_key]
    assert row[1] == group_digest(refs_of(files))
    assert row[2] == f"removed by an admin: DELETE {name.path()}"
    # Nothing is withdrawn by a DELETE of a name with no binding.
    gone = httpx.delete(
        f"{fleet.server.url}{name.path()}",
        params=name.query(),
        headers={"Authorization": f"Bearer {fleet.admin}"},
    )
    assert gone.json() == {"removed": False}
    assert [r for r in fleet.feed() if r[0] == name.binding_key] == [row]


def test_memory_and_the_node_tier_stop_answering_a_removed_group(fleet: Fleet) -> None:
    name, files = _name(), {"kernel.cubin": os.urandom(2000)}
    fleet.publish_group(name, files)
    node, other_node = fleet.node(), fleet.node()
    running = fleet.process(node)
    assert running.get(name) == files  # in its memory and its node's tier now
    assert fleet.process(other_node).get(name) == files
    fleet.remove(name)

    # The process that held it in memory: refused there and in the tier, a miss on the server.
    assert running.get(name) is None
    assert running.counts["withdrawn"] >= 1 and running.counts["misses"] == 1
    assert read_group(running.cache.tier, name.binding_key) is None  # the tier's copy removed

    # A later process of the other node: its tier's copy is refused once the feed is read.
    later = fleet.process(other_node)
    assert read_group(later.cache.tier, name.binding_key) == files
    assert later.get(name) is None
    assert (later.counts["withdrawn"], later.counts["node_hits"]) == (1, 0)
    assert read_group(later.cache.tier, name.binding_key) is None


def test_the_same_bytes_published_again_are_used_after_one_request(fleet: Fleet) -> None:
    name, files = _name(), {"kernel.cubin": os.urandom(1000)}
    fleet.publish_group(name, files)
    node = fleet.node()
    assert fleet.process(node).get(name) == files
    fleet.remove(name)
    fleet.publish_group(name, files)  # the same bytes, published anew

    process = fleet.process(node)
    assert process.get(name) == files
    assert (process.counts["withdrawn"], process.counts["server_hits"]) == (1, 1)
    assert process.get(name) == files
    process.clear_memory()
    assert process.get(name) == files  # from the tier: no longer refused here
    assert dict(process.counts) == {
        "withdrawn": 1,
        "server_hits": 1,
        "kept": 1,
        "memory_hits": 1,
        "node_hits": 1,
    }
    # The tier's file no longer names the pair once that process wrote it (its next check):
    # a later process of the node finds the group in the tier with no request.
    later = fleet.process(node)
    assert later.get(name) == files
    assert dict(later.counts) == {"node_hits": 1}


def test_a_prefetch_asks_again_for_a_group_its_tier_holds_withdrawn(fleet: Fleet) -> None:
    name, files = _name(), {"kernel.cubin": os.urandom(1200)}
    fleet.publish_group(name, files)
    manifest = JobManifest.of([], "job-removed", foreign=[ManifestForeign.of(name, refs_of(files))])
    node = fleet.node()
    first = fleet.process(node).cache.prefetch(manifest)
    assert (first.fetched, first.requests) == (1, 1)
    assert fleet.process(node).cache.prefetch(manifest).requests == 0  # held: complete

    fleet.remove(name)
    fixed = {"kernel.cubin": os.urandom(1200)}
    fleet.publish_group(name, fixed)
    process = fleet.process(node)
    again = process.cache.prefetch(manifest)
    assert (again.fetched, again.requests) == (1, 1)
    assert read_group(process.cache.tier, name.binding_key) == fixed
    assert process.get(name) == fixed
    assert process.counts["node_hits"] == 1


def test_tritons_own_directory_stops_answering_a_removed_group(
    fleet: Fleet, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """kcache's Triton manager keeps Triton's layout on local disk: a copy there is refused
    (and removed) once the server withdrew the group, like a node tier's."""
    import kcache_client.triton as kt

    key = unique("REMOVED").upper().replace("-", "")
    files = {"add.cubin": os.urandom(800), "add.json": b'{"name": "add"}'}
    name = ForeignName("triton", kt._triton_version(), kt.TARGET, kt.TOOLCHAIN, f"{key}.add.json")
    fleet.publish_group(name, files)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    node = fleet.node()
    monkeypatch.setattr(kt, "_foreign", fleet.process(node))
    got = kt.CacheManager(key).get_group("add.json")  # from kcache, written locally
    assert got is not None and {n: Path(p).read_bytes() for n, p in got.items()} == files
    monkeypatch.setattr(kt, "_foreign", fleet.process(node))  # a later process: a local hit
    assert kt.CacheManager(key).get_group("add.json") == got
    assert kt._foreign.counts["server_hits"] == 0

    fleet.remove(name)
    monkeypatch.setattr(kt, "_foreign", fleet.process(node))
    manager = kt.CacheManager(key)
    assert manager.get_group("add.json") is None  # refused locally, a miss on the server
    assert not Path(manager.cache_dir, "__grp__add.json").exists()
    assert kt._foreign.counts["withdrawn"] == 1


def test_a_nodes_own_compile_of_the_removed_bytes_is_used_there(fleet: Fleet) -> None:
    """A node that cannot publish compiles the removed group's bytes again: its own word,
    used from its memory and tier, not refused and compiled again at every lookup."""
    name, files = _name(), {"kernel.cubin": os.urandom(900)}
    fleet.publish_group(name, files)
    node = fleet.node()
    assert fleet.process(node).get(name) == files
    fleet.remove(name)
    process = fleet.process(node)  # a read token: its put is kept here, never published
    assert process.get(name) is None  # refused, a miss: the library compiles ...
    assert process.counts["withdrawn"] == 1
    assert process.put(name, files)  # ... the same bytes
    assert process.get(name) == files and process.get(name) == files
    assert process.counts["memory_hits"] == 2 and process.counts["withdrawn"] == 1
