"""Clients learn withdrawals: a binding the server withdrew is answered by no tier any more.

Two parts. Against a scripted server and a real node tier: the feed's answers are
checked (a bad one is refused and the cache goes on with what it knew), a withdrawn pair
is refused by every lookup path (memory, alias, pack entry, layer, publish), dropped from
the tier, remembered in the tier's file for the next process, and the node's processes
share one check. Against a real server whose verification finds a planted wrong binding:
a node tier that held it answers the fresh one after its next job start, and the old
signed answer, planted back into a tier (a shared one too), is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from client_harness import Scripted, Seen, json_response, tier_entry
from kcache_client import KernelCache, RemoteNotFoundError
from kcache_client._bundle import load_bundle_file
from kcache_client._tier import NodeTier
from kcache_client._withdrawal_feed import Withdrawn, parse_page
from kcache_client._withdrawal_watch import drop_from_tier
from kcache_client._withdrawals import FILE_NAME
from kcache_client.errors import ResponseRefusedError

from kcache import Recipe
from kcache.artifact import ArtifactMeta
from kcache.bundle_format import end_line, entry_head, header_line
from kcache.signing import SigningKey
from tests.support import QUIET, ServerThread

K1, D1 = "1" * 64, "a" * 64
K2, D2 = "2" * 64, "b" * 64


def _row(ident: int, key: str = K1, digest: str = D1) -> dict[str, Any]:
    return {
        "id": ident,
        "recipe_key": key,
        "digest": digest,
        "at": "2027-03-01T12:00:00Z",
        "reason": "code: differs",
    }


# ---------------------------------------------------------------------- the answer
def test_a_well_formed_page_is_read() -> None:
    page = parse_page({"withdrawals": [_row(3), _row(7, K2, D2)], "last_id": 7}, 2, 10)
    assert [(r.id, r.recipe_key, r.digest) for r in page.rows] == [(3, K1, D1), (7, K2, D2)]
    assert page.last_id == 7
    assert parse_page({"withdrawals": [], "last_id": 5}, 5, 10).rows == ()


@pytest.mark.parametrize(
    ("body", "why"),
    [
        ([], "not a JSON object"),
        ({"withdrawals": {}, "last_id": 1}, "not a list"),
        ({"withdrawals": [], "last_id": "1"}, "last_id"),
        ({"withdrawals": [], "last_id": True}, "last_id"),
        ({"withdrawals": [_row(3)], "last_id": 9}, "last_id is 9"),
        ({"withdrawals": [], "last_id": 4}, "last_id is 4"),
        ({"withdrawals": [_row(2)], "last_id": 2}, "not an integer above 2"),  # not after `after`
        ({"withdrawals": [_row(5), _row(4)], "last_id": 4}, "above 5"),
        ({"withdrawals": [{**_row(3), "id": 3.0}], "last_id": 3}, "id 3.0"),
        ({"withdrawals": [{**_row(3), "id": True}], "last_id": 3}, "id True"),
        ({"withdrawals": [_row(3, "A" * 64)], "last_id": 3}, "recipe_key"),
        ({"withdrawals": [_row(3, K1, "../x")], "last_id": 3}, "digest"),
        ({"withdrawals": [{**_row(3), "at": "yesterday"}], "last_id": 3}, "RFC 3339"),
        ({"withdrawals": [{**_row(3), "reason": None}], "last_id": 3}, "reason"),
        ({"withdrawals": ["x"], "last_id": 3}, "not an object"),
        ({"withdrawals": [_row(i) for i in range(3, 6)], "last_id": 5}, "more than the 2"),
    ],
)
def test_a_malformed_page_is_refused(body: Any, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_page(body, 2, 2)


class Feed:
    """A scripted server: ``GET /v1/withdrawals`` answers from ``rows`` (or ``answer``), every
    other route 404 (a kernel it does not have)."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.answer: tuple[int, dict[str, str], bytes] | None = None
        self.server = Scripted(self._route)
        self.url = self.server.url

    def _route(self, seen: Seen) -> tuple[int, dict[str, str], bytes]:
        if seen.path.startswith("/v1/withdrawals"):
            if self.answer is not None:
                return self.answer
            query = dict(p.split("=") for p in seen.path.partition("?")[2].split("&"))
            after, limit = int(query["after"]), int(query["limit"])
            rows = [r for r in self.rows if r["id"] > after][:limit]
            return json_response(
                200, {"withdrawals": rows, "last_id": rows[-1]["id"] if rows else after}
            )
        return json_response(404, {"code": "not_found", "detail": "no such kernel"})

    def asked(self) -> list[str]:
        return [s.path for s in self.server.seen if s.path.startswith("/v1/withdrawals")]

    def close(self) -> None:
        self.server.close()


