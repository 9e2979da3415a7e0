"""A full disk named as the cause, at start and when a compile worker dies (issue 45, messages).

- Below ``min_free_bytes`` ``kcache serve`` started without a word: now one WARNING at
  start naming the free bytes, the data directory and ``KCACHE_MIN_FREE_BYTES``.
- With nothing free it did not start, saying "disk I/O error" (SQLite) or blaming
  ``compile_memory_mb`` for a worker's segfault: now it refuses in one line naming the
  data directory and the free space.
- On a full disk NVRTC prints ``LLVM ERROR: out of memory`` and its worker dies; the
  death, and a replacement that cannot start, were blamed on ``compile_memory_mb``: now
  on the disk.

The data directories are on a small tmpfs of the module's own (``mount`` works for
root here; skipped where it does not, as in test_hostile_operations' row 13), each
test with its own ``kcache serve`` since what is checked is how one starts.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support import KCACHE, ServerProcess, unique, vector_add, wait_until

MOUNT_SIZE = 64 << 20


@pytest.fixture(scope="module")
def disk(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A 64 MiB tmpfs for the module; skipped where mounting is not allowed."""
    mount = tmp_path_factory.mktemp("small-disk")
    if shutil.which("mount") is None:
        pytest.skip("no mount command: a full disk needs a small filesystem of its own")
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={MOUNT_SIZE}", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
        check=False,
    )
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({made.stderr.strip()})")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True, check=False)


def _fill(path: Path) -> None:
    """Write ``path`` until its filesystem has no byte free."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        while True:
            try:
                os.write(fd, b"\0" * (1 << 20))  # a short write first, ENOSPC only when full
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                return
    finally:
        os.close(fd)


def _env(**variables: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KCACHE_")}
    return {**env, **variables}


def test_below_min_free_bytes_serve_warns_once_at_start(disk: Path) -> None:
    data = disk / "low"
    server = ServerProcess(data, env=_env(), log=disk.parent / f"{disk.name}-low.log")
    with server:
        with httpx.Client(base_url=server.url) as http:
            assert http.get("/healthz").status_code == 200  # it serves: fetches need no space
        text = server.log.read_text()
    warned = [line for line in text.splitlines() if "KCACHE_MIN_FREE_BYTES" in line]
    assert len(warned) == 1, text
    (line,) = warned
    free = int(re.search(r"only (\d+) bytes are free", line).group(1))  # type: ignore[union-attr]
    assert 0 < free <= MOUNT_SIZE
    assert str(data.absolute()) in line and "min_free_bytes=268435456" in line
    assert "kcache db gc" in line
    # Said before uvicorn starts serving, not only when /readyz is asked.
    assert text.index("KCACHE_MIN_FREE_BYTES") < text.index("Uvicorn running")


def test_with_no_space_left_serve_refuses_to_start_in_one_line(disk: Path) -> None:
    kept = disk / "kept"  # a data directory with its database, made while there was space
    with ServerProcess(kept, env=_env(KCACHE_MIN_FREE_BYTES="0")):
        pass
    filler = disk / "filler-start"
    _fill(filler)
    try:
        assert shutil.disk_usage(disk).free == 0
        for data in (kept, disk / "new"):
            result = subprocess.run(
                [KCACHE, "serve", "--port", "0", "--data-dir", str(data)],
                capture_output=True,
                text=True,
                check=False,
                timeout=300,
                env=_env(KCACHE_MIN_FREE_BYTES="0"),  # even an operator who allows a full disk
            )
            assert result.returncode == 1, (result.stdout, result.stderr)
            lines = (result.stdout + result.stderr).strip().splitlines()
            assert len(lines) == 1, lines
            (line,) = lines
            assert f"the data directory {data.absolute()} has 0 bytes free" in line, line
            assert "not starting" in line and "--data-dir" in line
            assert "disk I/O error" not in line and "compile_memory_mb" not in line
    finally:
        filler.unlink()


def test_a_worker_dying_on_a_full_disk_is_blamed_on_the_disk(disk: Path) -> None:
    """NVRTC's 'LLVM ERROR: out of memory' on a full disk: the disk, not compile_memory_mb."""
    server = ServerProcess(
        disk / "full",
        env=_env(KCACHE_MIN_FREE_BYTES="0"),  # past the check at the door: a compile runs
        args=["--compile-workers", "1"],
        log=disk.parent / f"{disk.name}-full.log",
    )
    filler = disk / "filler-compile"
    with server, httpx.Client(base_url=server.url, timeout=120) as http:
        first = http.post("/v1/resolve", json={"recipe": vector_add(unique())})
        assert first.json()["status"] == "compiled", first.text
        _fill(filler)
        try:
            full = http.post("/v1/resolve", json={"recipe": vector_add(unique())})
            assert full.status_code == 507 and full.json()["error"] == "store_full", full.text
            assert "compile_memory_mb" not in full.text
            # The replacement worker cannot start either while nothing is free.
            wait_until(
                lambda: "replacement compile worker could not start" in server.log_tail(20000),
                "the replacement's failed start to be logged",
                timeout=120,
            )
            text = server.log.read_text()
        finally:
            filler.unlink()
    died = [line for line in text.splitlines() if "died while compiling" in line]
    assert died and all("the disk is full" in line for line in died), died
    starts = [line for line in text.splitlines() if "could not start" in line]
    assert starts, text
    for line in starts:
        assert "the disk is full" in line and "compile_memory_mb is not the cause" in line, line
        assert "too small" not in line, line
