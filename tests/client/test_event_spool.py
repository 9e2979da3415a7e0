"""A node's audit events sent by one process for all of them (kcache_client._event_spool).

Real processes against a real ``kcache serve`` behind a counting proxy: the node's other
processes spool their events while one holds the spool, which sends them all; a sender
killed holding the spool hands its lines to the next process; a shared tier's processes
post their own. And the spool's own rules on real files: bounded, a dead sender's taken
file sent by the next, appends racing a sender neither lost nor sent twice.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from client_harness import KcacheServer, Proxy, Seen
from kcache_client import ClientSettings, KernelCache, _event_spool
from kcache_client._event_spool import NodeEventSpool
from kcache_client._tier import NodeTier

from kcache import Recipe
from kcache.artifact_header import CONTEXT_HEADER, decode_context
from tests.support import FAST, unique

_WORKER = r"""
import json, sys
from kcache import Recipe
from kcache.artifact_header import CONTEXT_HEADER, decode_context
from kcache_client import ClientSettings, KernelCache
from tests.support import FAST
cfg = json.loads(sys.argv[1])
settings = ClientSettings.from_env(retry=FAST, known_servers=cfg["known"], local_compile=False)
cache = KernelCache(cfg["url"], cache_dir=cfg["tier"], settings=settings)
for source in cfg["sources"]:
    assert cache.get(Recipe(source=source, target="sm_90")).origin == "node"
if cfg.get("lead"):
    cache.events.flush()  # this process sends now, and keeps the spool's lock
    print("leading", cache.client_id, flush=True)
    sys.stdin.readline()  # the others run and end meanwhile
cache.close()
print("done", flush=True)
"""


def _sources(tag: str, n: int) -> list[str]:
    return [
        f'extern "C" __global__ void k_{tag}_{i}(float* x) {{ x[threadIdx.x] += {i}.0f; }}\n'
        for i in range(n)
    ]


def _worker(cfg: dict[str, Any], **extra: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", _WORKER, json.dumps({**cfg, **extra})],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],  # tests.support importable
    )


def _posts(proxy: Proxy) -> list[Seen]:
    return [s for s in list(proxy.seen) if s.method == "POST" and s.path == "/v1/events"]


def _posted(proxy: Proxy) -> list[dict[str, Any]]:
    """Every event the server was sent."""
    return [e for s in _posts(proxy) for e in s.json()["events"]]


def _poster(seen: Seen) -> str:
    """The client id of the process that sent a request (its context header)."""
    return str(decode_context(seen.headers.get(CONTEXT_HEADER.lower())).get("client_id"))


@pytest.fixture
def filled(proxy: Proxy, tmp_path: Path) -> dict[str, Any]:
    """A private tier holding 3 kernels (filled without events), and the workers' config."""
    sources = _sources(unique("spool").replace("-", "_"), 3)
    quiet = ClientSettings.from_env(
        retry=FAST, send_events=False, known_servers=tmp_path / "known.json"
    )
    with KernelCache(proxy.url, cache_dir=tmp_path / "tier", settings=quiet) as cache:
        for source in sources:
            cache.get(Recipe(source=source, target="sm_90"))
    return {
        "url": proxy.url,
        "tier": str(tmp_path / "tier"),
        "known": str(tmp_path / "known.json"),
        "sources": sources,
    }


def test_the_node_s_processes_events_go_in_the_sender_s_posts(
    proxy: Proxy, kserver: KcacheServer, filled: dict[str, Any]
) -> None:
    leader = _worker(filled, lead=True)
    assert leader.stdout is not None
    said, leader_id = leader.stdout.readline().split()
    assert said == "leading"
    others = [_worker(filled) for _ in range(4)]
    for other in others:
        out, err = other.communicate(timeout=120)
        assert other.returncode == 0 and "done" in out, err
    _, err = leader.communicate("go\n", timeout=120)
    assert leader.returncode == 0, err
    posts = _posts(proxy)
    # Only the node's sender posted: the others spooled (before, each posted its own).
    assert posts and {_poster(p) for p in posts} == {leader_id}
    events = _posted(proxy)
    assert sum(e["count"] for e in events) == 5 * 3  # every lookup of the 5 processes
    assert len({e["client_id"] for e in events}) == 5
    assert not _spool(filled).holds_lines()


def _spool(cfg: dict[str, Any]) -> NodeEventSpool:
    return NodeEventSpool(cfg["tier"], cfg["url"], None)