@pytest.fixture
def feed() -> Iterator[Feed]:
    f = Feed()
    yield f
    f.close()


def _cache(url: str, root: Path) -> KernelCache:
    return KernelCache(url, cache_dir=root, settings=QUIET.located(url, None, root))


def test_the_remote_refuses_a_bad_answer_and_says_404_for_an_older_server(
    feed: Feed, tmp_path: Path
) -> None:
    with _cache(feed.url, tmp_path / "tier") as cache:
        remote = cache._require_server()
        feed.rows = [_row(1), _row(2, K2, D2)]
        page = remote.withdrawals(after=0, limit=1)
        assert [r.id for r in page.rows] == [1] and page.last_id == 1
        assert feed.asked()[-1] == "/v1/withdrawals?after=0&limit=1"
        feed.answer = json_response(200, {"withdrawals": [_row(1)], "last_id": 1})
        with pytest.raises(ResponseRefusedError, match="not an integer above 1"):
            remote.withdrawals(after=1)
        feed.answer = json_response(404, {"code": "not_found", "detail": "Not Found"})
        with pytest.raises(RemoteNotFoundError):
            remote.withdrawals(after=0)


# ---------------------------------------------------------------------- a real tier
def _entry(tier: NodeTier, name: str) -> tuple[str, ArtifactMeta, bytes]:
    key, base, meta, data = tier_entry(name)
    tier.publish(key, base, meta, data)
    tier.flush()
    return key, meta, data


def _withdraw(tier: NodeTier, *pairs: tuple[str, str], url: str = "http://s") -> list[Any]:
    rows = [
        Withdrawn(i + 1, k, d, "2027-03-01T12:00:00Z", "test") for i, (k, d) in enumerate(pairs)
    ]
    new = tier.withdrawals.learn(url, rows, len(rows))
    drop_from_tier(tier, new)
    return new


def test_a_tier_refuses_and_drops_a_withdrawn_binding_and_keeps_the_others(
    tmp_path: Path,
) -> None:
    tier = NodeTier(tmp_path / "tier")
    bad_key, bad, _ = _entry(tier, "withdrawn")
    kept_key, kept, _ = _entry(tier, "kept")
    # Another recipe whose bytes are the withdrawn binding's keeps its binding (and the record).
    twin_key = hashlib.sha256(b"twin").hexdigest()
    tier.publish(twin_key, None, bad, tier.lookup(bad_key)[1])  # type: ignore[index]
    assert _withdraw(tier, (bad_key, bad.digest)) == [(bad_key, bad.digest)]
    assert tier.lookup(bad_key) is None
    assert not os.path.exists(tier.index.alias_path(bad_key))  # dropped, not only refused
    assert tier.lookup(twin_key) is not None and tier.lookup(kept_key) is not None
    assert os.path.exists(tier.record_path(bad.digest))  # the twin's alias still names it
    assert tier.held_digest(bad_key) is None and not tier.present(bad_key, bad.digest)
    # Published again (a replayed answer, an unpacked bundle): refused.
    assert tier.publish(bad_key, None, bad, tier.lookup(twin_key)[1]) is None  # type: ignore[index]
    assert tier.lookup(bad_key) is None
    # A new process of the node reads the tier's file: refused there too, without a feed.
    again = NodeTier(tmp_path / "tier")
    tier.index.write_alias(bad_key, bad, None)  # planted back
    assert again.withdrawals.withdrawn(bad_key, bad.digest)
    assert again.lookup(bad_key) is None and again.lookup(kept_key) is not None
    saved = json.loads((tmp_path / "tier" / "index" / FILE_NAME).read_bytes())
    assert saved["pairs"] == [f"{bad_key}:{bad.digest}"]
    assert saved["servers"]["http://s"]["last_id"] == 1
    del kept


