"""Foreign artifacts (docs/design.md section 10): library cache hooks' bytes under the library's key.

One real server (SQLite) with tokens per scope for the module: publishing needs
``publish`` (or ``admin``), a group is refused until every blob it names is stored, the
first publish of a name wins, a lookup is signed "published by <writer>" under a message
no recipe binding has, audited, and garbage collection keeps a foreign file's blob.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from kcache.foreign import ForeignBinding, ForeignFileRef, ForeignName, binding_key
from kcache.signing import SignatureError, TrustedKeys, signed_message
from tests.support import ServerThread, unique, vector_add

NAMESPACE = {"version": "14.2.0", "target": "sm_90", "toolchain": "nvrtc-13.0"}


@dataclass
class Foreign:
    server: ServerThread
    tokens: dict[str, str]

    def client(self, scope: str) -> httpx.Client:
        return self.server.client(self.tokens[scope])


@pytest.fixture(scope="module")
def foreign(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Foreign]:
    from kcache_server import Settings

    data = tmp_path_factory.mktemp("foreign") / "data"
    server = ServerThread(
        Settings(
            data_dir=data,
            compile_workers=1,
            audit={"flush_s": 0.05},
            auth_cache_s=0.0,
            foreign_max_bytes=4096,
        )
    )
    try:
        tokens = {
            scope: server.state.tokens.create(f"t-{scope}", scopes)
            for scope, scopes in {
                "read": ["read"],
                "compile": ["compile"],
                "publish": ["publish"],
                "admin": ["admin"],
            }.items()
        }
        yield Foreign(server, tokens)
    finally:
        server.stop()


def _blob(http: httpx.Client, data: bytes) -> str:
    digest = hashlib.sha256(data).hexdigest()
    answer = http.put(
        f"/v1/blobs/{digest}",
        content=data,
        headers={"content-type": "application/octet-stream"},
    )
    assert answer.status_code == 200, answer.text
    return digest


def _publish(http: httpx.Client, library: str, key: str, files: dict[str, bytes]) -> httpx.Response:
    refs = [
        {"name": name, "digest": _blob(http, data), "size": len(data)}
        for name, data in files.items()
    ]
    return http.put(f"/v1/foreign/{library}/{key}", json={**NAMESPACE, "files": refs})


def _binding(entry: dict[str, Any]) -> ForeignBinding:
    files = tuple(ForeignFileRef(f["name"], f["digest"], f["size"]) for f in entry["files"])
    return ForeignBinding(ForeignName.checked(entry), files, entry["writer"])


def test_publish_then_lookup_is_signed_as_published_by_the_writer(foreign: Foreign) -> None:
    key = unique("kern") + ".cubin"
    cubin = os.urandom(300)
    with foreign.client("publish") as http:
        answer = _publish(http, "cupy", key, {"payload": cubin})
        assert answer.status_code == 200, answer.text
        assert answer.json()["published"] is True
    with foreign.client("read") as http:
        got = http.get(f"/v1/foreign/cupy/{key}", params=NAMESPACE)
        assert got.status_code == 200, got.text
        entry = got.json()
        keys = http.get("/v1/keys").json()
        (file,) = entry["files"]
        assert http.get(f"/v1/blobs/{file['digest']}").content == cubin
    assert entry["writer"] == "token:t-publish"
    assert entry["binding_key"] == binding_key("cupy", *NAMESPACE.values(), key)
    trusted = TrustedKeys(k["public_key"] for k in keys["keys"])
    from kcache.signing import Signature

    signature = Signature.from_dict(entry["signature"])
    binding = _binding(entry)
    trusted.verify_foreign(binding, signature)  # "published by token:t-publish"
    # Another writer, another file, another name: the signature covers each.
    for changed in (
        ForeignBinding(binding.name, binding.files, "token:other"),
        ForeignBinding(
            ForeignName("cupy", "14.1.0", "sm_90", "nvrtc-13.0", key), binding.files, binding.writer
        ),
    ):
        with pytest.raises(SignatureError):
            trusted.verify_foreign(changed, signature)
    # Never "compiled by kcache": the message has a prefix no recipe binding's has.
    assert binding.message().startswith(b"kcache-foreign/v1:")
    assert not binding.message().startswith(b"{")
    assert signed_message.__name__  # (the recipe message is canonical JSON, starting with "{")


def test_a_lookup_that_misses_is_404_and_both_are_audited(foreign: Foreign) -> None:
    key = unique("missing")
    with foreign.client("read") as http:
        answer = http.get(f"/v1/foreign/triton/{key}", params=NAMESPACE)
        assert answer.status_code == 404
        assert answer.json()["error"] == "not_found"
    foreign.server.state.audit.flush()
    import sqlalchemy as sa

    with foreign.server.state.backends.db.connect() as conn:
        rows = conn.execute(
            sa.text("SELECT outcome, route, kernel, target FROM audit_events WHERE kernel = :k"),
            {"k": f"foreign:triton:{key}"},
        ).all()
    assert [tuple(r) for r in rows] == [("miss", "foreign", f"foreign:triton:{key}", "sm_90")]
    # Hits are tallied: a warm loop of lookups is a few rows with their counts, not a row each.
    with foreign.client("publish") as http:
        assert _publish(http, "triton", key, {"payload": b"now here"}).status_code == 200
        for _ in range(20):
            assert http.get(f"/v1/foreign/triton/{key}", params=NAMESPACE).status_code == 200
    foreign.server.state.audit.flush()
    with foreign.server.state.backends.db.connect() as conn:
        hits = conn.execute(
            sa.text(
                "SELECT count(*), sum(count) FROM audit_events WHERE kernel = :k AND outcome = 'hit'"
            ),
            {"k": f"foreign:triton:{key}"},
        ).one()
    assert hits[1] == 20 and hits[0] < 20


def test_who_may_publish(foreign: Foreign) -> None:
    data = os.urandom(64)
    digest = hashlib.sha256(data).hexdigest()
    for scope in ("read", "compile"):
        with foreign.client(scope) as http:
            answer = http.put(f"/v1/blobs/{digest}", content=data)
            assert answer.status_code == 403, (scope, answer.text)
            assert "publish" in answer.json()["detail"]
            body = {**NAMESPACE, "files": [{"name": "a", "digest": digest, "size": 64}]}
            assert http.put(f"/v1/foreign/cupy/{unique('k')}", json=body).status_code == 403
    with foreign.client("admin") as http:
        assert _publish(http, "cupy", unique("adm"), {"a": data}).status_code == 200
    with foreign.client("publish") as http:  # publish reads too
        assert http.get(f"/v1/foreign/cupy/{unique('x')}", params=NAMESPACE).status_code == 404
        # but does not remove
        assert http.delete(f"/v1/foreign/cupy/{unique('x')}", params=NAMESPACE).status_code == 403


def test_a_group_is_refused_until_every_blob_is_stored(foreign: Foreign) -> None:
    key = unique("grp")
    stored, absent = os.urandom(100), os.urandom(100)
    with foreign.client("publish") as http:
        files = [
            {"name": "kernel.cubin", "digest": _blob(http, stored), "size": 100},
            {
                "name": "__grp__kernel.json",
                "digest": hashlib.sha256(absent).hexdigest(),
                "size": 100,
            },
        ]
        answer = http.put(f"/v1/foreign/triton/{key}", json={**NAMESPACE, "files": files})
        assert answer.status_code == 404, answer.text
        assert answer.json()["error"] == "not_found"
        assert "__grp__kernel.json" in answer.json()["detail"]
        wrong_size = [files[0], {**files[1], "digest": files[0]["digest"], "size": 99}]
        answer = http.put(f"/v1/foreign/triton/{key}", json={**NAMESPACE, "files": wrong_size})
        assert answer.status_code == 422 and answer.json()["field"] == "files"
        assert http.get(f"/v1/foreign/triton/{key}", params=NAMESPACE).status_code == 404
        _blob(http, absent)
        answer = http.put(f"/v1/foreign/triton/{key}", json={**NAMESPACE, "files": files})
        assert answer.status_code == 200, answer.text
        got = http.get(f"/v1/foreign/triton/{key}", params=NAMESPACE).json()
    assert sorted(f["name"] for f in got["files"]) == ["__grp__kernel.json", "kernel.cubin"]


def test_the_first_publish_wins_until_an_admin_removes_it(foreign: Foreign) -> None:
    key = unique("first")
    first, second = os.urandom(50), os.urandom(50)
    with foreign.client("publish") as http:
        assert _publish(http, "cupy", key, {"payload": first}).json()["published"] is True
        again = _publish(http, "cupy", key, {"payload": second}).json()
        assert (again["published"], again["same"]) == (False, False)
        assert again["entry"]["files"][0]["digest"] == hashlib.sha256(first).hexdigest()
        same = _publish(http, "cupy", key, {"payload": first}).json()
        assert (same["published"], same["same"]) == (False, True)
    with foreign.client("admin") as http:
        assert http.delete(f"/v1/foreign/cupy/{key}", params=NAMESPACE).json() == {"removed": True}
        assert http.delete(f"/v1/foreign/cupy/{key}", params=NAMESPACE).json() == {"removed": False}
    with foreign.client("publish") as http:
        assert _publish(http, "cupy", key, {"payload": second}).json()["published"] is True


def test_namespaces_are_apart(foreign: Foreign) -> None:
    key = unique("ns")
    with foreign.client("publish") as http:
        assert _publish(http, "cupy", key, {"payload": b"x" * 10}).status_code == 200
        for other in ({"version": "14.1.0"}, {"target": "sm_80"}, {"toolchain": "nvrtc-12.8"}):
            params = {**NAMESPACE, **other}
            assert http.get(f"/v1/foreign/cupy/{key}", params=params).status_code == 404
        assert http.get(f"/v1/foreign/cuda-core/{key}", params=NAMESPACE).status_code == 404


def test_bounds_and_bad_names(foreign: Foreign) -> None:
    big = os.urandom(4097)
    digest = hashlib.sha256(big).hexdigest()
    with foreign.client("publish") as http:
        answer = http.put(f"/v1/blobs/{digest}", content=big)
        assert answer.status_code == 413, answer.text
        assert "foreign_max_bytes" in answer.json()["detail"]
        wrong = http.put(f"/v1/blobs/{'0' * 64}", content=b"abc")
        assert wrong.status_code == 422 and wrong.json()["field"] == "body"
        assert http.put("/v1/blobs/not-a-digest", content=b"abc").status_code == 400
        assert http.get("/v1/foreign/cupy/a%20b", params=NAMESPACE).status_code == 400
        assert http.get("/v1/foreign/CuPy/abc", params=NAMESPACE).status_code == 400
        bad = http.get("/v1/foreign/cupy/abc", params={**NAMESPACE, "target": "sm 90"})
        assert bad.status_code == 422 and bad.json()["field"] == "query.target"
        unknown = http.get("/v1/foreign/cupy/abc", params={**NAMESPACE, "arch": "sm_90"})
        assert unknown.status_code == 422 and unknown.json()["field"] == "query.arch"
        assert http.get("/v1/foreign/cupy/abc").status_code == 422  # the namespace is required
        same = {**NAMESPACE, "files": [{"name": "a", "digest": "0" * 64, "size": 1}] * 2}
        assert http.put(f"/v1/foreign/cupy/{unique('k')}", json=same).status_code == 404
        other = {"name": "a", "digest": "1" * 64, "size": 1}
        twice = {**NAMESPACE, "files": [same["files"][0], other]}
        answer = http.put(f"/v1/foreign/cupy/{unique('k')}", json=twice)
        assert answer.status_code == 409 and answer.json()["error"] == "conflict"
        many = {
            **NAMESPACE,
            "files": [{"name": f"f{i}", "digest": "0" * 64, "size": 1} for i in range(65)],
        }
        assert http.put(f"/v1/foreign/cupy/{unique('k')}", json=many).status_code == 422


def test_garbage_collection_keeps_a_foreign_file(foreign: Foreign) -> None:
    from kcache.maintenance import collect_garbage

    data = os.urandom(200)
    with foreign.client("publish") as http:
        assert _publish(http, "cupy", unique("gc"), {"payload": data}).status_code == 200
        orphan = _blob(http, os.urandom(200))  # stored, named by no group
    state = foreign.server.state
    digest = hashlib.sha256(data).hexdigest()
    index = state.backends.index
    assert digest in index.digests() and index.names(digest)
    assert index.named([digest, orphan]) == {digest}
    report = collect_garbage(
        state.backends.store, index.digests(), grace_seconds=-1, still_referenced=index.names
    )
    assert state.backends.store.has(digest)
    assert not state.backends.store.has(orphan)
    assert report.blobs >= 1


# ---------------------------------------------------------------- the service, on both databases


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def foreign_store(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[Any]:
    """A ForeignStore over a database at the head revision (SQLite, or a fresh PostgreSQL)."""
    from kcache_server.db import open_database
    from kcache_server.foreign import ForeignStore
    from kcache_server.signer import ArtifactSigner

    from kcache.store.local import LocalArtifactStore
    from tests.support import pg_database, upgrade

    signer = ArtifactSigner.load(tmp_path / "key.pem", create=True)
    store = LocalArtifactStore(tmp_path / "blobs")

    def made(url: str) -> Any:
        upgrade(url)
        db = open_database(url)
        return ForeignStore(db, store, signer), db

    if request.param == "sqlite":
        service, db = made(f"sqlite:///{tmp_path / 'kcache.db'}")
        yield service
        db.dispose()
    else:
        with pg_database("kcache_foreign") as url:
            service, db = made(url)
            yield service
            db.dispose()


def test_racing_publishes_of_one_name_bind_one_group(foreign_store: Any) -> None:
    import threading

    groups = []
    for i in range(8):
        data = f"writer {i}".encode()
        foreign_store.store_blob(hashlib.sha256(data).hexdigest(), data)
        ref = ForeignFileRef("payload", hashlib.sha256(data).hexdigest(), len(data))
        groups.append(
            ForeignBinding(
                ForeignName("cupy", "14.2.0", "sm_90", "nvrtc-13.0", "raced"), (ref,), f"token:w{i}"
            )
        )
    results: list[Any] = [None] * len(groups)
    barrier = threading.Barrier(len(groups))

    def publish(i: int) -> None:
        barrier.wait()
        results[i] = foreign_store.publish(groups[i])

    threads = [threading.Thread(target=publish, args=(i,)) for i in range(len(groups))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(published for _, published in results) == 1
    (winner,) = [found.binding for found, published in results if published]
    assert {found.binding for found, _ in results} == {winner}  # every writer sees the one binding
    stored = foreign_store.get(winner.binding_key)
    assert stored is not None and stored.binding == winner
    assert foreign_store.delete(winner.binding_key, "a test removes it")
    assert foreign_store.get(winner.binding_key) is None


def test_a_removal_writes_its_withdrawal_in_the_same_transaction(foreign_store: Any) -> None:
    """The binding key and the group's content digest, once (a second removal finds none);
    removals racing each other get ids in commit order, each naming its own group."""
    import threading

    from kcache_server.withdrawals import WithdrawalLog

    from kcache.foreign import group_digest

    bindings = []
    for i in range(6):
        data = f"group {i}".encode()
        foreign_store.store_blob(hashlib.sha256(data).hexdigest(), data)
        ref = ForeignFileRef("payload", hashlib.sha256(data).hexdigest(), len(data))
        name = ForeignName("cupy", "14.2.0", "sm_90", "nvrtc-13.0", f"removed{i}")
        binding = ForeignBinding(name, (ref,), "token:w")
        assert foreign_store.publish(binding)[1]
        bindings.append(binding)
    log = WithdrawalLog(foreign_store.db)
    before = log.last_id()
    barrier = threading.Barrier(len(bindings))

    def remove(binding: ForeignBinding) -> None:
        barrier.wait()
        assert foreign_store.delete(binding.binding_key, f"test: {binding.name.key}")

    threads = [threading.Thread(target=remove, args=(b,)) for b in bindings]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rows = log.after(before)
    assert [r.id for r in rows] == sorted(r.id for r in rows)
    assert {(r.recipe_key, r.digest, r.reason) for r in rows} == {
        (b.binding_key, group_digest(b.files), f"test: {b.name.key}") for b in bindings
    }
    assert not foreign_store.delete(bindings[0].binding_key, "again")
    assert log.last_id() == rows[-1].id  # nothing removed, nothing withdrawn


def test_foreign_bindings_share_the_cap_and_the_lru_order_with_artifacts(
    tmp_path: Any,
) -> None:
    """Eviction frees the least recently used of artifacts and foreign bindings alike; a pin
    (by binding key) keeps a binding; an evicted binding's blobs are collected."""
    from datetime import timedelta

    import sqlalchemy as sa
    from kcache_server import Settings
    from kcache_server.models import artifacts_table, foreign_bindings_table, utcnow

    from tests.support import vector_add

    server = ServerThread(
        Settings(
            data_dir=tmp_path / "data",
            compile_workers=1,
            audit={"flush_s": 0.05},
            max_store_bytes=1 << 20,  # no pass at first: the test runs one when all is in
            eviction_interval_s=3600,
            eviction_blob_grace_s=0,
        )
    )
    try:
        with server.client() as http:
            compiled = http.post("/v1/resolve", json={"recipe": vector_add(unique("evict"))})
            assert compiled.status_code == 200, compiled.text
            artifact = compiled.json()["artifact"]
            keys, names = [], []
            for i in range(5):
                names.append(unique(f"g{i}"))
                answer = _publish(http, "cupy", names[-1], {"payload": os.urandom(2000)})
                keys.append(answer.json()["entry"]["binding_key"])
            pin = http.post("/v1/pins", json={"recipe_keys": [keys[0]], "group": "keep"})
            assert pin.status_code == 200, pin.text
        state = server.state
        db = state.backends.db
        now = utcnow()
        with db.begin() as conn:  # ages: the artifact oldest, then g0 (pinned), g1, ... g4
            conn.execute(
                sa.update(artifacts_table)
                .where(artifacts_table.c.digest == artifact["digest"])
                .values(last_used_at=now - timedelta(hours=10))
            )
            for i, key in enumerate(keys):
                conn.execute(
                    sa.update(foreign_bindings_table)
                    .where(foreign_bindings_table.c.binding_key == key)
                    .values(last_used_at=now - timedelta(hours=5 - i))
                )
        total = artifact["size"] + 5 * 2000
        usage = state.backends.index.usage()  # the store's size counts foreign bindings too
        assert (usage.artifacts, usage.bytes) == (6, total)
        assert (usage.pinned_artifacts, usage.pinned_bytes) == (1, 2000)
        assert usage.oldest_use is not None and usage.oldest_use < now - timedelta(hours=9)
        with server.client() as http:
            info = http.get("/v1/cache").json()
            assert info["bytes_used"] == total and info["artifacts"] == 6
        evictor = server.app.state.evictor
        # Cap the store so that a pass must free the artifact and two bindings' worth.
        target_low = total - artifact["size"] - 2 * 2000 + 1000  # freeing g1 too is not enough
        evictor.marks = type(evictor.marks)(int(target_low / 0.8), 0.9, 0.8)
        report = evictor.run_pass()
        assert report is not None and report.evicted == 3, report
        files = {
            row.binding_key
            for row in db.connect().execute(sa.select(foreign_bindings_table.c.binding_key))
        }
        # g0 is pinned, though older than g1; g1 and g2 were the least recently used after the
        # artifact; g3 and g4 stay.
        assert files == {keys[0], keys[3], keys[4]}
        assert state.backends.index.artifact(artifact["digest"]) is None  # the oldest of all
        with server.client() as http:
            assert http.get(f"/v1/foreign/cupy/{names[1]}", params=NAMESPACE).status_code == 404
            assert http.get(f"/v1/foreign/cupy/{names[0]}", params=NAMESPACE).status_code == 200
        left = sum(
            row.size for row in db.connect().execute(sa.select(foreign_bindings_table.c.size))
        )
        assert left <= evictor.marks.low_bytes
        # The evicted bindings' blobs went (grace 0); the kept ones' stayed.
        assert len(list(state.backends.store.digests())) == len(files)
    finally:
        server.stop()


