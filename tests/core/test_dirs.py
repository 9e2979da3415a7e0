"""Telling a cache directory from a server's data directory (kcache.dirs)."""

from __future__ import annotations

from pathlib import Path

from kcache.dirs import CACHE_TAG_FILE, SERVER_DATABASE_FILE, directory_kind, mark_cache_dir
from kcache.local_engine import open_local_engine


def test_a_cache_being_filled_is_never_taken_for_a_server(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    mark_cache_dir(cache)
    (cache / "blobs" / "ab").mkdir(parents=True)  # its first blob, before any index file
    assert directory_kind(cache) == "cache"
    untagged = tmp_path / "pg-server"
    (untagged / "blobs").mkdir(parents=True)  # a PostgreSQL server's store: blobs, no index
    assert directory_kind(untagged) == "server"
    sqlite_server = tmp_path / "sqlite-server"
    mark_cache_dir(sqlite_server)
    (sqlite_server / SERVER_DATABASE_FILE).touch()  # the database outranks a tag
    assert directory_kind(sqlite_server) == "server"
    assert directory_kind(tmp_path / "nothing") == "absent"


def test_the_local_engine_tags_its_directory_before_it_writes(tmp_path: Path) -> None:
    root = tmp_path / "fresh"
    open_local_engine(root)
    assert (
        (root / CACHE_TAG_FILE)
        .read_text()
        .startswith("Signature: 8a477f597d28d172789f06886806bc55")
    )
    assert directory_kind(root) == "cache"