def test_a_pair_another_process_wrote_is_never_lost_from_the_tiers_file(tmp_path: Path) -> None:
    """Two processes of a node: one learns a pair after the other read the file; the other's
    next write (a fetch's answer standing for a read) keeps it, for the processes after."""
    first, second = NodeTier(tmp_path / "tier"), NodeTier(tmp_path / "tier")
    assert not first.withdrawals.withdrawn(K1, D1)  # read the (absent) file
    row = Withdrawn(1, K1, D1, "2027-03-01T12:00:00Z", "code: differs")
    second.withdrawals.learn("http://s", [row], 1)
    first.withdrawals.learn("http://other", [], 0)  # writes what it knows, without a feed
    later = NodeTier(tmp_path / "tier")
    assert later.withdrawals.withdrawn(K1, D1)
    assert first.withdrawals.withdrawn(K1, D1)  # and the writer took it in


def test_the_last_binding_of_a_digest_takes_its_record_with_it(tmp_path: Path) -> None:
    tier = NodeTier(tmp_path / "tier")
    key, meta, _ = _entry(tier, "alone")
    _withdraw(tier, (key, meta.digest))
    assert not os.path.exists(tier.record_path(meta.digest))
    assert all(e.digest != meta.digest or not e.recipe_keys for e in tier.entries())


def _pack(tier: NodeTier, name: str, key: SigningKey) -> tuple[str, ArtifactMeta]:
    recipe_key, _, meta, data = tier_entry(name)
    with tier.packs.writer() as out:
        out.add(recipe_key, meta, data, key.sign(recipe_key, meta))
    tier.packs.refresh()
    return recipe_key, meta


def test_pack_and_layer_entries_are_refused_not_rewritten(tmp_path: Path) -> None:
    signer = SigningKey.generate()
    tier = NodeTier(tmp_path / "tier")
    packed_key, packed = _pack(tier, "packed", signer)
    layer_root = tmp_path / "layer"
    writer = NodeTier(layer_root)
    layer_key, layer_meta, _ = _entry(writer, "layered")
    layer = NodeTier(layer_root, read_only=True)
    layer.withdrawals = tier.withdrawals  # what a KernelCache does with its layers
    assert tier.lookup(packed_key) is not None
    pack_files = sorted(os.listdir(tmp_path / "tier" / "packs"))
    _withdraw(tier, (packed_key, packed.digest), (layer_key, layer_meta.digest))
    assert tier.lookup(packed_key) is None and tier.held_digest(packed_key) is None
    assert sorted(os.listdir(tmp_path / "tier" / "packs")) == pack_files  # left as it was
    assert layer.lookup(layer_key) is None
    assert writer.lookup(layer_key) is not None  # that tier's own process has not learnt it


def test_a_bundle_unpacked_into_the_tier_leaves_a_withdrawn_entry_out(tmp_path: Path) -> None:
    signer = SigningKey.generate()
    tier = NodeTier(tmp_path / "tier")
    entries = [tier_entry("b1"), tier_entry("b2")]
    path = tmp_path / "b.kcb"
    with open(path, "wb") as out:
        out.write(header_line())
        for key, _, meta, data in entries:
            out.write(entry_head(key, meta, signer.sign(key, meta)) + data + b"\n")
        out.write(end_line(len(entries), 0))
    (k1, _, m1, _), (k2, *_) = entries
    _withdraw(tier, (k1, m1.digest))
    from kcache_client._trust import Trust

    trust = Trust.from_settings(signer.public_key, tmp_path / "pins.json")
    load_bundle_file(tier, path, trust, max_entry_bytes=1 << 20)
    assert tier.lookup(k1) is None and tier.lookup(k2) is not None
    assert not os.path.exists(tier.index.alias_path(k1))