def test_a_job_token_with_compile_and_publish(
    make_settings: Any, serve: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """``kcache token create job --scope compile --scope publish``: both, and report below them."""
    from kcache_server.auth import Principal

    from kcache.cli import main

    settings = make_settings()
    server = serve(settings)
    argv = ["token", "create", "job", "--data-dir", str(settings.data_dir)]
    assert main([*argv, "--scope", "compile", "--scope", "publish"]) == 0
    token = capsys.readouterr().out.strip()
    assert [t.scopes for t in server.state.tokens.list()] == [("compile", "publish")]
    job = Principal("job", frozenset({"compile", "publish"}))
    assert all(job.allows(s) for s in ("read", "report", "compile", "publish"))
    assert not job.allows("admin")
    alone = Principal("p", frozenset({"publish"}))
    assert alone.allows("report") and not alone.allows("compile")
    assert not Principal("c", frozenset({"compile"})).allows("publish")
    assert Principal("a", frozenset({"admin"})).allows("publish")
    with server.client(token) as http:
        assert _publish(http, "cupy", unique("job"), {"payload": b"job"}).status_code == 200


def test_a_lookup_carries_its_job_and_the_jobs_manifest_names_the_group(foreign: Foreign) -> None:
    """``X-KCache-Context`` is recorded with the lookup's row, as with a fetch; the job's
    manifest (version 2) names the groups it looked up that the server holds, with their
    files; a lookup whose name may have been cut to the audit's columns is not attributed."""
    job = unique("job")
    key, gone, long_key = unique("k") + ".cubin", unique("gone"), unique("long")
    payload = os.urandom(100)
    long_target = "sm_" + "9" * 40  # past the audit's 32 characters of target
    with foreign.client("publish") as http:
        assert _publish(http, "cupy", key, {"payload": payload}).status_code == 200
        refs = [{"name": "payload", "digest": _blob(http, payload), "size": len(payload)}]
        long_namespace = {**NAMESPACE, "target": long_target}
        body = {**long_namespace, "files": refs}
        assert http.put(f"/v1/foreign/cupy/{long_key}", json=body).status_code == 200
    context = {"X-KCache-Context": f"job_id={job}&rank=3&world_size=8&host=n1"}
    with foreign.client("read") as http:
        for name, namespace in ((key, NAMESPACE), (gone, NAMESPACE), (long_key, long_namespace)):
            http.get(f"/v1/foreign/cupy/{name}", params=namespace, headers=context)
        manifest = http.get(f"/v1/jobs/{job}/manifest").json()
        other = http.get(f"/v1/jobs/{unique('nobody')}/manifest").json()
    foreign.server.state.audit.flush()
    import sqlalchemy as sa

    with foreign.server.state.backends.db.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT outcome, job_id, rank, world_size, host FROM audit_events WHERE kernel = :k"
            ),
            {"k": f"foreign:cupy:{key}"},
        ).all()
    assert [tuple(r) for r in rows] == [("hit", job, 3, 8, "n1")]
    assert manifest["version"] == 2 and manifest["kernels"] == []
    (group,) = manifest["foreign"]  # the miss names no group held, the long one may be cut
    assert group["key"] == key and group["binding_key"] == binding_key(
        "cupy", *NAMESPACE.values(), key
    )
    assert group["files"] == [{"name": "payload", "digest": refs[0]["digest"], "size": 100}]
    assert other["version"] == 1 and "foreign" not in other  # a version 1 manifest, as before