def test_a_sender_killed_holding_the_spool_hands_its_lines_to_the_next(
    proxy: Proxy, kserver: KcacheServer, filled: dict[str, Any]
) -> None:
    leader = _worker(filled, lead=True)
    assert leader.stdout is not None and leader.stdout.readline().startswith("leading")
    other = _worker(filled)
    other.communicate(timeout=120)
    assert other.returncode == 0
    os.kill(leader.pid, signal.SIGKILL)  # the lock goes with it; the spooled lines stay
    leader.communicate(timeout=60)
    # A sender that died after taking the spool left its taken file too.
    spool = _spool(filled)
    stale = Path(f"{spool.path}.sending-1-dead")
    stale.write_text(
        json.dumps({"recipe_key": "f" * 64, "outcome": "local_hit", "count": 7}) + "\n"
    )
    posted = sum(e["count"] for e in _posted(proxy))
    after = _worker(filled)
    _, err = after.communicate(timeout=120)
    assert after.returncode == 0, err
    sent = sum(e["count"] for e in _posted(proxy)) - posted
    assert sent == 3 + 3 + 7  # the other's spooled lines, its own, and the dead sender's file
    assert not stale.exists() and not spool.holds_lines()


def test_only_a_tier_of_this_user_alone_spools(tmp_path: Path) -> None:
    """Elsewhere each process posts its own events, as before (the tier's standing)."""
    private = NodeTier(tmp_path / "private")
    assert NodeEventSpool.for_tier(private, "http://kcache:8080", None) is not None
    layer = NodeTier(tmp_path / "private", read_only=True)  # a read-only layer: untrusted
    assert NodeEventSpool.for_tier(layer, "http://kcache:8080", None) is None
    if os.geteuid() != 0:  # root's 1777 directory is still root's alone
        shared = tmp_path / "shared"
        shared.mkdir()
        os.chmod(shared, 0o1777)
        assert NodeEventSpool.for_tier(NodeTier(shared), "http://kcache:8080", None) is None


def test_the_spool_is_bounded_and_skips_what_does_not_parse(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_event_spool, "MAX_SPOOL_BYTES", 4096)
    spool = NodeEventSpool(tmp_path, "http://kcache:8080", "token")
    event = {"recipe_key": "a" * 64, "outcome": "local_hit", "count": 1, "pad": "x" * 200}
    for _ in range(40):
        assert spool.append([event])
    assert os.path.getsize(spool.path) <= 4096 and spool.dropped > 0
    with open(spool.path, "ab") as f:
        f.write(b"not json\n[1, 2]\n")
    got: list[dict[str, Any]] = []
    assert spool.lead()
    sent = spool.drain(lambda batch: got.extend(batch) or True, batch_size=5)
    assert sent == len(got) == 40 - spool.dropped and all(e == event for e in got)
    # Another server's or token's spool is another file: never sent by this one.
    assert NodeEventSpool(tmp_path, "http://kcache:8080", "other").path != spool.path
    spool.release()


def test_appends_racing_a_sender_are_sent_once_each(tmp_path: Path) -> None:
    spool = NodeEventSpool(tmp_path, "http://kcache:8080", None)
    writers, per_writer = 4, 300
    sent: list[int] = []
    lock = threading.Lock()

    def write(w: int) -> None:
        mine = NodeEventSpool(tmp_path, "http://kcache:8080", None)  # its own descriptors
        for i in range(per_writer):
            assert mine.append([{"n": w * per_writer + i, "count": 1}])

    def send(batch: list[dict[str, Any]]) -> bool:
        with lock:
            sent.extend(e["n"] for e in batch)
        return True

    threads = [threading.Thread(target=write, args=(w,)) for w in range(writers)]
    assert spool.lead()
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        spool.drain(send, batch_size=64)
    for t in threads:
        t.join()
    spool.drain(send, batch_size=64)
    spool.release()
    assert sorted(sent) == list(range(writers * per_writer))  # none lost, none twice


def test_a_server_out_of_reach_leaves_the_lines_for_the_next_send(tmp_path: Path) -> None:
    spool = NodeEventSpool(tmp_path, "http://kcache:8080", None)
    events = [{"n": i, "count": 1} for i in range(10)]
    assert spool.append(events)
    assert spool.lead()
    assert spool.drain(lambda batch: False, batch_size=4) == 0  # unreachable: kept
    got: list[dict[str, Any]] = []
    assert spool.drain(lambda batch: got.extend(batch) or True, batch_size=4) == 10
    assert [e["n"] for e in got] == list(range(10))
    spool.release()
