"""Withdrawals are facts of the store: every replica and worker stops serving a withdrawn binding.

A divergence withdraws one binding (the recipe key that diverged -> the digest it
answered), in the database, beside removing it from the index. Checked here:

- :meth:`SqlIndex.withdraw_binding` removes that recipe's alias (if it still names the
  digest) and its base key's manifest entries naming the digest, writes the row, and
  leaves every other recipe's binding to the same bytes alone (SQLite and PostgreSQL);
- two replicas on one PostgreSQL and one store, the other one running two worker
  processes, both holding the wrong binding in memory: the verifying replica withdraws
  it, and the other stops answering it by fetch and by resolve in every worker (a
  generous bound, never a timing assertion); the digest's own recipe is still served
  by both; ``GET /v1/withdrawals`` lists the withdrawal in the shape clients read.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from kcache.artifact import ArtifactMeta
from kcache.deps import Dependency
from kcache.recipe import Recipe
from kcache.toolchain import Toolchain
from tests.support import ServerProcess, pg_database, unique, upgrade

HEX64 = set("0123456789abcdef")
#: Fresh-connection requests in a row that must all agree: with two worker processes
#: each takes some (the kernel spreads new connections), so every worker is asked.
IN_A_ROW = 12


def _h(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _meta(name: str, deps: tuple[Dependency, ...] = ()) -> ArtifactMeta:
    return ArtifactMeta(
        digest=_h(name),
        size=10,
        kind="cubin",
        target="sm_80",
        toolchain="tc",
        log="ok",
        dependencies=deps,
        dependencies_exact=True,
        kernel="k",
        created_at=1_700_000_000.0,
    )


# ------------------------------------------------------------------------------ the index
@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'i.db'}"
        upgrade(url)
        yield url
        return
    with pg_database() as url:
        upgrade(url)
        yield url


def test_withdrawing_a_binding_leaves_other_recipes_of_the_same_bytes(db_url: str) -> None:
    from kcache_server.db import open_database
    from kcache_server.index import SqlIndex
    from kcache_server.withdrawals import WithdrawalLog

    engine = open_database(db_url)
    try:
        index = SqlIndex(engine)
        wrong, right = _h("wrong-key"), _h("right-key")
        wrong_base, right_base = _h("wrong-base"), _h("right-base")
        shared = _meta("shared bytes", (Dependency("a.cuh", _h("a")),))
        index.record_artifact(right, right_base, shared)  # its own, right recipe
        index.record_artifact(wrong, wrong_base, shared)  # under-keyed: the same bytes
        other = _meta("another version", (Dependency("a.cuh", _h("a2")),))
        index.record_artifact(_h("later-key"), wrong_base, other)  # the base key's other entry

        first = index.withdraw_binding(
            wrong, shared.digest, "verification: code", base_key=wrong_base
        )

        assert index.lookup(wrong) is None
        assert index.lookup(right) == shared  # the bytes are right for this recipe
        assert [e.digest for e in index.manifest(wrong_base)] == [other.digest]
        assert [e.digest for e in index.manifest(right_base)] == [shared.digest]
        assert index.artifact(shared.digest) == shared  # the row (and blob) stay

        # A key bound again since (to a fresh compile) keeps its new binding.
        fresh = _meta("fresh compile")
        index.record_artifact(wrong, wrong_base, fresh)
        second = index.withdraw_binding(wrong, shared.digest, "again", base_key=wrong_base)
        assert index.lookup(wrong) == fresh
        assert second > first

        rows = WithdrawalLog(engine).after(0)
        assert [(r.id, r.recipe_key, r.digest, r.reason) for r in rows] == [
            (first, wrong, shared.digest, "verification: code"),
            (second, wrong, shared.digest, "again"),
        ]
        assert WithdrawalLog(engine).after(first) == rows[1:]
        assert WithdrawalLog(engine).last_id() == second
    finally:
        engine.dispose()


# ------------------------------------------------------------------------------ two replicas
def _kernel(tag: str, value: int) -> dict[str, Any]:
    return {
        "source": f'// {tag}\nextern "C" __global__ void k(int* o) {{ o[0] = {value}; }}\n',
        "target": "sm_80",
    }


@dataclass
class Withdrawn:
    """The scenario, played once for the module's tests."""

    verifying: ServerProcess
    other: ServerProcess  # two worker processes, no verification, no store cap
    wrong_key: str  # planted on the right recipe's bytes
    right_key: str  # the digest's own recipe
    wrong_digest: str
    fresh_digest: str | None  # what the wrong key answers once the other replica stopped
    stopped: bool  # whether the other replica stopped answering the withdrawn binding
    seconds: float  # how long that took after the withdrawal was listed (for the log only)
    served_before: set[str]  # what the other replica's workers answered before
    through_before: set[str | None]  # how far their answers' withdrawals went, before


