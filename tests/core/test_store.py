"""The ArtifactStore contract, on every backend; then what only the local directory does.

Backends: ``LocalArtifactStore`` (a directory), ``S3ArtifactStore`` (a bucket on a real
S3 HTTP server on loopback, :mod:`tests.s3_server`) and ``CachedArtifactStore`` (a
bounded local directory in front of that bucket, as each server replica keeps); and
a backend the tests add, ``MemoryArtifactStore`` (:mod:`tests.memory_store`), bare
and behind a ``CachedArtifactStore``: what a new backend must do is what this file
asks of it, nothing more.
"""

from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from kcache.errors import ArtifactNotFoundError, CorruptArtifactError, StoreUnavailableError
from kcache.store import (
    STORE_URL_SCHEMES,
    ArtifactStore,
    CachedArtifactStore,
    LocalArtifactStore,
    S3ArtifactStore,
    check_store_url,
    open_store_url,
)
from kcache.store.local import SET_ASIDE_PREFIX
from tests.memory_store import MEMORY_BACKEND, MemoryArtifactStore
from tests.s3_server import CREDENTIALS, S3Server, s3_server

BACKENDS = ["local", "s3", "cached", "memory", "cached-memory"]


def _s3(server: S3Server, bucket: str, prefix: str = "kc", **kwargs: object) -> S3ArtifactStore:
    return S3ArtifactStore.from_url(
        f"s3://{bucket}/{prefix}",
        endpoint_url=server.endpoint,
        access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
        secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        **kwargs,  # type: ignore[arg-type]
    )


@pytest.fixture(scope="module")
def bucket() -> tuple[S3Server, str]:
    """One bucket for this module on the session's S3 server (each test takes its own prefix)."""
    server = s3_server()
    return server, server.new_bucket()


def _raw_s3(store: S3ArtifactStore) -> object:
    return store._store  # the obstore client: the tests write behind the store's back


def _overwrite_remote(store: S3ArtifactStore, digest: str, data: bytes) -> None:
    import obstore

    obstore.put(_raw_s3(store), store.key(digest), data)  # type: ignore[arg-type]


