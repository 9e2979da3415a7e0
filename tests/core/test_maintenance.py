"""kcache verify / gc / doctor over a local data directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from kcache.local import open_local_engine
from kcache.recipe import Recipe
from tests.conftest import VECTOR_ADD

KCACHE = [sys.executable, "-m", "kcache.cli"]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*KCACHE, *args], capture_output=True, text=True)


def test_verify_finds_a_flipped_byte_and_a_missing_blob(tmp_path: Path) -> None:
    engine = open_local_engine(tmp_path)
    digest = engine.resolve(Recipe(source=VECTOR_ADD, target="sm_90")).artifact.digest
    other = engine.resolve(Recipe(source=VECTOR_ADD, target="sm_80")).artifact.digest
    clean = _run("verify", "--data-dir", str(tmp_path))
    assert clean.returncode == 0 and json.loads(clean.stdout)["checked"] == 2
    path = engine.store.path(digest)
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))
    engine.store.delete(other)
    report = _run("verify", "--data-dir", str(tmp_path))
    assert report.returncode == 1
    assert json.loads(report.stdout) == {
        "checked": 1,
        "corrupt": [digest],
        "missing": sorted([digest, other]),
    }


def test_gc_keeps_referenced_and_young_blobs(tmp_path: Path) -> None:
    engine = open_local_engine(tmp_path)
    kept = engine.resolve(Recipe(source=VECTOR_ADD, target="sm_90")).artifact.digest
    old_orphan = engine.store.put(b"orphan bytes")
    young_orphan = engine.store.put(b"just published, index record not yet written")
    stale_tmp = engine.store.path(kept).parent / ".tmp-leftover-1"
    stale_tmp.write_bytes(b"partial")
    past = time.time() - 7200
    for path in (engine.store.path(old_orphan), engine.store.path(kept), stale_tmp):
        os.utime(path, (past, past))
    result = _run("gc", "--data-dir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["blobs"] == 1 and json.loads(result.stdout)["temp_files"] == 1
    assert engine.store.has(kept) and engine.store.has(young_orphan)
    assert not engine.store.has(old_orphan) and not stale_tmp.exists()


def test_doctor_reports_the_toolchain(tmp_path: Path) -> None:
    result = _run("doctor", "--data-dir", str(tmp_path))
    assert result.returncode == 0, result.stdout
    report = json.loads(result.stdout)
    assert report["cuda_fp16.h"] is True and "sm_90" in report["toolchain"]["targets"]


def test_gc_refuses_a_server_data_directory(tmp_path: Path) -> None:
    server_dir = tmp_path / "server"
    (server_dir / "blobs" / "ab" / "cd").mkdir(parents=True)
    blob = server_dir / "blobs" / "ab" / "cd" / ("ab" + "cd" + "0" * 60)
    blob.write_bytes(b"indexed in SQL")
    (server_dir / "kcache.db").write_bytes(b"")
    past = time.time() - 7200
    os.utime(blob, (past, past))
    for command in ("gc", "verify"):
        result = _run(command, "--data-dir", str(server_dir))
        assert result.returncode == 2 and "server's data directory" in result.stderr
    assert blob.exists()  # nothing was collected
