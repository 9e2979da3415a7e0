"""kcache.dirwatch: a rename into the watched directory wakes the waiter; nothing else does."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest

from kcache.dirwatch import rename_watch

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="inotify")


def test_a_rename_into_the_directory_wakes_the_waiter(tmp_path: Path) -> None:
    watch = rename_watch(str(tmp_path))
    assert watch is not None
    with watch:
        staging = tmp_path / ".tmp-entry"
        staging.write_bytes(b"a staging file: created, written, closed")
        assert watch.wait(0.05) is False  # none of that is a rename into it
        os.replace(staging, tmp_path / "entry")
        assert watch.wait(30) is True
        assert watch.wait(0.05) is False  # the event was read: the next wait sleeps


def test_a_rename_while_no_one_sleeps_still_wakes_the_next_wait(tmp_path: Path) -> None:
    """Armed before the waiter looks: a rename between its look and its sleep is not lost."""
    with rename_watch(str(tmp_path)) as watch:  # type: ignore[union-attr]
        for i in range(3):  # a burst of renames: one wake
            (tmp_path / f".s{i}").write_text("x")
            os.replace(tmp_path / f".s{i}", tmp_path / f"e{i}")
        assert watch.wait(30) is True
        assert watch.wait(0.05) is False


def test_a_sleeper_is_woken_by_another_thread_renaming(tmp_path: Path) -> None:
    def publish() -> None:
        (tmp_path / ".s").write_text("x")
        os.replace(tmp_path / ".s", tmp_path / "e")

    with rename_watch(str(tmp_path)) as watch:  # type: ignore[union-attr]
        threading.Timer(0.05, publish).start()
        assert watch.wait(60) is True  # well before the minute is up: the test would hang


def test_no_watch_where_there_is_no_directory(tmp_path: Path) -> None:
    assert rename_watch(str(tmp_path / "missing")) is None
    (tmp_path / "file").write_text("x")
    assert rename_watch(str(tmp_path / "file")) is None  # not a directory
