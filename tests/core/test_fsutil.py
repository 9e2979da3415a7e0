"""Publishing and reading files: ``atomic_write`` and ``read_file`` (kcache.fsutil)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kcache.fsutil import TMP_PREFIX, atomic_write, read_file


@pytest.mark.parametrize("durable", [True, False])
def test_atomic_write_creates_missing_fan_out_directories(tmp_path: Path, durable: bool) -> None:
    dest = tmp_path / "blobs" / "ab" / "cd" / "abcd"
    atomic_write(dest, b"one", durable=durable)  # no directory yet: made on demand
    assert dest.read_bytes() == b"one"
    atomic_write(str(dest), b"two", verify=b"two", durable=durable)  # a str works too
    assert dest.read_bytes() == b"two"
    other = tmp_path / "blobs" / "ab" / "ef" / "abef"  # a sibling under an existing parent
    atomic_write(other, b"three", durable=durable)
    assert other.read_bytes() == b"three"
    leftovers = [p for p in tmp_path.rglob("*") if p.name.startswith(TMP_PREFIX)]
    assert leftovers == []


def test_atomic_write_leaves_no_temp_file_when_it_fails(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(OSError):
        atomic_write(tmp_path / "file" / "under-a-file", b"y")  # the parent is a file
    dest = tmp_path / "d" / "f"
    with pytest.raises(OSError, match="read-back"):
        atomic_write(dest, b"written", verify=b"something else")
    assert not dest.exists() and os.listdir(tmp_path / "d") == []


@pytest.mark.parametrize("size", [0, 1, 4095, 65536, 65537, 3 << 20])
def test_read_file_reads_the_whole_file(tmp_path: Path, size: int) -> None:
    data = os.urandom(size)
    (tmp_path / "f").write_bytes(data)
    assert read_file(str(tmp_path / "f")) == data


def test_read_file_raises_as_open_does(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        read_file(str(tmp_path / "missing"))
    with pytest.raises(IsADirectoryError):
        read_file(str(tmp_path))
