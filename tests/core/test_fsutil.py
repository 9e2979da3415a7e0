"""Publishing and reading files: ``atomic_write`` and ``read_file`` (kcache.fsutil)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kcache.fsutil import (
    TMP_PREFIX,
    UnsafeFileError,
    atomic_write,
    make_dirs,
    read_file,
    regular_files,
)


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


@pytest.mark.parametrize("durable", [True, False])
def test_atomic_write_of_a_bare_name_writes_in_the_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, durable: bool
) -> None:
    """``-o out.json`` of a command: no directory in the name (the sync of its directory,
    '', failed after the file was written, and the command reported a failure)."""
    monkeypatch.chdir(tmp_path)
    atomic_write("out.json", b"{}", durable=durable)
    assert (tmp_path / "out.json").read_bytes() == b"{}"
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]


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


def test_a_file_where_a_directory_goes_reads_as_no_file(tmp_path: Path) -> None:
    """ENOTDIR (a damaged cache: a file where an index directory goes) is FileNotFoundError,
    which every reader takes as an absent entry; it escaped as NotADirectoryError."""
    (tmp_path / "recipes").write_text("not a directory\n")
    with pytest.raises(FileNotFoundError):
        read_file(str(tmp_path / "recipes" / "entry.json"))


def test_read_file_raises_as_open_does(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        read_file(str(tmp_path / "missing"))
    with pytest.raises(UnsafeFileError, match="is a directory"):
        read_file(str(tmp_path))


def test_only_regular_files_are_read_never_through_a_link_nor_past_the_bound(
    tmp_path: Path,
) -> None:
    """What a directory others can write may hold: each read refuses it at once, unread."""
    target = tmp_path / "target"
    target.write_bytes(b"x" * 100)
    (tmp_path / "link").symlink_to(target)
    (tmp_path / "zeros").symlink_to("/dev/zero")
    os.mkfifo(tmp_path / "fifo")  # no writer: a blocking open would hang forever
    for name, reason in (
        ("link", "is a symbolic link"),
        ("zeros", "is a symbolic link"),
        ("fifo", "is a FIFO"),
    ):
        with pytest.raises(UnsafeFileError, match=reason):
            read_file(str(tmp_path / name))
    with pytest.raises(UnsafeFileError, match="holds 100 bytes, more than the 99 expected"):
        read_file(str(target), max_bytes=99)
    assert read_file(str(target), max_bytes=100) == b"x" * 100
    if os.path.exists("/dev/null"):
        with pytest.raises(UnsafeFileError, match="character device"):
            read_file("/dev/null")


def test_a_walk_lists_regular_files_and_never_descends_through_a_link(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    (outside / "ab").mkdir(parents=True)
    (outside / "ab" / "secret").write_bytes(b"s")
    (outside / "file").write_bytes(b"f")
    tree = tmp_path / "tree"
    (tree / "cd").mkdir(parents=True)
    (tree / "cd" / "blob").write_bytes(b"b")
    (tree / "ab").symlink_to(outside / "ab")  # a linked fan-out directory
    (tree / "cd" / "linked").symlink_to(outside / "file")
    os.mkfifo(tree / "cd" / "fifo")
    assert [e.name for e in regular_files(tree, 1)] == ["blob"]
    (tmp_path / "linked-tree").symlink_to(tree)
    assert list(regular_files(tmp_path / "linked-tree", 1)) == []  # the root itself a link


def test_make_dirs_makes_missing_parents_and_leaves_what_is_there(tmp_path: Path) -> None:
    deep = tmp_path / "a" / "b" / "c"
    make_dirs(str(deep))
    assert deep.is_dir()
    (deep / "kept").write_text("x")
    make_dirs(str(deep))  # there already: nothing changes, nothing raised
    assert (deep / "kept").read_text() == "x"
