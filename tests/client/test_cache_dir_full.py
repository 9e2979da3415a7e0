"""A full cache directory, on a real full filesystem (a 512 KiB tmpfs), says where and what to do.

Before (issue 45), the client said ``[Errno 28] no space left to publish 31098b09….json``:
no directory, no ``--cache-dir`` or ``cache clear`` hint, and a ``get`` whose kernel the
server had sent failed. Now a kernel fetched is used from memory with one warning per
process naming the directory and the fixes, and what needs the directory (a local compile,
``Artifact.path``) raises :class:`CacheDirFullError` (a ``StoreFullError``) saying the same.

Mounting the tmpfs needs root (CI's containers run as root); elsewhere the tests skip.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from client_harness import KcacheServer
from kcache_client import CacheDirFullError, ClientSettings, KernelCache

from kcache import Recipe
from kcache.errors import StoreFullError
from tests.cli_harness import kcache, user_env
from tests.support import FAST, unique

HINTS = ("kcache cache clear", "--cache-dir", "KCACHE_CACHE_DIR", "KCACHE_CACHE_MAX_BYTES")


def _recipe(tag: str, target: str = "sm_90") -> Recipe:
    return Recipe(
        source=f'extern "C" __global__ void k_{tag}(float* x) {{ x[threadIdx.x] += 3.0f; }}\n',
        target=target,
    )


def _fill(root: Path) -> None:
    """Take every free byte of ``root``'s filesystem (what a full disk leaves)."""
    fd = os.open(root / "filler", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)
    assert os.statvfs(root).f_bavail == 0


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 512 KiB tmpfs of its own (the cache directory is ``<it>/cache``)."""
    mount = tmp_path / "small"
    mount.mkdir()
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
        check=False,
    )
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {made.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _said(text: str, root: Path) -> None:
    assert f"cache directory {root.resolve()}" in text or f"cache directory {root}" in text
    assert "no space left" in text
    for hint in HINTS:
        assert hint in text, hint
    assert "[Errno" not in text


def test_a_fetched_kernel_is_used_and_the_full_directory_warned_once(
    kserver: KcacheServer, small_fs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = small_fs / "cache"
    tag = unique("full").replace("-", "_")
    settings = ClientSettings.from_env(retry=FAST, send_events=False)
    caplog.set_level(logging.WARNING, logger="kcache_client")
    with KernelCache(kserver.url, cache_dir=root, settings=settings) as cache:
        _fill(small_fs)
        got = [cache.get(_recipe(f"{tag}_{i}")) for i in range(3)]
        for art in got:
            assert hashlib.sha256(art.data).hexdigest() == art.digest
            assert art.origin != "node"
        # A file was asked for: none can be written, and the error says where and why.
        with pytest.raises(CacheDirFullError) as caught:
            _ = got[0].path
    assert isinstance(caught.value, StoreFullError) and caught.value.errno == errno.ENOSPC
    assert caught.value.path == str(root)
    _said(str(caught.value), root)
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1, warned  # one per process and directory, not one per kernel
    _said(warned[0], root)
    assert "used from memory" in warned[0]
    assert not any((root / "blobs").iterdir())  # nothing half written is left


def test_a_local_compile_into_a_full_directory_is_a_typed_error(small_fs: Path) -> None:
    root = small_fs / "cache"
    settings = ClientSettings.from_env(url="", send_events=False, local_compile=True)
    with KernelCache(cache_dir=root, settings=settings) as cache:
        _fill(small_fs)
        with pytest.raises(CacheDirFullError) as caught:
            cache.get(_recipe(unique("lf").replace("-", "_")))
    _said(str(caught.value), root)
    assert "\n" not in str(caught.value)
    assert caught.value.__cause__ is None


def test_the_commands_name_the_directory_and_the_fix(
    kserver: KcacheServer, small_fs: Path, tmp_path: Path
) -> None:
    root = small_fs / "cache"
    source = tmp_path / "k.cu"
    source.write_text(_recipe(unique("cf").replace("-", "_")).source)
    trust = {k: os.environ[k] for k in ("KCACHE_TRUSTED_KEYS", "KCACHE_KNOWN_SERVERS")}
    env = user_env(tmp_path, KCACHE_CACHE_DIR=str(root), **trust)
    online = {**env, "KCACHE_URL": kserver.url}

    # A new cache directory on a full disk: the command says so, not "No space left on device".
    _fill(small_fs)
    new = kcache("compile", str(source), "--target", "sm_80", env=env)
    assert new.returncode == 1, new.stderr
    _said(new.stderr, root)
    assert "Traceback" not in new.stderr

    # A cache directory in use when the disk fills up.
    (small_fs / "filler").unlink()
    first = kcache("get", str(source), "--target", "sm_86", env=online)
    assert first.returncode == 0, first.stderr
    _fill(small_fs)
    local = kcache("compile", str(source), "--target", "sm_80", env=env)
    assert local.returncode == 1, local.stderr
    _said(local.stderr, root)
    out = tmp_path / "k.cubin"
    fetched = kcache("get", str(source), "--target", "sm_90", "-o", str(out), env=online)
    assert fetched.returncode == 0, fetched.stderr  # the kernel was fetched: the user has it
    assert out.stat().st_size > 0
    _said(fetched.stderr, root)
    assert "used from memory" in fetched.stderr