def _fetch(url: str, key: str) -> httpx.Response:
    return httpx.get(f"{url}/v1/recipes/{key}/artifact", timeout=60)  # a fresh connection


def _fetch_digest(url: str, key: str) -> str | None:
    answer = _fetch(url, key)
    return answer.headers["x-kcache-digest"] if answer.status_code == 200 else None


def _resolve(url: str, recipe: dict[str, Any], compile: bool = False) -> dict[str, Any]:
    answer = httpx.post(
        f"{url}/v1/resolve", json={"recipe": recipe, "compile": compile}, timeout=120
    )
    assert answer.status_code in (200, 404), answer.text
    body: dict[str, Any] = answer.json()
    return body


def _resolved_digest(url: str, recipe: dict[str, Any]) -> str | None:
    body = _resolve(url, recipe)
    return str(body["artifact"]["digest"]) if "artifact" in body else None


def _listed(url: str, key: str) -> list[dict[str, Any]]:
    body = httpx.get(f"{url}/v1/withdrawals", timeout=30).raise_for_status().json()
    return [w for w in body["withdrawals"] if w["recipe_key"] == key]


@pytest.fixture(scope="module")
def withdrawn(
    tmp_path_factory: pytest.TempPathFactory, toolchain: Toolchain
) -> Iterator[Withdrawn]:
    from kcache_server.models import RecipeAlias, utcnow

    with pg_database() as url:
        upgrade(url)
        data = tmp_path_factory.mktemp("withdrawals") / "data"
        common = {**os.environ, "KCACHE_COMPILE_WORKERS": "1", "KCACHE_AUDIT_FLUSH_S": "0.1"}
        verifying = ServerProcess(
            data,
            db_url=url,
            env={
                **common,
                "KCACHE_VERIFY_SAMPLE_RATE": "1",
                "KCACHE_VERIFY_CPU_SHARE": "1",
                "KCACHE_VERIFY_PERIOD_S": "3600",
            },
        )
        other = ServerProcess(
            data, db_url=url, workers=2, env={**common, "KCACHE_VERIFY_ENABLED": "0"}
        )
        try:
            verifying.launch()
            other.launch()
            verifying.wait_ready(ready="/readyz")
            other.wait_ready(ready="/readyz")

            tag = unique()
            wrong_recipe, right_recipe = _kernel(f"{tag}-a", 1), _kernel(f"{tag}-b", 2)
            right = _resolve(other.url, right_recipe, compile=True)
            assert right["status"] == "compiled", right
            digest = right["artifact"]["digest"]
            wrong_key = Recipe.from_dict(wrong_recipe).with_defaults(toolchain=toolchain.id).key()
            engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
            try:
                with engine.begin() as conn:  # the under-keyed row: another recipe's bytes
                    conn.execute(
                        sa.insert(RecipeAlias).values(
                            recipe_key=wrong_key, digest=digest, created_at=utcnow()
                        )
                    )
            finally:
                engine.dispose()

            # Every worker of the other replica answers the wrong binding, from memory
            # once it has read it.
            served_before: set[str] = set()
            through_before: set[str | None] = set()
            for _ in range(IN_A_ROW):
                fetched = _fetch(other.url, wrong_key)
                served_before.add(str(fetched.headers.get("x-kcache-digest")))
                through_before.add(fetched.headers.get("x-kcache-withdrawals-through"))
                served_before.add(str(_resolved_digest(other.url, wrong_recipe)))
                served_before.add(str(_fetch_digest(other.url, right["recipe_key"])))

            # The verifying replica serves it once, verifies it, finds it wrong, withdraws it.
            planted = _resolve(verifying.url, wrong_recipe)
            assert planted["recipe_key"] == wrong_key, "the test's key is not the server's"
            assert planted["status"] == "hit" and planted["artifact"]["digest"] == digest
            deadline = time.monotonic() + 180
            while not _listed(other.url, wrong_key):
                assert time.monotonic() < deadline, "no withdrawal within 180s: " + (
                    verifying.log_tail()
                )
                time.sleep(0.1)

            listed_at = time.monotonic()
            in_a_row, fresh, stopped = 0, None, False
            while time.monotonic() - listed_at < 20.0:
                answers = {_fetch_digest(other.url, wrong_key)}
                answers.add(_resolved_digest(other.url, wrong_recipe))
                if digest in answers:
                    in_a_row = 0
                else:
                    in_a_row += 1
                    fresh = next(iter(answers - {None}), fresh)
                    if in_a_row >= IN_A_ROW:
                        stopped = True
                        break
                time.sleep(0.05)
            yield Withdrawn(
                verifying,
                other,
                wrong_key,
                right["recipe_key"],
                digest,
                fresh,
                stopped,
                time.monotonic() - listed_at,
                served_before,
                through_before,
            )
        finally:
            other.stop()
            verifying.stop()


