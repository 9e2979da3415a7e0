"""Issue 11, operations: what floods, dead workers, a lost database, a full disk and gc must not break.

One test per row of the issue (7, 8, 11, 12, 13, 14), each against real servers
(uvicorn on an ephemeral port, real NVRTC workers, real SQLite; PostgreSQL where
the row stores something there), asserting the row's "must happen" column, and
after each: ``/healthz`` answers within a liveness bound and a normal lookup is served.

Row 13 needs a full disk: the data directory is put on a small tmpfs (``mount``
works for root here); where mounting is impossible that test is skipped, since
an ``RLIMIT_FSIZE`` (EFBIG, not ENOSPC) would not be the real thing.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from tests.support import (
    KCACHE,
    ServerThread,
    answers_200,
    free_port,
    never_finishes,
    unique,
    upgrade,
    vector_add,
    wait_until,
)

#: Liveness: /healthz must answer within this, whatever else is going on.
LIVENESS_S = 2.0
#: A 104-byte recipe whose cubin is about 134 KB (the initialised array is stored whole).
BIG_OUTPUT = '__device__ char blob[1 << 17] = {{1}};\nextern "C" __global__ void k(char* o) {{ o[0] = blob[threadIdx.x]; }}\n// {tag}\n'
ARTIFACT_LIMIT = 64 << 10
PAST = time.time() - 7200


def _gc(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [KCACHE, "db", "gc", *args],
        capture_output=True,
        text=True,
        check=False,
    )


def _healthy(server: ServerThread, recipe: dict[str, Any], token: str | None = None) -> None:
    """The server is alive (a prompt /healthz) and serves a normal lookup of ``recipe``."""
    with httpx.Client(base_url=server.url, timeout=LIVENESS_S) as quick:
        assert quick.get("/healthz").status_code == 200
    with server.client(token) as client:
        hit = client.post("/v1/resolve", json={"recipe": recipe, "compile": False})
    assert hit.status_code == 200 and hit.json()["status"] == "hit", hit.text


def _settings(data_dir: Path, **overrides: Any) -> Any:
    from kcache_server import Settings

    values: dict[str, Any] = {
        "data_dir": data_dir,
        "compile_workers": 1,
        "audit": {"flush_s": 0.05},
        "auth_cache_s": 0.0,
    }
    return Settings(**{**values, **overrides})


@dataclass
class Ops:
    """The module's shared server, its two compile tokens and a recipe it has compiled."""

    server: ServerThread
    flooder: str
    neighbour: str
    baseline: dict[str, Any]


@pytest.fixture(scope="module")
def ops(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ops]:
    settings = _settings(
        tmp_path_factory.mktemp("ops") / "data",
        compile_workers=2,
        compile_caller_limit=1,  # one caller gets one worker, the other is kept for others
        # Row 7's neighbour (a real compile, well under a second when quiet) must finish
        # before the flood's first never-finishing compile times out: room for a loaded machine.
        compile_timeout_s=6.0,
        failure_ttl_s=600.0,
        max_artifact_bytes=ARTIFACT_LIMIT,
        request_threads=8,
        caller_threads=4,
    )
    server = ServerThread(settings)
    try:
        flooder = server.state.tokens.create("flooder", ["compile"])
        neighbour = server.state.tokens.create("neighbour", ["compile"])
        baseline = vector_add(unique("baseline"))
        with server.client(neighbour) as client:
            assert (
                client.post("/v1/resolve", json={"recipe": baseline}).json()["status"] == "compiled"
            )
        yield Ops(server, flooder, neighbour, baseline)
    finally:
        server.stop()


