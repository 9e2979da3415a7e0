"""The node tier's per-key lock and publish order: what lets waiting ranks go on early.

* A key's lock is a file of its own (``filelock``), there only while someone holds or
  waits for the key: its holder removes it before letting go, and a waiter that took
  the removed file's lock takes the new one instead, so keys exclude each other only
  when they are the same, across processes and threads, and nothing piles up.
* In a shared (``1777``) tier a key's file is writable by every user, who wait for each
  other; a link planted where a key's file goes lets a process go ahead without the lock.
* A child forked while its parent held a key does not keep the key once the parent dies.
* A publish writes the recipe's alias first and lets go of the key at once, so other
  processes take the entry before the holder has written the artifact record and the
  manifest; a rank that took an entry another rank fetched leaves the next key to that
  rank (``follows``), so ranks asking in the same order keep one fetcher; an entry whose
  record and manifest a crash lost still reads, lists and evicts, and the next publish
  writes them.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
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


def _other_process_finds(root: Path, key: str, uid: int | None = None) -> str:
    """What another process (as ``uid``) gets when it tries ``key`` once: "free" or "busy"."""
    done = subprocess.run(
        [sys.executable, "-c", _TRY_ONCE, str(root), key, str(uid or "")],
        capture_output=True,
        text=True,
    )
    assert done.stdout.strip() in ("free", "busy"), done.stderr
    return done.stdout.strip()


def test_each_key_has_a_file_while_held_and_excludes_only_itself(tmp_path: Path) -> None:
    lock = FileKeyLock(tmp_path)
    keys = [f"{i:02x}" * 32 for i in range(40)]
    with lock.hold(keys[0], timeout=5) as waited:
        assert not waited
        assert os.path.isfile(lock.path(keys[0]))
        assert _other_process_finds(tmp_path, keys[0]) == "busy"
        assert _other_process_finds(tmp_path, keys[1]) == "free"
        # Another thread of this process (its own descriptor) is excluded as well.
        with pytest.raises(LockTimeoutError):  # noqa: SIM117
            with FileKeyLock(tmp_path).hold(keys[0], timeout=0.05):
                pass
    for key in keys:
        with lock.hold(key, timeout=5):
            pass
    assert list((tmp_path / "locks").iterdir()) == []  # no file per key ever held
    assert _other_process_finds(tmp_path, keys[0]) == "free"


def test_contenders_exclude_each_other_although_each_holder_removes_its_file(
    tmp_path: Path,
) -> None:
    """Waiters that opened a file its holder then removed must not hold it beside a new one."""
    inside: list[int] = []
    most = [0]
    guard = threading.Lock()
    problems: list[str] = []

    def contend(rounds: int) -> None:
        lock = FileKeyLock(tmp_path)  # an object (and descriptors) per thread, as per process
        for turn in range(rounds):
            with lock.hold(KEY, timeout=60):
                with guard:
                    inside.append(1)
                    most[0] = max(most[0], len(inside))
                if not os.path.isfile(lock.path(KEY)):
                    problems.append("held a file that is gone")
                threading.Event().wait(0.001)
                with guard:
                    inside.pop()
                if turn % 2:  # half of the holds let go before their block ends, as a tier's
                    lock.let_go(KEY)

    threads = [threading.Thread(target=contend, args=(25,)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert most == [1] and problems == []
    assert list((tmp_path / "locks").iterdir()) == []


def test_a_key_file_in_a_shared_directory_is_writable_by_all(tmp_path: Path) -> None:
    private, shared = tmp_path / "private", tmp_path / "shared"
    (shared / "locks").mkdir(parents=True)
    os.chmod(shared / "locks", 0o1777)
    for root, mode in ((private, 0o644), (shared, 0o666)):
        lock = FileKeyLock(root)
        with lock.hold(KEY, timeout=5):
            assert stat.S_IMODE(os.stat(lock.path(KEY)).st_mode) == mode, root


def test_a_link_planted_where_a_key_file_goes_costs_only_the_lock(tmp_path: Path) -> None:
    lock = FileKeyLock(tmp_path)
    target = tmp_path / "elsewhere"
    target.write_text("not a lock")
    os.symlink(target, lock.path(KEY))
    with lock.hold(KEY, timeout=5) as waited:  # no lock to be had: the caller goes ahead
        assert not waited
    assert os.path.islink(lock.path(KEY)) and target.read_text() == "not a lock"


@pytest.mark.skipif(os.geteuid() != 0, reason="other uids need root to start as")
def test_users_of_a_shared_tier_wait_for_each_other(tmp_path: Path) -> None:
    work = Path(tempfile.mkdtemp(prefix="kcache-lock-users-"))  # where other uids can reach
    try:
        os.chmod(work, 0o755)
        (work / "locks").mkdir()
        os.chmod(work / "locks", 0o1777)  # as a shared tier's (_tier_standing.share_dirs)
        holder = subprocess.Popen(
            [sys.executable, "-c", _HOLD_FOREVER, str(work), KEY, "65533"],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
            assert os.stat(FileKeyLock(work).path(KEY)).st_uid == 65533
            assert _other_process_finds(work, KEY, uid=65532) == "busy"
            holder.kill()
            holder.wait()
            assert _other_process_finds(work, KEY, uid=65532) == "free"
        finally:
            holder.kill()
            holder.wait()
        # The dead holder's file stays (the other user may not remove it) and serves on.
        assert os.path.isfile(FileKeyLock(work).path(KEY))
        assert _other_process_finds(work, KEY, uid=65532) == "free"
    finally:
        shutil.rmtree(work, ignore_errors=True)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_child_forked_by_a_holder_does_not_keep_the_key_once_the_holder_dies(
    tmp_path: Path,
) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD_AND_FORK, str(tmp_path), KEY],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None
    child = int(holder.stdout.readline())
    try:
        assert _other_process_finds(tmp_path, KEY) == "busy"
        holder.kill()
        holder.wait()
        assert _other_process_finds(tmp_path, KEY) == "free"  # the child still runs
    finally:
        holder.kill()
        holder.wait()
        os.kill(child, signal.SIGKILL)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_child_forked_inside_a_hold_leaves_the_parents_lock_alone(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _FORK_INSIDE, str(tmp_path), KEY], capture_output=True, text=True
    )
    assert done.stdout.split() == ["there", "busy"], done.stderr
    assert _other_process_finds(tmp_path, KEY) == "free"


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
        assert not os.path.exists(lock.path(KEY))
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


def test_ranks_asking_in_the_same_order_keep_one_fetcher(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two ranks (each its own tier object, as processes are) get twelve keys in order.
    The one fetching lingers after each publish until the other has taken the entry, as
    a rank descheduled between two kernels does: the other then leaves the next key to
    it instead of claiming it (it claimed it at once, so the fetch went from rank to rank
    at every key). A rank that follows still fetches a key no one else claims."""
    monkeypatch.setattr("kcache.locks._FIRST_NAP_S", 0.05)  # room for a loaded machine
    keys = [f"{i + 16:02x}" * 32 for i in range(12)]
    entries = [(artifact_meta(f"kernel {i}".encode()), f"kernel {i}".encode()) for i in range(12)]
    taken = [threading.Event() for _ in keys]
    fetcher: dict[int, str] = {}
    tiers = {name: NodeTier(tmp_path, max_bytes=0) for name in ("a", "b")}

    def rank(name: str) -> None:
        tier = tiers[name]
        for i, key in enumerate(keys):
            with tier.hold_unless(key, lambda key=key: tier.lookup(key), follows=True) as found:
                if found is None and tier.lookup(key) is None:
                    time.sleep(0.02)  # the fetch: the other rank comes to wait for this key
                    tier.publish(key, BASE, *entries[i])
                    fetcher[i] = name
                    taken[i].wait(10)
                    time.sleep(0.001)  # between two kernels
                    continue
            taken[i].set()

    threads = [threading.Thread(target=rank, args=(name,)) for name in tiers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert sorted(fetcher) == list(range(12))  # each key fetched once
    order = [fetcher[i] for i in range(12)]
    handovers = sum(a != b for a, b in itertools.pairwise(order))
    assert handovers <= 2, order  # without: 11, one at every key
    follower = tiers["b" if order[-1] == "a" else "a"]
    with follower.hold_unless("7a" * 32, lambda: None, follows=True) as found:
        assert found is None  # the lock, after a nap: no one else was fetching it


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_waits_for_a_holder_as_its_parent_does(tmp_path: Path) -> None:
    assert _wait_for_a_holder(tmp_path, KEY) == "entry"
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
    import encodings.ascii, os, sys  # imported while root can read the interpreter's files
    from kcache.errors import LockTimeoutError
    from kcache.locks import FileKeyLock
    if sys.argv[3]:
        os.setgid(int(sys.argv[3]))
        os.setuid(int(sys.argv[3]))
    try:
        with FileKeyLock(sys.argv[1]).hold(sys.argv[2], timeout=0.05):
            print("free")
    except LockTimeoutError:
        print("busy")
    """
)
_HOLD_FOREVER = textwrap.dedent(
    """
    import encodings.ascii, os, sys, time
    from kcache.locks import FileKeyLock
    os.setgid(int(sys.argv[3]))
    os.setuid(int(sys.argv[3]))
    with FileKeyLock(sys.argv[1]).hold(sys.argv[2], timeout=5):
        print("held", flush=True)
        time.sleep(600)
    """
)
_HOLD_AND_FORK = textwrap.dedent(
    """
    import os, sys, time
    from kcache.locks import FileKeyLock
    with FileKeyLock(sys.argv[1]).hold(sys.argv[2], timeout=5):
        child = os.fork()
        if child == 0:
            time.sleep(600)
            os._exit(0)
        print(child, flush=True)
        time.sleep(600)
    """
)
_FORK_INSIDE = textwrap.dedent(
    """
    import os, sys
    from kcache.errors import LockTimeoutError
    from kcache.locks import FileKeyLock
    lock = FileKeyLock(sys.argv[1])
    with lock.hold(sys.argv[2], timeout=5):
        child = os.fork()
        if child:  # the child has left its block (and its copy of the lock) by now
            os.waitpid(child, 0)
            print("there" if os.path.exists(lock.path(sys.argv[2])) else "gone")
            try:
                with FileKeyLock(sys.argv[1]).hold(sys.argv[2], timeout=0.05):
                    print("free")
            except LockTimeoutError:
                print("busy")
    if not child:
        os._exit(0)
    """
)
