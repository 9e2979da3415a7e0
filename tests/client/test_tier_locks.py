"""The node tier's per-key lock and publish order: what lets waiting ranks go on early.

* Keys are locked as bytes of one file (OFD record locks): no file per key, keys
  exclude each other only when they are the same, across processes and threads.
  Waiters are woken by threads kept for the purpose; a forked child starts its own.
* A publish writes the recipe's alias first and lets go of the key at once, so other
  processes take the entry before the holder has written the artifact record and the
  manifest; an entry whose record and manifest a crash lost still reads, lists and
  evicts, and the next publish writes them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from client_harness import artifact_meta
from kcache_client import NodeTier

from kcache.artifact import ArtifactMeta
from kcache.errors import LockTimeoutError
from kcache.index.file import FileIndex
from kcache.locks import FileKeyLock

KEY = "4d" * 32
BASE = "5e" * 32

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="OFD record locks are Linux's")


def _other_process_finds(root: Path, key: str) -> str:
    """What another process gets when it tries ``key`` once: "free" or "busy"."""
    return subprocess.run(
        [sys.executable, "-c", _TRY_ONCE, str(root), key], capture_output=True, text=True
    ).stdout.strip()


def test_keys_are_bytes_of_one_file_and_exclude_only_themselves(tmp_path: Path) -> None:
    lock = FileKeyLock(tmp_path)
    keys = [f"{i:02x}" * 32 for i in range(40)]
    with lock.hold(keys[0], timeout=5) as waited:
        assert not waited
        assert _other_process_finds(tmp_path, keys[0]) == "busy"
        assert _other_process_finds(tmp_path, keys[1]) == "free"
        # Another thread of this process (its own descriptor) is excluded as well.
        with pytest.raises(LockTimeoutError):  # noqa: SIM117
            with FileKeyLock(tmp_path).hold(keys[0], timeout=0.05):
                pass
    for key in keys:
        with lock.hold(key, timeout=5):
            pass
    assert sorted(p.name for p in (tmp_path / "locks").iterdir()) == ["keys.lock"]
    assert _other_process_finds(tmp_path, keys[0]) == "free"


def test_a_holder_that_lets_go_frees_the_key_before_its_block_ends(tmp_path: Path) -> None:
    lock = FileKeyLock(tmp_path)
    with lock.hold(KEY, timeout=5):
        FileKeyLock(tmp_path).let_go(KEY)  # another object: holds nothing here
        assert _other_process_finds(tmp_path, KEY) == "busy"
        outsider = threading.Thread(target=lock.let_go, args=(KEY,))
        outsider.start()
        outsider.join()
        assert _other_process_finds(tmp_path, KEY) == "busy"  # only the holding thread may
        lock.let_go(KEY)
        assert _other_process_finds(tmp_path, KEY) == "free"
    assert _other_process_finds(tmp_path, KEY) == "free"


def test_a_waiting_rank_takes_the_entry_once_the_alias_is_written(tmp_path: Path) -> None:
    """The holder stops after its alias (as if slow to write the rest); the waiter goes on."""
    data = b"kernel for the waiters " * 100
    meta = artifact_meta(data)
    holder_tier = NodeTier(tmp_path, max_bytes=0)
    held, publish, finish, taken = (threading.Event() for _ in range(4))
    record = holder_tier.index.record_metadata

    def slow_record(base_key: str, meta: ArtifactMeta) -> None:
        finish.wait(30)  # the record and the manifest wait until the waiter is done
        record(base_key, meta)

    holder_tier.index.record_metadata = slow_record  # type: ignore[method-assign]

    def hold_and_publish() -> None:
        with holder_tier.hold_unless(KEY, lambda: None) as found:
            assert found is None
            held.set()
            publish.wait(30)
            holder_tier.publish(KEY, BASE, meta, data)

    waiter_tier = NodeTier(tmp_path, max_bytes=0)  # as another process: its own lock object
    got: list[object] = []

    def wait_and_take() -> None:
        with waiter_tier.hold_unless(KEY, lambda: waiter_tier.lookup(KEY)) as found:
            # None: the lock was had (let go already); the caller looks under it, as get() does.
            got.append(found if found is not None else waiter_tier.lookup(KEY))
        taken.set()

    holder = threading.Thread(target=hold_and_publish)
    holder.start()
    assert held.wait(30)
    waiter = threading.Thread(target=wait_and_take)
    waiter.start()
    publish.set()
    assert taken.wait(30)
    # The waiter has its entry while the holder has not written the record yet.
    assert got == [(meta, data)]
    assert waiter_tier.index.artifact(meta.digest) is None
    finish.set()
    holder.join(30)
    waiter.join(30)
    holder_tier.flush()  # (it waited on finish for the record)
    assert waiter_tier.index.artifact(meta.digest) == meta
    assert [e.digest for e in waiter_tier.index.manifest(BASE)] == [meta.digest]


def _wait_for_a_holder(root: Path, key: str) -> object:
    """Hold ``key`` in a thread (own descriptor), publish, let go; what a waiter gets."""
    published: list[str] = []
    held = threading.Event()

    def holder() -> None:
        with FileKeyLock(root).hold(key, timeout=5):
            held.set()
            threading.Event().wait(0.05)
            published.append("entry")

    thread = threading.Thread(target=holder)
    thread.start()
    held.wait(10)
    try:
        with FileKeyLock(root).hold_unless(
            key, 20, lambda: published[0] if published else None
        ) as found:
            return found
    finally:
        thread.join()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_waits_with_threads_of_its_own(tmp_path: Path) -> None:
    """The parent's waiting threads stay behind in a fork: the child must start its own."""
    assert _wait_for_a_holder(tmp_path, KEY) == "entry"  # the parent has an idle thread now
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only if its wait ends as the parent's did
        code = 1
        try:
            code = 0 if _wait_for_a_holder(tmp_path, "6f" * 32) == "entry" else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.parametrize("durable", [False, True])
