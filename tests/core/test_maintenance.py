"""kcache verify / gc / doctor over a local data directory."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

from kcache.local_engine import open_local_engine
from kcache.recipe import Recipe
from tests.support import KCACHE, VECTOR_ADD


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([KCACHE, *args], capture_output=True, text=True)


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
    result = _run("doctor", "--json", "--data-dir", str(tmp_path))
    assert result.returncode == 0, result.stdout
    checks = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    assert checks["headers"]["status"] == "ok" and "sm_90" in checks["toolchain"]["data"]["targets"]


def test_gc_and_verify_hand_a_server_data_directory_to_the_server(tmp_path: Path) -> None:
    """One `gc` and one `verify`: a directory holding kcache.db is maintained against its SQL
    index (`kcache db gc|verify`), never against a JSON index it does not have."""
    server_dir = tmp_path / "server"
    upgraded = _run("db", "upgrade", "--data-dir", str(server_dir))
    assert upgraded.returncode == 0, upgraded.stderr
    blob = server_dir / "blobs" / "ab" / "cd" / ("abcd" + "0" * 60)
    blob.parent.mkdir(parents=True)
    blob.write_bytes(b"named by no row")
    past = time.time() - 7200
    os.utime(blob, (past, past))
    verified = _run("verify", "--data-dir", str(server_dir))
    # The blob's bytes do not hash to its name: the server's verify quarantines it.
    assert verified.returncode == 1 and json.loads(verified.stdout)["corrupt"] == [blob.name]
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(b"named by no row")
    os.utime(blob, (past, past))
    refused = _run("gc", "--data-dir", str(server_dir))
    # The server's collector refuses an index that names none of the store's blobs.
    assert refused.returncode == 2 and "--force" in refused.stderr and blob.exists()
    assert "Traceback" not in refused.stderr and len(refused.stderr.strip().splitlines()) <= 2
    forced = _run("gc", "--data-dir", str(server_dir), "--force")
    assert forced.returncode == 0, forced.stderr
    assert json.loads(forced.stdout)["blobs"] == 1 and not blob.exists()
    assert not (server_dir / "index").exists()  # no JSON index was ever written beside kcache.db


def test_gc_and_verify_never_create_the_directory_they_are_given(tmp_path: Path) -> None:
    for command in ("gc", "verify"):
        result = _run(command, "--cache-dir", str(tmp_path / "nowhere"))
        assert result.returncode == 2 and "nowhere (--cache-dir) does not exist" in result.stderr
    assert not (tmp_path / "nowhere").exists()