# --------------------------------------------------------------------------- row 7
def test_row7_a_caller_flooding_timeouts_cannot_starve_another(ops: Ops) -> None:
    server, pool = ops.server, ops.server.state.backends.compiler
    restarts = pool.restarts
    x, y = never_finishes(unique("x")), never_finishes(unique("y"))
    finished: dict[str, tuple[float, httpx.Response]] = {}

    def send(name: str, token: str, recipe: dict[str, Any]) -> None:
        with server.client(token) as client:
            response = client.post("/v1/resolve", json={"recipe": recipe})
        finished[name] = (time.monotonic(), response)

    # Ten requests of two never-finishing recipes: more than the flooder's share of
    # request threads (caller_threads=4 of 8) and of workers (one of two).
    with ThreadPoolExecutor(11) as executor:
        for i, recipe in enumerate([x, y] * 5):
            executor.submit(send, f"flood{i}", ops.flooder, recipe)
        wait_until(lambda: pool.pending >= 1, "the flood's first compile")
        executor.submit(send, "neighbour", ops.neighbour, vector_add(unique("neighbour")))
    neighbour_at, neighbour = finished.pop("neighbour")
    assert neighbour.status_code == 200 and neighbour.json()["status"] == "compiled", neighbour.text
    # Served while the flood's compiles were still running, not after them.
    assert neighbour_at < min(at for at, _ in finished.values())
    bodies = [response.json() for _, response in finished.values()]
    assert all(r.status_code == 422 for _, r in finished.values())
    assert {b["error"] for b in bodies} == {"compile_timeout"}
    # Each recipe held a worker once; its repeats were answered from the negative entry.
    assert sum(not b["cached"] for b in bodies) == 2 and pool.restarts == restarts + 2
    with server.client(ops.flooder) as client:
        again = client.post("/v1/resolve", json={"recipe": x})
    assert again.status_code == 422 and again.json()["error"] == "compile_timeout"
    assert again.json()["cached"] is True and "failure_ttl_s" in again.json()["log"]
    # The remembered answer names the cause and its setting, not the note about itself
    # (it read "compile failed: (this recipe is answered with this error ...").
    detail = again.json()["detail"]
    assert detail.startswith("compile timed out: the compile ran past"), detail
    assert "KCACHE_COMPILE_TIMEOUT_S" in detail and "KCACHE_FAILURE_TTL_S" in again.json()["log"]
    assert pool.restarts == restarts + 2  # answered at once: no worker ran (or was killed for) it
    _healthy(server, ops.baseline, ops.neighbour)


# --------------------------------------------------------------------------- row 8
def test_row8_an_oversized_artifact_is_refused_and_nothing_is_stored(ops: Ops) -> None:
    server = ops.server
    store, db = server.state.backends.store, server.state.backends.db
    blobs_before = set(store.digests())
    recipe = {"source": BIG_OUTPUT.format(tag=unique()), "target": "sm_80"}
    assert len(recipe["source"]) < 200
    with server.client(ops.neighbour) as client:
        refused = client.post("/v1/resolve", json={"recipe": recipe})
        again = client.post("/v1/resolve", json={"recipe": recipe})
    body = refused.json()
    assert refused.status_code == 422 and body["error"] == "artifact_too_large", refused.text
    assert f"the limit is {ARTIFACT_LIMIT} bytes (max_artifact_bytes)" in body["detail"]
    assert set(store.digests()) == blobs_before  # no blob
    with db.connect() as conn:
        assert (
            conn.execute(
                sa.text("SELECT count(*) FROM artifacts WHERE size > :n"), {"n": ARTIFACT_LIMIT}
            ).scalar()
            == 0
        )
    assert (
        again.status_code == 422
        and again.json()["error"] == "artifact_too_large"
        and again.json()["cached"]
    )
    _healthy(server, ops.baseline, ops.neighbour)


