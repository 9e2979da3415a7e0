"""LocalArtifactStore: atomic, idempotent publishing; corruption caught on read."""

from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kcache.errors import ArtifactNotFoundError, CorruptArtifactError
from kcache.store.local import LocalArtifactStore


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