def test_every_worker_of_the_other_replica_stops_serving_the_withdrawn_binding(
    withdrawn: Withdrawn,
) -> None:
    assert withdrawn.served_before == {withdrawn.wrong_digest}  # the wrong kernel, before
    assert withdrawn.stopped, (
        f"the other replica still answered {withdrawn.wrong_key} -> {withdrawn.wrong_digest} "
        f"{withdrawn.seconds:.1f}s after the withdrawal"
    )
    # The fresh compile the verifier published is what the key answers now, everywhere.
    assert withdrawn.fresh_digest not in (None, withdrawn.wrong_digest)
    for url in (withdrawn.verifying.url, withdrawn.other.url):
        assert _fetch_digest(url, withdrawn.wrong_key) == withdrawn.fresh_digest


def test_the_digests_own_recipe_is_still_served_by_both_replicas(withdrawn: Withdrawn) -> None:
    for url in (withdrawn.verifying.url, withdrawn.other.url):
        for _ in range(IN_A_ROW // 2):
            assert _fetch_digest(url, withdrawn.right_key) == withdrawn.wrong_digest


def test_the_feed_lists_the_withdrawal_in_the_shape_clients_read(withdrawn: Withdrawn) -> None:
    url = withdrawn.other.url
    body = httpx.get(f"{url}/v1/withdrawals", params={"after": 0}).raise_for_status().json()
    assert set(body) == {"withdrawals", "last_id"}
    rows = body["withdrawals"]
    assert [(w["recipe_key"], w["digest"]) for w in rows] == [
        (withdrawn.wrong_key, withdrawn.wrong_digest)
    ]
    row = rows[0]
    assert set(row) == {"id", "recipe_key", "digest", "at", "reason"}
    assert isinstance(row["id"], int) and body["last_id"] == row["id"]
    assert set(row["recipe_key"]) <= HEX64 and set(row["digest"]) <= HEX64
    assert datetime.fromisoformat(row["at"].replace("Z", "+00:00")).tzinfo is not None
    assert row["reason"].startswith("verification: code")

    after = httpx.get(f"{url}/v1/withdrawals", params={"after": row["id"], "limit": 5}).json()
    assert after == {"withdrawals": [], "last_id": row["id"]}  # none: `after` comes back
    for bad in ({"limit": 0}, {"limit": 10_001}, {"after": -1}):
        assert httpx.get(f"{url}/v1/withdrawals", params=bad).status_code == 422


def test_every_answer_by_key_says_how_far_its_withdrawals_go(withdrawn: Withdrawn) -> None:
    # Before: every worker had acted on no withdrawal (a new database), and said so.
    assert withdrawn.through_before == {"0"}
    (row,) = _listed(withdrawn.other.url, withdrawn.wrong_key)
    # After: every process of both replicas says the withdrawal's id once its follower read it
    # (the route's answers and the fast path's alike; a generous bound, twice a second each).
    for url in (withdrawn.verifying.url, withdrawn.other.url):
        deadline = time.monotonic() + 60
        in_a_row = 0
        while in_a_row < IN_A_ROW:
            answer = _fetch(url, withdrawn.right_key)
            assert answer.status_code == 200
            assert answer.headers["cache-control"] == "no-cache"  # a key's answer is not for ever
            if answer.headers.get("x-kcache-withdrawals-through") == str(row["id"]):
                in_a_row += 1
            else:
                in_a_row = 0
                assert time.monotonic() < deadline, answer.headers
                time.sleep(0.1)