# ---------------------------------------------------------------------- a cache and a feed
def _recipe(tag: str) -> Recipe:
    return Recipe(
        source=f'// {tag}\nextern "C" __global__ void k() {{}}\n', target="sm_90", toolchain="t"
    )


def _held(root: Path, recipe: Recipe, name: str) -> ArtifactMeta:
    """A node tier holding ``recipe``'s key (as a fetch from the server left it)."""
    tier = NodeTier(root)
    _, _, meta, data = tier_entry(name)
    tier.publish(recipe.key(), recipe.base_key(), meta, data)
    tier.flush()
    return meta


def test_a_cache_reads_the_feed_before_its_tier_answers_and_then_asks_the_server(
    feed: Feed, tmp_path: Path
) -> None:
    root = tmp_path / "tier"
    wrong, right = _recipe("wrong"), _recipe("right")
    bad = _held(root, wrong, "bad")
    good = _held(root, right, "good")
    feed.rows = [_row(1, wrong.key(), bad.digest)]
    with _cache(feed.url, root) as cache:
        with pytest.raises(RemoteNotFoundError):  # refused here: only the server could answer
            cache.get(wrong, compile=False)
        assert cache.get(right).digest == good.digest  # the tier's other entries still answer
        assert cache.get(right).origin == "memory"
        assert feed.asked() == ["/v1/withdrawals?after=0&limit=10000"]  # once per process
        assert cache.stats.withdrawal_requests == 1
    assert not os.path.exists(NodeTier(root).index.alias_path(wrong.key()))
    # The next process of the node within a moment shares that check (the tier's file) ...
    with _cache(feed.url, root) as cache:
        assert cache.get(right).origin == "node"
    assert len(feed.asked()) == 1
    # ... and one later reads on from the last id it knows.
    _age_node_checks(root)
    with _cache(feed.url, root) as cache:
        assert cache.get(right).origin == "node"
    assert feed.asked()[1:] == ["/v1/withdrawals?after=1&limit=10000"]


def test_memory_forgets_what_a_later_check_withdraws(feed: Feed, tmp_path: Path) -> None:
    root = tmp_path / "tier"
    recipe = _recipe("later")
    meta = _held(root, recipe, "later")
    with _cache(feed.url, root) as cache:
        assert cache.get(recipe).origin == "node"
        assert cache.get(recipe).origin == "memory"
        feed.rows = [_row(4, recipe.key(), meta.digest)]
        watch = cache._lookup.watch
        assert watch is not None
        watch._checked = time.monotonic() - 3600  # as if the interval had passed
        with pytest.raises(RemoteNotFoundError):
            cache.get(recipe, compile=False)
        assert len(feed.asked()) == 2


@pytest.mark.parametrize(
    "answer",
    [
        json_response(404, {"code": "not_found", "detail": "Not Found"}),  # an older server
        json_response(200, {"withdrawals": "all", "last_id": 0}),  # refused
        json_response(500, {"code": "internal", "detail": "boom"}),
        (-1, {}, b""),  # no answer at all
    ],
    ids=["older server", "malformed", "error", "unreachable"],
)
def test_a_feed_that_does_not_answer_leaves_the_cache_with_what_it_knew(
    feed: Feed, tmp_path: Path, answer: tuple[int, dict[str, str], bytes]
) -> None:
    root = tmp_path / "tier"
    recipe, known = _recipe("kept"), _recipe("known")
    meta = _held(root, recipe, "kept")
    known_meta = _held(root, known, "known")
    tier = NodeTier(root)
    _withdraw(tier, (known.key(), known_meta.digest), url="http://elsewhere")
    tier.index.write_alias(known.key(), known_meta, None)  # planted back
    feed.answer = answer
    with _cache(feed.url, root) as cache:
        assert cache.get(recipe).digest == meta.digest  # no exception
        with pytest.raises(RemoteNotFoundError):
            cache.get(known, compile=False)  # what the tier's file knew still holds
        cache.check_withdrawals()  # within a moment of the last: not asked again
    assert len(feed.asked()) == 1