@pytest.fixture(params=BACKENDS)
def store(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[tuple[ArtifactStore, Callable[[str, bytes], None]]]:
    """Each backend, with a function that replaces a stored blob's bytes behind its back."""
    if request.param == "local":
        local = LocalArtifactStore(tmp_path)
        yield local, lambda digest, data: local.path(digest).write_bytes(data)
        return
    if request.param in ("memory", "cached-memory"):
        memory = MemoryArtifactStore(f"t-{os.urandom(6).hex()}")

        def plant(digest: str, data: bytes) -> None:
            memory.objects[digest] = (data, time.time())

        if request.param == "memory":
            yield memory, plant
            return
        in_front = CachedArtifactStore(tmp_path, memory, max_bytes=1 << 30)

        def corrupt_behind(digest: str, data: bytes) -> None:
            plant(digest, data)
            in_front.path_local(digest).unlink(missing_ok=True)

        yield in_front, corrupt_behind
        return
    server, name = request.getfixturevalue("bucket")
    remote = _s3(server, name, prefix=f"t-{os.urandom(6).hex()}")
    if request.param == "s3":
        yield remote, lambda digest, data: _overwrite_remote(remote, digest, data)
        return
    cached = CachedArtifactStore(tmp_path, remote, max_bytes=1 << 30)

    def corrupt(digest: str, data: bytes) -> None:
        _overwrite_remote(remote, digest, data)
        cached.path_local(digest).unlink(missing_ok=True)

    yield cached, corrupt


# ---------------------------------------------------------------------- the contract
def test_contract_put_get_has_list_delete(
    store: tuple[ArtifactStore, Callable[[str, bytes], None]],
) -> None:
    backend, _ = store
    data = b"\x7fELF" + os.urandom(1000)
    digest = backend.put(data)
    assert digest == hashlib.sha256(data).hexdigest()
    assert backend.put(data) == digest  # idempotent
    assert backend.has(digest) and backend.get(digest) == data
    other = backend.put(b"second blob")
    assert sorted(backend.digests()) == sorted([digest, other])
    assert backend.delete(digest) is True
    assert not backend.has(digest) and backend.delete(digest) is False
    with pytest.raises(ArtifactNotFoundError):
        backend.get(digest)
    assert list(backend.digests()) == [other]


def test_contract_bad_names_are_refused_before_any_io(
    store: tuple[ArtifactStore, Callable[[str, bytes], None]],
) -> None:
    backend, _ = store
    for bad in ("../../etc/passwd", "A" * 64, "0" * 63, "0" * 64 + "\n", ""):
        for call in (backend.get, backend.has, backend.delete):
            with pytest.raises(ValueError, match="digest must be 64 lowercase hex digits"):
                call(bad)


def test_contract_corruption_is_caught_quarantined_and_healed_by_a_put(
    store: tuple[ArtifactStore, Callable[[str, bytes], None]],
) -> None:
    backend, corrupt = store
    data = os.urandom(4096)
    digest = backend.put(data)
    corrupt(digest, data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(CorruptArtifactError) as info:
        backend.get(digest)
    assert info.value.digest == digest and info.value.quarantined_to
    assert not backend.has(digest)  # moved out of blobs/, so the next put republishes it
    assert backend.put(data) == digest and backend.get(digest) == data


def test_contract_a_stored_name_is_never_rewritten(
    store: tuple[ArtifactStore, Callable[[str, bytes], None]],
) -> None:
    """put() of bytes already stored sends nothing: the S3 PUT is conditional (If-None-Match)."""
    backend, corrupt = store
    if isinstance(backend, LocalArtifactStore) and not isinstance(backend, CachedArtifactStore):
        pytest.skip("the local store compares sizes instead (test_put_get_and_idempotence)")
    data = os.urandom(512)
    digest = backend.put(data)
    corrupt(digest, b"x" * 100)  # a different object under the same name
    backend.put(data)  # must not upload again: the object stays the one planted
    bucket = backend.remote if isinstance(backend, CachedArtifactStore) else backend
    with pytest.raises(CorruptArtifactError):
        bucket.get(digest)


def test_contract_concurrent_identical_puts_agree(
    store: tuple[ArtifactStore, Callable[[str, bytes], None]],
) -> None:
    backend, _ = store
    data = os.urandom(64 << 10)
    results: list[str] = []
    threads = [threading.Thread(target=lambda: results.append(backend.put(data))) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert set(results) == {hashlib.sha256(data).hexdigest()} and len(results) == 8
    assert list(backend.digests()) == results[:1] and backend.get(results[0]) == data


def _collect_all(backend: ArtifactStore, digests: list[str], named: set[str]) -> dict[str, int]:
    """``collect_many`` with a cutoff in the future (every blob old enough); the bytes freed."""
    asked: list[list[str]] = []

    def still_named(batch: Sequence[str]) -> set[str]:
        asked.append(list(batch))
        return named & set(batch)

    done = backend.collect_many(digests, time.time() + 60, still_named)
    assert done.young == {}
    assert len(asked) == 1  # one question to the index for the whole batch ...
    assert set(done.freed) <= set(asked[0])  # ... about every blob it deleted
    return done.freed


def test_contract_collect_many_deletes_the_unnamed_and_keeps_the_named(
    store: tuple[ArtifactStore, Callable[[str, bytes], None]],
) -> None:
    backend, _ = store
    blobs = {backend.put(os.urandom(n)): n for n in (100, 2000, 30_000)}
    kept, *gone = list(blobs)
    never = hashlib.sha256(b"never stored").hexdigest()
    dry = backend.collect_many([*blobs, never], time.time() + 60, lambda b: {kept}, dry_run=True)
    assert dry.freed == {d: blobs[d] for d in gone} and all(backend.has(d) for d in blobs)
    freed = _collect_all(backend, [*blobs, never], {kept})
    assert freed == {d: blobs[d] for d in gone}  # the absent one is neither freed nor young
    assert backend.has(kept) and backend.get(kept)
    assert not any(backend.has(d) for d in gone)
    assert sorted(backend.digests()) == [kept]


def test_contract_a_blob_stored_since_the_cutoff_is_young_not_collected(
    store: tuple[ArtifactStore, Callable[[str, bytes], None]],
) -> None:
    """A compile publishes its blob before it commits the row: a fresh unnamed blob stays."""
    backend, _ = store
    digest = backend.put(os.urandom(500))
    before = time.time()
    done = backend.collect_many([digest], before - 3600, lambda b: set())
    assert done.freed == {} and backend.has(digest)
    assert set(done.young) == {digest} and abs(done.young[digest] - before) < 60
    # Asked again once the grace is over, it goes (a bucket counts it from the first ask).
    assert _collect_all(backend, [digest], set()) == {digest: 500}
    assert not backend.has(digest)


def test_contract_blob_info_leftovers_probe_and_local_files(
    store: tuple[ArtifactStore, Callable[[str, bytes], None]],
) -> None:
    backend, _ = store
    digest = backend.put(b"x" * 321)
    info = backend.blob_info(digest)
    assert info is not None and info.size == 321 and abs(info.written_at - time.time()) < 60
    assert backend.blob_info(hashlib.sha256(b"absent").hexdigest()) is None
    assert backend.sweep_leftovers(time.time() - 3600).restored == 0
    backend.probe()  # reachable: no error
    local = backend.local_file(digest)
    if local is None:  # no files on this machine: nothing to serve by path either
        assert backend.remote is None
        with pytest.raises(TypeError):
            backend.path(digest)
    else:
        assert os.path.isfile(local) and local == os.fspath(backend.path(digest))
    if backend.remote is not None:  # local copies in front of the truth
        assert backend.remote.has(digest)


def test_store_urls_open_the_backend_their_scheme_names(monkeypatch: pytest.MonkeyPatch) -> None:
    """One line in STORE_URL_SCHEMES is all a backend needs to be named by a store URL."""
    with pytest.raises(ValueError, match="is not one kcache opens"):
        check_store_url("mem://box")
    monkeypatch.setitem(STORE_URL_SCHEMES, "mem", MEMORY_BACKEND)
    check_store_url("mem://box")
    with pytest.raises(ValueError, match="is not mem://NAME"):
        check_store_url("mem://Not Valid")
    opened = open_store_url("mem://box", timeout_s=1, connect_timeout_s=1, retries=0)
    assert isinstance(opened, MemoryArtifactStore) and opened.url == "mem://box"
    with pytest.raises(ValueError, match="store URL"):
        check_store_url("s3://B/p")  # the bucket's own check still speaks


# ---------------------------------------------------------------------- the bucket
def test_unreachable_bucket_is_store_unavailable_naming_the_url_not_the_endpoint(
    bucket: tuple[S3Server, str],
) -> None:
    _, name = bucket
    dead = S3ArtifactStore.from_url(
        f"s3://{name}/kc", endpoint_url="http://127.0.0.1:9", timeout_s=2.0
    )
    for call in (lambda: dead.get("0" * 64), lambda: dead.put(b"x"), lambda: dead.has("0" * 64)):
        with pytest.raises(StoreUnavailableError) as info:
            call()
        assert info.value.url == f"s3://{name}/kc" and "127.0.0.1:9" not in str(info.value)
        assert info.value.__cause__ is not None  # translated at the boundary, with `from`


@pytest.mark.parametrize(
    "url",
    ["s3:/b/p", "http://bucket", "s3://B/p", "s3://ab", "s3://bucket/../x", "s3://bucket/a b"],
)
def test_bad_store_urls_are_refused_saying_why(url: str) -> None:
    with pytest.raises(ValueError, match="store URL"):
        S3ArtifactStore.from_url(url, endpoint_url="http://127.0.0.1:9")


# ---------------------------------------------------------------------- the replica's cache
def test_cold_replica_fills_from_the_bucket_and_a_warm_one_needs_no_bucket(
    bucket: tuple[S3Server, str], tmp_path: Path
) -> None:
    server, name = bucket
    prefix = f"r-{os.urandom(6).hex()}"
    replica_a = CachedArtifactStore(tmp_path / "a", _s3(server, name, prefix), max_bytes=1 << 30)
    replica_b = CachedArtifactStore(tmp_path / "b", _s3(server, name, prefix), max_bytes=1 << 30)
    data = os.urandom(10_000)
    digest = replica_a.put(data)
    assert not replica_b.path_local(digest).exists()
    assert replica_b.has(digest)  # from the bucket
    assert replica_b.path(digest).read_bytes() == data  # path() fills the local copy
    # B again, its bucket now unreachable: the local copy serves, verified.
    dead = S3ArtifactStore.from_url(
        f"s3://{name}/{prefix}", endpoint_url="http://127.0.0.1:9", timeout_s=2.0
    )
    offline_b = CachedArtifactStore(tmp_path / "b", dead, max_bytes=1 << 30)
    assert offline_b.get(digest) == data and offline_b.has(digest)
    with pytest.raises(StoreUnavailableError):
        offline_b.get(hashlib.sha256(b"never stored").hexdigest())
    # A corrupt local copy is quarantined and fetched again from the bucket.
    replica_b.path_local(digest).write_bytes(b"rotten")
    assert replica_b.get(digest) == data and replica_b.path_local(digest).read_bytes() == data


def test_the_local_copies_stay_within_the_cap_least_recently_used_first(
    bucket: tuple[S3Server, str], tmp_path: Path
) -> None:
    server, name = bucket
    remote = _s3(server, name, f"cap-{os.urandom(6).hex()}")
    replica = CachedArtifactStore(tmp_path, remote, max_bytes=100_000)  # room for ~9 blobs
    blobs = [os.urandom(10_000) for _ in range(30)]
    digests: list[str] = []
    for i, data in enumerate(blobs):
        digests.append(replica.put(data))
        past = time.time() - 1000 + i  # distinct recency stamps, oldest first
        os.utime(replica.path_local(digests[-1]), (past, past))
        if i >= 1:
            replica.get(digests[0])  # the first blob stays hot
    local = [d for d in digests if replica.path_local(d).exists()]
    on_disk = sum(replica.path_local(d).stat().st_size for d in local)
    assert on_disk <= replica.marks.high_bytes and replica.local_bytes == on_disk
    assert digests[0] in local and digests[1] not in local
    assert digests[-1] in local  # the newest is kept
    for digest, data in zip(
        digests, blobs, strict=True
    ):  # nothing is lost: the bucket holds everything
        assert replica.get(digest) == data


def test_put_get_and_idempotence(tmp_path: Path) -> None:
    store = LocalArtifactStore(tmp_path)
    data = b"\x7fELF" + os.urandom(1000)
    digest = store.put(data)
    assert digest == hashlib.sha256(data).hexdigest()
    assert store.path(digest) == tmp_path / "blobs" / digest[:2] / digest[2:4] / digest
    inode = store.path(digest).stat().st_ino
    past = time.time() - 7200
    os.utime(store.path(digest), (past, past))
    assert store.put(data) == digest
    after = store.path(digest).stat()
    assert after.st_ino == inode  # not rewritten
    # but touched: garbage collection's grace period must cover a reused old orphan
    assert after.st_mtime > past + 3600
    assert store.get(digest) == data
    assert list(store.digests()) == [digest]


def test_unknown_digest_and_bad_names(tmp_path: Path) -> None:
    store = LocalArtifactStore(tmp_path)
    with pytest.raises(ArtifactNotFoundError):
        store.get("0" * 64)
    with pytest.raises(ValueError, match="digest must be 64 lowercase hex digits"):
        store.path("../../etc/passwd")


def test_flipped_byte_is_caught_and_quarantined(tmp_path: Path) -> None:
    store = LocalArtifactStore(tmp_path)
    data = os.urandom(4096)
    digest = store.put(data)
    path = store.path(digest)
    raw = bytearray(path.read_bytes())
    raw[100] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptArtifactError) as info:
        store.get(digest)
    assert info.value.digest == digest
    assert (
        info.value.quarantined_to is not None
        and Path(info.value.quarantined_to).read_bytes() == raw
    )
    assert not store.has(digest)  # gone from the blob tree, so the next put republishes it
    assert store.put(data) == digest and store.get(digest) == data


_WRITER = """
import os, sys
from kcache.store.local import LocalArtifactStore
store = LocalArtifactStore(sys.argv[1])
print("ready", flush=True)
while True:
    store.put(os.urandom(int.from_bytes(os.urandom(3), "little") % (4 << 20) + 1))
"""


def test_killed_writers_never_leave_a_visible_partial_blob(tmp_path: Path) -> None:
    rng = random.Random(1234)
    store = LocalArtifactStore(tmp_path)
    for _ in range(15):
        proc = subprocess.Popen(
            [sys.executable, "-c", _WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True
        )
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.0, 0.3))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        for digest in store.digests():
            store.get(digest)  # raises CorruptArtifactError on a partial or misnamed blob
    published = list(store.digests())
    assert published, "the writers published nothing; the loop tested nothing"
    for path in (tmp_path / "blobs").rglob("*"):
        if path.is_file() and not path.name.startswith(".tmp-"):
            # Anything not a staging file is a whole blob under its own digest.
            assert hashlib.sha256(path.read_bytes()).hexdigest() == path.name


# ---------------------------------------------------------------------- collection on a directory
_KILLED_COLLECTOR = """
import os, signal, sys
from kcache.store.local import LocalArtifactStore
store = LocalArtifactStore(sys.argv[1])
digests = sys.argv[2:]

def named(batch):
    os.kill(os.getpid(), signal.SIGKILL)  # killed with the whole batch set aside

store.collect_many(digests, 1e12, named)
"""


def _old_blobs(store: LocalArtifactStore, count: int) -> dict[str, bytes]:
    blobs = {}
    for _ in range(count):
        data = os.urandom(1000)
        digest = store.put(data)
        os.utime(store.path(digest), (1000.0, 1000.0))
        blobs[digest] = data
    return blobs


def test_a_collector_killed_mid_batch_leaves_blobs_the_sweep_puts_back(tmp_path: Path) -> None:
    store = LocalArtifactStore(tmp_path)
    blobs = _old_blobs(store, 5)
    killed = subprocess.run(
        [sys.executable, "-c", _KILLED_COLLECTOR, str(tmp_path), *blobs], timeout=60
    )
    assert killed.returncode == -signal.SIGKILL
    aside = [p for p in (tmp_path / "blobs").rglob(f"{SET_ASIDE_PREFIX}*")]
    assert len(aside) == 5 and list(store.digests()) == []  # set aside: listed by nobody
    leftovers = store.sweep_leftovers(time.time() - 3600)
    assert leftovers.restored == 5
    assert sorted(store.digests()) == sorted(blobs)
    assert all(store.get(d) == data for d, data in blobs.items())


def test_a_failing_index_question_puts_the_whole_batch_back(tmp_path: Path) -> None:
    store = LocalArtifactStore(tmp_path)
    blobs = _old_blobs(store, 3)

    def unreachable(batch: Sequence[str]) -> set[str]:
        assert not any(store.has(d) for d in batch)  # all set aside while it is asked
        raise ConnectionError("the database is down")

    with pytest.raises(ConnectionError):
        store.collect_many(list(blobs), time.time(), unreachable)
    assert sorted(store.digests()) == sorted(blobs)
    assert not list((tmp_path / "blobs").rglob(f"{SET_ASIDE_PREFIX}*"))


def test_a_blob_reused_while_set_aside_survives_its_collection(tmp_path: Path) -> None:
    """A writer after the rename publishes a fresh copy; one just before it renewed the mtime."""
    store = LocalArtifactStore(tmp_path)
    blobs = _old_blobs(store, 3)
    republished, touched, gone = list(blobs)

    def meanwhile(batch: Sequence[str]) -> set[str]:
        store.put(blobs[republished])  # finds no blob (set aside): a fresh copy
        (moved,) = (tmp_path / "blobs").rglob(f"{SET_ASIDE_PREFIX}{touched}-*")
        os.utime(moved)  # as a put that came just before the rename
        return set()

    done = store.collect_many(list(blobs), time.time() - 60, meanwhile)
    assert set(done.freed) == {republished, gone}  # the set-aside copies went ...
    assert set(done.young) == {touched}  # ... except the renewed one, put back
    assert store.get(republished) == blobs[republished] and store.get(touched) == blobs[touched]
    assert not store.has(gone)
    assert not list((tmp_path / "blobs").rglob(f"{SET_ASIDE_PREFIX}*"))


def test_the_sweep_removes_only_old_staging_files(tmp_path: Path) -> None:
    store = LocalArtifactStore(tmp_path)
    digest = store.put(b"a blob")
    fan = store.path(digest).parent
    old, young = fan / ".tmp-old", fan / ".tmp-young"
    old.write_bytes(b"12345")
    young.write_bytes(b"1")
    os.utime(old, (1000.0, 1000.0))
    assert store.sweep_leftovers(time.time() - 3600, dry_run=True).temp_files == 1
    assert old.exists()
    swept = store.sweep_leftovers(time.time() - 3600)
    assert (swept.temp_files, swept.temp_bytes) == (1, 5)
    assert not old.exists() and young.exists() and store.has(digest)