def test_the_alias_is_written_first_in_a_cache_and_last_in_a_durable_index(
    tmp_path: Path, durable: bool
) -> None:
    index = FileIndex(tmp_path, durable=durable)
    meta = artifact_meta(b"ordered")
    write_alias = index.write_alias
    before_alias: list[tuple[object, list[str]]] = []  # what was written when the alias was

    def spied(recipe_key: str, written: ArtifactMeta) -> None:
        before_alias.append((index.artifact(meta.digest), [e.digest for e in index.manifest(BASE)]))
        write_alias(recipe_key, written)

    index.write_alias = spied  # type: ignore[method-assign]
    index.record_artifact(KEY, BASE, meta)
    if durable:
        assert before_alias == [(meta, [meta.digest])]
    else:
        assert before_alias == [(None, [])]
    assert index.lookup(KEY) == meta and index.artifact(meta.digest) == meta


def test_an_entry_whose_record_a_crash_lost_reads_lists_evicts_and_heals(tmp_path: Path) -> None:
    data = b"kernel of a crashed publish " * 100
    meta = artifact_meta(data)
    tier = NodeTier(tmp_path, max_bytes=0)

    tier.store.put(data)
    tier.index.write_alias(KEY, meta)  # the process dies right after the alias
    assert tier.index.artifact(meta.digest) is None and tier.index.manifest(BASE) == []

    fresh = NodeTier(tmp_path, max_bytes=0)
    assert fresh.lookup(KEY) == (meta, data)
    (entry,) = fresh.entries()
    assert (entry.digest, entry.recipe_keys, entry.kernel) == (meta.digest, (KEY,), "")
    removal = fresh.remove([KEY])
    assert removal.removed == 1 and fresh.lookup(KEY) is None
    fresh.publish(KEY, BASE, meta, data)  # the refetch's publish writes everything
    fresh.flush()
    assert fresh.lookup(KEY) == (meta, data)
    assert fresh.index.artifact(meta.digest) == meta
    assert [e.digest for e in fresh.index.manifest(BASE)] == [meta.digest]


_TRY_ONCE = textwrap.dedent(
    """
    import sys
    from kcache.errors import LockTimeoutError
    from kcache.locks import FileKeyLock
    try:
        with FileKeyLock(sys.argv[1]).hold(sys.argv[2], timeout=0.05):
            print("free")
    except LockTimeoutError:
        print("busy")
    """
)