# ---------------------------------------------------------------------- a real server
ADMIN = "withdrawals-client-admin"


def _kernel(tag: str, value: int) -> dict[str, Any]:
    return {
        "source": f'// {tag}\nextern "C" __global__ void k(int* o) {{ o[0] = {value}; }}\n',
        "target": "sm_90",
    }


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    from kcache_server import Settings
    from kcache_server.auth import TokenStore
    from kcache_server.backends import open_settings_database
    from kcache_server.migrate import prepare_database

    root: Path = tmp_path_factory.mktemp("withdrawals-client")
    settings = Settings(
        data_dir=root / "data",
        compile_workers=1,
        audit={"flush_s": 0.05},
        auth_cache_s=0.0,
        verify={"sample_rate": 1.0, "cpu_share": 1.0, "period_s": 3600},
    )
    db = open_settings_database(settings)
    prepare_database(settings, db)
    TokenStore(db, 0).create("admin", ["admin"], token=ADMIN)
    db.dispose()
    started = ServerThread(settings)
    yield started
    started.stop()


def _resolve(client: httpx.Client, recipe: dict[str, Any], compile: bool = True) -> dict[str, Any]:
    answer = client.post("/v1/resolve", json={"recipe": recipe, "compile": compile})
    assert answer.status_code == 200, answer.text
    body: dict[str, Any] = answer.json()
    return body


def _withdrawn(client: httpx.Client, key: str, timeout: float = 120.0) -> dict[str, Any]:
    """The feed's row for ``key``, once verification has withdrawn it (a generous bound)."""
    deadline = time.monotonic() + timeout
    rows: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        rows = client.get("/v1/withdrawals").raise_for_status().json()["withdrawals"]
        for row in rows:
            if row["recipe_key"] == key:
                return dict(row)
        time.sleep(0.2)
    raise AssertionError(f"no withdrawal of {key} within {timeout}s: {rows}")


def _age_node_checks(root: Path, seconds: float = 60.0) -> None:
    """Make the node's reads of every server's feed ``seconds`` older (as a later job finds
    them: one within SHARED_S is shared with the node's other processes)."""
    path = root / "index" / FILE_NAME
    state = json.loads(path.read_bytes())
    for server in state["servers"].values():
        server["checked_at"] -= seconds
    path.write_text(json.dumps(state))


def _server_cache(server: ServerThread, root: Path) -> KernelCache:
    settings = QUIET.located(server.url, ADMIN, root)
    return KernelCache(settings=settings)


