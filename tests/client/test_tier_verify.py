"""A node-tier read hashes a blob once per file a process read, and never trusts a changed file.

The tier remembers, per digest, the identity of the blob file whose bytes it verified
(device, inode, size, mtime, ctime) and, per recipe key, the alias file it parsed;
a later read of a file with the same identity skips the hash (or the parse). These
tests count the hashes and change files every way a file can change: replaced by a
new file (a publish, which renames), written in place, truncated. A file is known
by its identity only once its ctime is 2 s old (``_SETTLED_NS``), so that a write
cannot share its timestamp; the tests set that age to 0 (or out of reach) instead
of waiting, and give an in-place write the later timestamp that age guarantees.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import kcache_client._tier as _tier
import kcache_client._tier_reads as _tier_reads
import pytest
from client_harness import artifact_meta
from kcache_client import NodeTier

from kcache.artifact import ArtifactMeta, CompileFailure

KEY = "1a" * 32
BASE = "2b" * 32


@pytest.fixture
def hashes(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[bytes]]:
    """The bytes the tier hashes, in order (through its own ``sha256_hex``: its reads', and
    ``checked_file``'s)."""
    seen: list[bytes] = []

    def sha256_hex(data: bytes) -> str:
        seen.append(bytes(data))
        return hashlib.sha256(data).hexdigest()

    monkeypatch.setattr(_tier_reads, "sha256_hex", sha256_hex)
    monkeypatch.setattr(_tier, "sha256_hex", sha256_hex)
    yield seen


@pytest.fixture
def settled(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every file counts as settled at once (its ctime need not be 2 s old)."""
    monkeypatch.setattr(_tier_reads, "_SETTLED_NS", 0)


def _later(path: Path) -> None:
    """Give a file written in place a later mtime, as a write 2 s after it would get."""
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


def _write_in_place(path: Path, data: bytes) -> None:
    """New bytes into the same file (same inode), as a foreign program or a bad disk could."""
    path.chmod(0o644)
    with open(path, "r+b") as handle:
        handle.truncate(0)
        handle.write(data)
    _later(path)


def _flip(data: bytes) -> bytes:
    damaged = bytearray(data)
    damaged[len(damaged) // 2] ^= 0x40
    return bytes(damaged)


DAMAGE: dict[str, Callable[[bytes], bytes]] = {
    "flipped": _flip,  # the same size
    "truncated": lambda data: data[: len(data) // 2],
    "zeros": lambda data: b"\0" * len(data),
}


def test_a_settled_blob_is_hashed_once_and_a_new_file_again(
    tmp_path: Path, settled: None, hashes: list[bytes]
) -> None:
    data = b"kernel bytes " * 300
    meta = artifact_meta(data)
    tier = NodeTier(tmp_path, max_bytes=0)
    tier.publish(KEY, BASE, meta, data)
    parsed: list[str] = []
    parse = tier.index.parse_signed_alias

    def counted(recipe_key: str, raw: bytes) -> tuple[ArtifactMeta | CompileFailure | None, Any]:
        parsed.append(recipe_key)
        return parse(recipe_key, raw)

    tier.index.parse_signed_alias = counted  # type: ignore[method-assign]
    for _ in range(3):
        assert tier.lookup(KEY) == (meta, data)
    assert hashes.count(data) == 1
    assert parsed == [KEY]  # the alias too: parsed once, then only stat-ed

    # Another process publishes the same bytes again: a new file, renamed into place.
    blob = Path(tier.location(meta.digest))
    copy = blob.with_name("copy")
    copy.write_bytes(data)
    os.replace(copy, blob)
    assert tier.lookup(KEY) == (meta, data)
    assert tier.lookup(KEY) == (meta, data)
    assert hashes.count(data) == 2


def test_a_file_younger_than_its_timestamps_can_tell_is_hashed_at_every_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hashes: list[bytes]
) -> None:
    monkeypatch.setattr(_tier_reads, "_SETTLED_NS", 1 << 62)  # never settled
    data = b"fresh kernel " * 300
    meta = artifact_meta(data)
    tier = NodeTier(tmp_path, max_bytes=0)
    tier.publish(KEY, BASE, meta, data)
    for _ in range(3):
        assert tier.lookup(KEY) == (meta, data)
    assert hashes.count(data) == 3


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_blob_changed_in_place_after_its_check_is_never_handed_out(
    tmp_path: Path, settled: None, hashes: list[bytes], damage: str
) -> None:
    data = b"kernel to damage " * 300
    meta = artifact_meta(data)
    tier = NodeTier(tmp_path, max_bytes=0)
    tier.publish(KEY, BASE, meta, data)
    assert tier.lookup(KEY) == (meta, data)  # verified, and its identity remembered

    blob = Path(tier.location(meta.digest))
    _write_in_place(blob, DAMAGE[damage](data))
    assert tier.lookup(KEY) is None  # hashed again, refused, quarantined, alias dropped
    assert not blob.exists()
    assert any(p.name.startswith(meta.digest) for p in (tmp_path / "quarantine").iterdir())
    assert tier.index.lookup(KEY) is None

    tier.publish(KEY, BASE, meta, data)  # the refetch's publish heals the tier
    assert tier.lookup(KEY) == (meta, data)


def test_an_alias_is_parsed_again_when_its_file_changes(tmp_path: Path, settled: None) -> None:
    one, two = b"first kernel " * 200, b"second kernel " * 200
    meta_one, meta_two = artifact_meta(one), artifact_meta(two)
    tier = NodeTier(tmp_path, max_bytes=0)
    tier.publish(KEY, BASE, meta_one, one)
    assert tier.lookup(KEY) == (meta_one, one)

    tier.publish(KEY, BASE, meta_two, two)  # the alias re-pointed: a new file
    assert tier.lookup(KEY) == (meta_two, two)

    # Written in place with another key's alias (old blocks after a crash): absent.
    alias = Path(tier.index.alias_path(KEY))
    other = "3c" * 32
    tier.publish(other, BASE, meta_one, one)
    _write_in_place(alias, Path(tier.index.alias_path(other)).read_bytes())
    assert tier.lookup(KEY) is None
    assert tier.lookup(other) == (meta_one, one)