def test_a_job_past_the_manifests_bound_in_kernels_and_groups_together_is_refused(
    foreign: Foreign, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One bound covers a manifest's kernels and foreign groups together: a job within it
    in each but past it in both is refused as a job past it in kernels is (422 naming the
    job id and the bound), not answered with a manifest the format cannot hold (a 500)."""
    import kcache_server.job_manifests

    import kcache.job_manifest

    for module in (kcache.job_manifest, kcache_server.job_manifests):
        monkeypatch.setattr(module, "MAX_KERNELS", 2)
    job = unique("job")
    context = {"X-KCache-Context": f"job_id={job}&rank=0"}
    keys = [unique("k") for _ in range(2)]
    with foreign.client("publish") as http:
        for key in keys:
            assert _publish(http, "cupy", key, {"payload": os.urandom(64)}).status_code == 200
    with foreign.client("read") as http:
        for key in keys:
            assert http.get(f"/v1/foreign/cupy/{key}", params=NAMESPACE, headers=context).is_success
        within = http.get(f"/v1/jobs/{job}/manifest")
    assert within.status_code == 200, within.text  # two groups and no kernel: at the bound
    assert len(within.json()["foreign"]) == 2
    with foreign.client("compile") as http:
        body = {"recipe": vector_add(unique()), "context": {"job_id": job, "rank": 0}}
        assert http.post("/v1/resolve", json=body).status_code == 200
    with foreign.client("read") as http:
        past = http.get(f"/v1/jobs/{job}/manifest")
    assert past.status_code == 422, past.text
    assert job in past.text and "2 recipes and foreign groups together" in past.text