def test_a_tier_that_held_a_withdrawn_binding_answers_the_fresh_one_after_its_next_start(
    server: ServerThread, tmp_path: Path
) -> None:
    from kcache_server.models import RecipeAlias

    recipe_body = _kernel("held-right", 1)
    recipe = Recipe(source=recipe_body["source"], target="sm_90")
    root = tmp_path / "tier"
    with server.client(ADMIN) as client:
        right = _resolve(client, recipe_body)
        other = _resolve(client, _kernel("held-other", 2))
        key, right_digest = right["recipe_key"], right["artifact"]["digest"]
        wrong_digest = other["artifact"]["digest"]
        with server.state.backends.db.begin() as conn:  # the wrong binding, planted
            conn.execute(
                sa.update(RecipeAlias)
                .where(RecipeAlias.recipe_key == key)
                .values(digest=wrong_digest)
            )
        server.state.resolver.forget(key)  # memory must not hide it
        with _server_cache(server, root) as first:  # a job that was served the wrong kernel
            assert first.key(recipe) == key
            served = first.get(recipe)
            assert (served.origin, served.digest) == ("server", wrong_digest)
            wrong_bytes = served.data
        alias = Path(NodeTier(root).index.alias_path(key))
        replay = alias.read_bytes()  # the signed answer key -> wrong digest
        assert json.loads(replay)["signature"]
        _withdrawn(client, key)  # verification found it and withdrew it
        # The first job's answers stood for reads of the feed (X-KCache-Withdrawals-Through),
        # which the node's processes share for 2 s: the next job starts later than that.
        _age_node_checks(root)
        with _server_cache(server, root) as nxt:  # the node's next job
            again = nxt.get(recipe)
            assert (again.origin, again.digest) == ("server", right_digest)
            again.check()
        assert NodeTier(root).lookup(key)[0].digest == right_digest  # type: ignore[index]

        # The old signed answer, planted back into this tier: refused, from the tier's file.
        alias.write_bytes(replay)
        with _server_cache(server, root) as later:
            replayed = later.get(recipe)
            assert (replayed.origin, replayed.digest) == ("server", right_digest)

        # ... and into a shared tier (sticky, writable by all), where a signed entry by the
        # server's key is otherwise used as it is: refused there too.
        shared = tmp_path / "shared"
        shared.mkdir()
        os.chmod(shared, 0o1777)
        planted = NodeTier(shared)
        assert planted.standing.kind == "shared"
        planted.store.put(wrong_bytes)
        os.makedirs(os.path.dirname(planted.index.alias_path(key)), exist_ok=True)
        Path(planted.index.alias_path(key)).write_bytes(replay)
        with _server_cache(server, shared) as other_user:
            found = other_user.tier.lookup_signed(key)  # what it held before it asked
            assert found is not None and found[0].digest == wrong_digest and found[2]
            art = other_user.get(recipe)
            assert (art.origin, art.digest) == ("server", right_digest)


def _through(server: ServerThread, at_least: int, timeout: float = 60.0) -> int:
    """The server's withdrawal position once its follower has read ``at_least`` (a generous
    bound: the follower polls twice a second)."""
    deadline = time.monotonic() + timeout
    while True:
        through = server.state.resolver.withdrawn_through
        if through is not None and through >= at_least:
            return through
        assert time.monotonic() < deadline, f"the follower is at {through}, not {at_least}"
        time.sleep(0.05)


def _node_reads_the_feed(server: ServerThread, root: Path) -> int:
    """A process of the node at ``root`` reads the server's feed to its end; the last id,
    once the server's follower has read that far too."""
    with _server_cache(server, root) as reader:
        reader.check_withdrawals()
        known = reader.tier.withdrawals.last(server.url)[0]
    assert _through(server, known) == known
    return known