# --------------------------------------------------------------------------- row 11
def test_row11_dead_idle_workers_are_replaced_and_no_wait_is_unbounded(
    ops: Ops, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kcache_server.compile_pool")
    server, pool = ops.server, ops.server.state.backends.compiler
    wait_until(lambda: pool.idle == 2, "two idle workers")
    for pid in pool.pids:
        os.kill(pid, signal.SIGKILL)  # what the OOM killer does to an idle worker
    with server.client(ops.neighbour) as client:
        after = client.post("/v1/resolve", json={"recipe": vector_add(unique())})
    assert after.status_code == 200 and after.json()["status"] == "compiled", after.text
    wait_until(lambda: pool.idle == 2, "both workers replaced")
    deaths = [r.getMessage() for r in caplog.records if "died while idle" in r.getMessage()]
    assert len(deaths) == 2
    assert any("started as a replacement" in r.getMessage() for r in caplog.records)
    stopped = pool.pids[0]
    os.kill(stopped, signal.SIGTERM)  # one worker stopped alone, not the server's group
    wait_until(lambda: pool.idle == 2 and stopped not in pool.pids, "the stopped one replaced")

    # Every worker dead and none can start: answered with 503 + Retry-After, not a hang
    # (the client's timeout would fail this test first).
    scratch_parent = pool.tmp_dir
    not_a_directory = tmp_path / "file"
    not_a_directory.write_bytes(b"")
    pool.tmp_dir = not_a_directory
    try:
        for pid in pool.pids:
            os.kill(pid, signal.SIGKILL)
        headers = {"Authorization": f"Bearer {ops.neighbour}"}
        with httpx.Client(base_url=server.url, headers=headers, timeout=30) as client:
            unavailable = client.post("/v1/resolve", json={"recipe": vector_add(unique())})
        assert unavailable.status_code == 503, unavailable.text
        assert (
            unavailable.json()["error"] == "compiler_unavailable"
            and unavailable.headers["Retry-After"]
        )
        with server.client(ops.neighbour) as client:
            ready = client.get("/readyz")
        assert ready.status_code == 503 and ready.json()["checks"]["compile_workers"].startswith(
            "failed"
        )
        _healthy(server, ops.baseline, ops.neighbour)
    finally:
        pool.tmp_dir = scratch_parent
    assert any("could not start" in r.getMessage() for r in caplog.records)
    wait_until(lambda: pool.idle == 2, "the background restarts to succeed")
    with server.client(ops.neighbour) as client:
        recovered = client.post("/v1/resolve", json={"recipe": vector_add(unique())})
    assert recovered.status_code == 200 and recovered.json()["status"] == "compiled"
    _healthy(server, ops.baseline, ops.neighbour)


def test_a_failed_user_compile_logs_its_worker_replacement_at_info(
    ops: Ops, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker retires after a failed compile (its NVRTC state is not trusted again):
    routine, so neither the retirement nor its replacement is a WARNING (one WARNING per
    failed user compile said "started as a replacement" with the reason at INFO)."""
    caplog.set_level(logging.INFO, logger="kcache_server.compile_pool")
    server, pool = ops.server, ops.server.state.backends.compiler
    wait_until(lambda: pool.idle == 2, "two idle workers")
    restarts = pool.restarts
    broken = {**vector_add(unique("broken")), "source": "__global__ void k() { oops; }"}
    with server.client(ops.neighbour) as client:
        failed = client.post("/v1/resolve", json={"recipe": broken})
    assert failed.status_code == 422 and failed.json()["error"] == "compile_error", failed.text
    wait_until(lambda: pool.restarts == restarts + 1 and pool.idle == 2, "the replacement")
    records = [r for r in caplog.records if r.name == "kcache_server.compile_pool"]
    assert any("retires" in r.getMessage() for r in records)
    assert any("started as a replacement" in r.getMessage() for r in records)
    assert [r.getMessage() for r in records if r.levelno >= logging.WARNING] == []


# --------------------------------------------------------------------------- row 14
def test_row14_gc_never_deletes_a_blob_a_row_names(ops: Ops, tmp_path: Path) -> None:
    from kcache.maintenance import collect_garbage

    server = ops.server
    store, index, db = (
        server.state.backends.store,
        server.state.backends.index,
        server.state.backends.db,
    )
    data_dir = str(server.settings.data_dir)
    # Two recipes that differ only in a header the kernel never includes: same bytes.
    source = vector_add(unique())
    first = {**source, "headers": {"unused.h": "1"}}
    second = {**source, "headers": {"unused.h": "2"}}
    with server.client(ops.neighbour) as client:
        digest = client.post("/v1/resolve", json={"recipe": first}).json()["artifact"]["digest"]
        with db.begin() as conn:  # its row goes (eviction, say): the blob is an old orphan now
            conn.execute(sa.text("DELETE FROM artifacts WHERE digest = :d"), {"d": digest})
        os.utime(store.path(digest), (PAST, PAST))
        snapshot = index.digests()  # what a collector saw before the next compile committed
        assert digest not in snapshot
        again = client.post("/v1/resolve", json={"recipe": second}).json()
    assert again["status"] == "compiled" and again["artifact"]["digest"] == digest
    assert store.path(digest).stat().st_mtime > PAST + 3600  # the reuse refreshed it
    orphan = store.put(b"an orphan no row names " + unique().encode())
    os.utime(store.path(orphan), (PAST, PAST))
    report = collect_garbage(store, snapshot, grace_seconds=3600, still_referenced=index.names)
    assert store.has(digest) and not store.has(orphan) and report.blobs >= 1
    # Even with its mtime old again, the re-check of the index keeps it.
    os.utime(store.path(digest), (PAST, PAST))
    collect_garbage(store, snapshot, grace_seconds=3600, still_referenced=index.names)
    assert store.has(digest)

    refused = _gc("--data-dir", data_dir, "--grace", "0")
    assert refused.returncode == 2 and "--force" in refused.stderr
    # A database that names none of the store's blobs (another --db-url) collects nothing.
    other = f"sqlite:///{tmp_path / 'other.db'}"
    upgrade(other)
    for blob in store.digests():
        os.utime(store.path(blob), (PAST, PAST))
    wrong = _gc("--data-dir", data_dir, "--db-url", other)
    assert wrong.returncode == 2 and "names none of the" in wrong.stderr
    assert all(store.has(blob) for blob in snapshot | {digest})
    forced = _gc("--data-dir", data_dir, "--grace", "0", "--force")
    assert forced.returncode == 0, forced.stderr
    with server.client(ops.neighbour) as client:
        fetched = client.get(f"/v1/recipes/{again['recipe_key']}/artifact")
    assert fetched.status_code == 200 and len(fetched.content) == again["artifact"]["size"]
    _healthy(server, ops.baseline, ops.neighbour)


# --------------------------------------------------------------------------- row 12
def _delete_database(data_dir: Path) -> None:
    for suffix in ("", "-wal", "-shm"):
        (data_dir / f"kcache.db{suffix}").unlink(missing_ok=True)


def test_row12_a_deleted_database_is_noticed_and_never_silently_recreated(tmp_path: Path) -> None:
    from kcache_server import create_app
    from kcache_server.errors import IndexMissingError
    from kcache_server.index import SqlIndex

    data_dir = tmp_path / "data"
    recipe = {
        "source": f"// {unique()}\ntemplate <typename T> __global__ void scale(T* x, T a) {{ x[threadIdx.x] *= a; }}\n",
        "target": "sm_80",
        "name_expressions": ["scale<float>"],
    }
    server = ServerThread(_settings(data_dir))
    try:
        with server.client() as client:
            compiled = client.post("/v1/resolve", json={"recipe": recipe}).json()
            digest = compiled["artifact"]["digest"]
            _delete_database(data_dir)
            ready = client.get("/readyz")
        assert ready.status_code == 503 and "deleted" in ready.json()["checks"]["database"]
        assert "--recreate-index" in ready.json()["checks"]["database"]
        _healthy(server, recipe)  # still serving from the open (deleted) file until restarted
    finally:
        server.stop()

    with pytest.raises(IndexMissingError, match="--recreate-index"):
        create_app(_settings(data_dir))
    assert not (data_dir / "kcache.db").exists()  # refused without creating an empty one
    refused = _gc("--data-dir", str(data_dir), "--force")
    assert refused.returncode == 2 and "no database" in refused.stderr
    assert (data_dir / "blobs" / digest[:2] / digest[2:4] / digest).is_file()
    assert not (data_dir / "kcache.db").exists()

    server = ServerThread(_settings(data_dir, recreate_index=True))
    try:
        with server.client() as client:
            assert client.get("/readyz").status_code == 200
            assert client.get(f"/v1/blobs/{digest}").status_code == 200
            # The alias cannot be rebuilt from a blob: the recipe is unknown until compiled again.
            assert (
                client.post("/v1/resolve", json={"recipe": recipe, "compile": False}).status_code
                == 404
            )
            store = server.state.backends.store
            for blob in store.digests():
                os.utime(store.path(blob), (PAST, PAST))
            collected = _gc("--data-dir", str(data_dir))
            assert collected.returncode == 0 and json.loads(collected.stdout)["blobs"] == 0, (
                collected.stderr
            )
            again = client.post("/v1/resolve", json={"recipe": recipe}).json()
        assert again["status"] == "compiled" and again["artifact"]["digest"] == digest
        # The recovered row took the new compile's metadata (lowered names, kernel).
        row = SqlIndex(server.state.backends.db).artifact(digest)
        assert row is not None and row.lowered_names == compiled["artifact"]["lowered_names"] != {}
        with server.state.backends.db.connect() as conn:
            assert conn.execute(
                sa.text("SELECT recovered FROM artifacts WHERE digest = :d"), {"d": digest}
            ).scalar() in (0, False)
        _healthy(server, recipe)
    finally:
        server.stop()


def _cubin(tag: str) -> bytes:
    from kcache.include_sets import IncludeSets
    from kcache.nvrtc import compile_recipe
    from kcache.recipe import Recipe
    from kcache.toolchain import load_toolchain

    toolchain = load_toolchain()
    recipe = Recipe(source=vector_add(tag)["source"], target="sm_80", toolchain=toolchain.id)
    return compile_recipe(recipe, toolchain, IncludeSets()).data


@pytest.mark.postgres
def test_row12_a_new_postgres_database_under_a_store_is_refused_then_recreated(
    tmp_path: Path, pg_url: str
) -> None:
    from kcache_server import create_app
    from kcache_server.errors import IndexMissingError
    from kcache_server.index import SqlIndex

    from kcache.artifact import ArtifactMeta
    from kcache.store.local import LocalArtifactStore

    data_dir = tmp_path / "data"
    digest = LocalArtifactStore(data_dir).put(_cubin(unique()))
    with pytest.raises(IndexMissingError, match="--recreate-index"):
        create_app(_settings(data_dir, db_url=pg_url))
    app = create_app(_settings(data_dir, db_url=pg_url, recreate_index=True))
    db = app.state.kcache.backends.db
    try:
        index = SqlIndex(db)
        row = index.artifact(digest)
        assert row is not None and (row.kind, row.target, row.lowered_names) == (
            "cubin",
            "sm_80",
            {},
        )
        full = ArtifactMeta(digest, row.size, "cubin", "sm_80", "tc", {"add": "add"}, kernel="add")
        index.record_artifact("ab" * 32, "cd" * 32, full)
        replaced = index.lookup("ab" * 32)
        assert isinstance(replaced, ArtifactMeta) and replaced.lowered_names == {"add": "add"}
    finally:
        db.dispose()


# --------------------------------------------------------------------------- rows 7 and 8, in the index
@pytest.mark.parametrize(
    "database", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def test_negative_entries_of_timeouts_and_oversized_output_expire(
    database: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    from kcache_server.db import open_database
    from kcache_server.index import SqlIndex

    from kcache.artifact import CompileFailure
    from kcache.engine import failure_error
    from kcache.errors import ArtifactTooLargeError, CompileError, CompileTimeoutError

    url = (
        request.getfixturevalue("pg_url")
        if database == "postgres"
        else f"sqlite:///{tmp_path / 'k.db'}"
    )
    upgrade(url)
    engine = open_database(url)
    try:
        index = SqlIndex(engine)
        now = time.time()
        timeout, large, broken = "a1" * 32, "b2" * 32, "c3" * 32
        index.record_failure(CompileFailure(timeout, "ran past 3s", now, "timeout", now + 60))
        index.record_failure(CompileFailure(large, "134688 bytes", now, "too_large", now - 1))
        index.record_failure(CompileFailure(broken, "error: x", now))
        found = index.lookup(timeout)
        assert isinstance(found, CompileFailure) and found.kind == "timeout"
        assert found.expires_at is not None and abs(found.expires_at - (now + 60)) < 1
        assert isinstance(failure_error(found), CompileTimeoutError) and failure_error(found).cached
        assert index.lookup(large) is None  # expired: compiled again on the next request
        kept = index.lookup(broken)
        assert isinstance(kept, CompileFailure) and kept.expires_at is None
        assert type(failure_error(kept)) is CompileError
        index.record_failure(CompileFailure(large, "134688 bytes", now, "too_large", now + 60))
        again = index.lookup(large)
        assert isinstance(again, CompileFailure) and isinstance(
            failure_error(again), ArtifactTooLargeError
        )
    finally:
        engine.dispose()


# --------------------------------------------------------------------------- row 13
@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 48 MiB tmpfs (root only); skipped where mounting is not allowed."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount command: a full disk needs a small filesystem of its own")
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
        check=False,
    )
    if made.returncode != 0:
        pytest.skip(
            f"cannot mount a tmpfs here ({made.stderr.strip()}): a full disk needs a small filesystem"
        )
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True, check=False)


def _fill(path: Path, leave: int = 0) -> None:
    """Write ``path`` until its filesystem has about ``leave`` bytes free (0: until ENOSPC)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        while True:
            size = 1 << 20
            if leave:
                size = min(size, shutil.disk_usage(path.parent).free - leave)
                if size <= 0:
                    return
            try:
                os.write(fd, b"\0" * size)  # a short write first, ENOSPC only when nothing fits
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                return
    finally:
        os.close(fd)


def test_row13_a_full_disk_is_507_store_full_everywhere(small_disk: Path) -> None:
    data_dir = small_disk / "data"
    server = ServerThread(_settings(data_dir, min_free_bytes=8 << 20))
    pool = server.state.backends.compiler
    filler = small_disk / "filler"
    try:
        baseline = vector_add(unique())
        source = vector_add(unique())
        with server.client() as client:
            assert (
                client.post("/v1/resolve", json={"recipe": baseline}).json()["status"] == "compiled"
            )
            unused = {
                **source,
                "headers": {"unused.h": "1"},
            }  # leaves a manifest entry to match later
            assert (
                client.post("/v1/resolve", json={"recipe": unused}).json()["status"] == "compiled"
            )

            _fill(filler, leave=4 << 20)  # below min_free_bytes, not yet full
            ready = client.get("/readyz")
            assert (
                ready.status_code == 503
                and "KCACHE_MIN_FREE_BYTES" in ready.json()["checks"]["disk"]
            )
            precheck = client.post("/v1/resolve", json={"recipe": vector_add(unique())})
            assert precheck.status_code == 507 and precheck.json()["error"] == "store_full", (
                precheck.text
            )
            assert "KCACHE_MIN_FREE_BYTES" in precheck.json()["detail"]
            _healthy(server, baseline)

            _fill(filler)  # now truly full
            pool.min_free_bytes = 0  # past the check: a compile that runs out of disk midway
            midway = client.post("/v1/resolve", json={"recipe": vector_add(unique())})
            assert midway.status_code == 507 and midway.json()["error"] == "store_full", midway.text
            # A manifest match records an alias: a SQLite write on a full disk.
            alias = client.post(
                "/v1/resolve",
                json={"recipe": {**source, "headers": {"unused.h": "2"}}, "compile": False},
            )
            assert alias.status_code == 507 and alias.json()["error"] == "store_full", alias.text
            assert (
                "the database has no space left" in alias.json()["detail"]
                and "sqlite" not in alias.text.lower()
            )
            stats = client.get("/v1/stats")
            assert stats.status_code in (200, 507), stats.text
            _healthy(server, baseline)

            filler.unlink()
            pool.min_free_bytes = 8 << 20
            wait_until(
                lambda: client.get("/readyz").status_code == 200, "ready again once space is free"
            )
            assert (
                client.post("/v1/resolve", json={"recipe": vector_add(unique())}).json()["status"]
                == "compiled"
            )
            matched = client.post(
                "/v1/resolve",
                json={"recipe": {**source, "headers": {"unused.h": "2"}}, "compile": False},
            )
            assert matched.status_code == 200 and matched.json()["status"] == "hit"
            _healthy(server, baseline)
    finally:
        filler.unlink(missing_ok=True)
        server.stop()


def test_a_stop_sent_to_the_servers_process_group_logs_no_worker_death(tmp_path: Path) -> None:
    """systemd's stop (and ``timeout``, a terminal's Ctrl-C) signals the whole process group:
    the compile workers die of it before the server's shutdown closes the pool, and every
    stop logged "compile worker pid N died while idle (exit code -15); starting a
    replacement" for each of them, starting replacements on the way out."""
    port = free_port()
    env = {**os.environ, "KCACHE_DATA_DIR": str(tmp_path / "data"), "KCACHE_COMPILE_WORKERS": "2"}
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [KCACHE, "serve", "--port", str(port)],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own group, as a service's
        )
    try:
        wait_until(lambda: answers_200(f"http://127.0.0.1:{port}/readyz"), "the server ready")
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=120) in (0, -signal.SIGTERM)  # uvicorn re-raises it
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    said = log.read_text()
    assert "died while idle" not in said and "replacement" not in said, said