def test_a_fetch_answer_stands_for_a_read_of_the_feed_the_node_has_read_that_far(
    server: ServerThread, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kcache_client import _withdrawal_watch

    # A node's processes share a read for SHARED_S (2 s): widened here, so that whether a
    # process reads the feed depends on what the node knows, not on how fast this runs.
    window = 3600.0
    monkeypatch.setattr(_withdrawal_watch, "SHARED_S", window)
    bodies = [_kernel(f"through-{i}", 10 + i) for i in range(3)]
    recipes = [Recipe(source=b["source"], target="sm_90") for b in bodies]
    root = tmp_path / "tier"
    with server.client(ADMIN) as client:
        for body in bodies:
            _resolve(client, body)
    known = _node_reads_the_feed(server, root)
    _age_node_checks(root, 2 * window)  # no longer shared: only an answer can stand for a read

    with _server_cache(server, root) as first:  # a cold fetch: the answer says "through known"
        assert first.get(recipes[0]).origin == "server"
        assert first.stats.withdrawal_requests == 0
    with _server_cache(server, root) as second:  # another process: its tier answer needs no read
        assert second.get(recipes[0]).origin == "node"
        assert second.stats.withdrawal_requests == 0

    # The server withdraws something the node does not know: an answer through it is no read
    # of the feed, and the next tier answer reads it.
    key, digest = hashlib.sha256(b"elsewhere").hexdigest(), hashlib.sha256(b"d").hexdigest()
    newest = server.state.backends.index.withdraw_binding(key, digest, "test", base_key=key)
    assert _through(server, newest) == newest > known
    _age_node_checks(root, 2 * window)
    with _server_cache(server, root) as behind:
        assert behind.get(recipes[1]).origin == "server"
        assert behind.stats.withdrawal_requests == 0
        assert behind.get(recipes[0]).origin == "node"
        assert behind.stats.withdrawal_requests == 1
        assert behind.tier.withdrawals.withdrawn(key, digest)


def test_a_bundle_answer_stands_for_a_read_of_the_feed_too(
    server: ServerThread, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kcache_client import _withdrawal_watch

    window = 3600.0  # as above: what the node knows decides, not how fast this runs
    monkeypatch.setattr(_withdrawal_watch, "SHARED_S", window)
    bodies = [_kernel(f"bundled-{i}", 20 + i) for i in range(2)]
    recipes = [Recipe(source=b["source"], target="sm_90") for b in bodies]
    with server.client(ADMIN) as client:
        for body in bodies:
            _resolve(client, body)
    with _server_cache(server, tmp_path / "built") as build:  # the job's previous run
        for recipe in recipes:
            build.get(recipe)
        manifest = build.manifest("bundled")
    root = tmp_path / "tier"
    _node_reads_the_feed(server, root)
    _age_node_checks(root, 2 * window)
    with _server_cache(server, root) as leader:  # the node's prefetch: one bundle request
        assert leader.prefetch(manifest).fetched == len(recipes)
        assert leader.stats.withdrawal_requests == 0
    with _server_cache(server, root) as rank:  # a rank's tier answers need no read
        assert [rank.get(r).origin for r in recipes] == ["node", "node"]
        assert rank.stats.withdrawal_requests == 0


def test_in_a_shared_tier_an_answer_stands_for_no_read_and_a_planted_position_for_none(
    server: ServerThread, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tier others can write (1777): its file's last ids are not trusted, so a fresh
    process knows the feed from 0, an answer through a later withdrawal stands for no read,
    and each process reads the feed at its first tier answer, whatever the file claims."""
    from kcache_client import _withdrawal_watch

    window = 3600.0  # as above: what the process knows decides, not how fast this runs
    monkeypatch.setattr(_withdrawal_watch, "SHARED_S", window)
    key, digest = hashlib.sha256(b"shared-elsewhere").hexdigest(), hashlib.sha256(b"e").hexdigest()
    newest = server.state.backends.index.withdraw_binding(key, digest, "test", base_key=key)
    assert _through(server, newest) >= newest > 0
    body = _kernel("shared-through", 30)
    recipe = Recipe(source=body["source"], target="sm_90")
    with server.client(ADMIN) as client:
        _resolve(client, body)
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)

    with _server_cache(server, shared) as first:  # a cold fetch into the shared tier
        assert first.tier.standing.kind == "shared"
        assert first.get(recipe).origin == "server"
        assert first.stats.withdrawal_requests == 0  # a server answer needs no read ...
        assert first.tier.withdrawals.last(server.url)[0] == 0  # ... and stood for none
    # Someone who can write the tier claims the node read the feed far ahead, just now.
    path = shared / "index" / FILE_NAME
    claimed = {server.url: {"last_id": 10**9, "checked_at": time.time()}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"version": 1, "servers": claimed, "pairs": []}))
    for _ in range(2):  # each later process reads the feed before its first tier answer
        with _server_cache(server, shared) as later:
            assert later.get(recipe).origin == "node"
            assert later.stats.withdrawal_requests >= 1
            assert later.tier.withdrawals.withdrawn(key, digest)
