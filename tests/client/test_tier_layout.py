"""A node tier's layout: new tiers are flat, tiers an earlier release filled keep their fan-out.

Both layouts are read and written through the same tier code; what tells them apart is
the directory's ``LAYOUT`` file (:func:`kcache.dirs.cache_layout`), written before
anything else in a new directory.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from client_harness import tier_entry
from kcache_client._tier import NodeTier

from kcache.dirs import LAYOUT_FILE, cache_layout
from kcache.errors import KCacheError
from kcache.index.file import FileIndex
from kcache.keys import sha256_hex
from kcache.store.local import LocalArtifactStore


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def test_a_new_tier_is_flat_and_publishes_no_fanout_directories(tmp_path: Path) -> None:
    tier = NodeTier(tmp_path / "tier")
    assert (tmp_path / "tier" / LAYOUT_FILE).read_text() == "flat\n"
    key, base, meta, data = tier_entry(0)
    tier.publish(key, base, meta, data)
    tier.flush()  # the record and the manifest entry wait for an idle moment
    files = _files(tmp_path / "tier")
    assert f"blobs/{meta.digest}" in files
    assert f"index/recipes/{key}.json" in files
    assert f"index/artifacts/{meta.digest}.json" in files
    assert f"index/manifests/{base}.json" in files
    # No directory below blobs/ or the index kinds: nothing fanned out.
    for kind in ("blobs", "index/recipes", "index/artifacts", "index/manifests"):
        assert not [p for p in (tmp_path / "tier" / kind).iterdir() if p.is_dir()], kind
    # Another process reads it, and lists it.
    again = NodeTier(tmp_path / "tier")
    found = again.lookup(key)
    assert found is not None and found[1] == data
    assert [e.recipe_keys for e in again.entries()] == [(key,)]


def test_a_tier_an_earlier_release_filled_keeps_its_fanout_layout(tmp_path: Path) -> None:
    root = tmp_path / "old"
    key, base, meta, data = tier_entry(1)
    # What an earlier release left: fan-out blobs and index, no LAYOUT file.
    LocalArtifactStore(root, durable=False).put(data)
    FileIndex(root, durable=False).record_artifact(key, base, meta)
    assert not (root / LAYOUT_FILE).exists()
    tier = NodeTier(root)
    assert cache_layout(root) == "fanout" and not (root / LAYOUT_FILE).exists()
    found = tier.lookup(key)
    assert found is not None and found[1] == data  # its entries are found where they are
    key2, base2, meta2, data2 = tier_entry(2)
    tier.publish(key2, base2, meta2, data2)
    d = meta2.digest
    assert f"blobs/{d[:2]}/{d[2:4]}/{d}" in _files(root)  # and new ones go where old ones are
    assert {e.digest for e in tier.entries()} == {meta.digest, d}
    assert tier.clear().removed == 2 and tier.usage().entries == 0


def test_the_cli_maintains_a_flat_cache_directory(tmp_path: Path) -> None:
    """`kcache verify` and `kcache gc` see the flat layout's blobs and records."""
    root = tmp_path / "cache"
    tier = NodeTier(root)
    key, base, meta, data = tier_entry(3)
    tier.publish(key, base, meta, data)
    tier.flush()
    orphan = b"an orphan nobody names"
    tier.store.put(orphan)
    old = 1_000_000_000
    os.utime(tier.store.path(sha256_hex(orphan)), (old, old))
    run = [sys.executable, "-m", "kcache.cli"]
    verify = subprocess.run(
        [*run, "verify", "--cache-dir", str(root)], capture_output=True, text=True
    )
    assert verify.returncode == 0, verify.stderr
    assert '"checked": 2' in verify.stdout
    gc = subprocess.run([*run, "gc", "--cache-dir", str(root)], capture_output=True, text=True)
    assert gc.returncode == 0, gc.stderr
    assert '"blobs": 1' in gc.stdout  # the orphan, not the recorded blob
    assert not tier.store.has(sha256_hex(orphan)) and tier.lookup(key) is not None


def test_a_layout_this_release_does_not_know_is_refused_with_what_to_do(tmp_path: Path) -> None:
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / LAYOUT_FILE).write_text("sharded-v9\n")
    with pytest.raises(KCacheError, match=r"sharded-v9.*newer release.*KCACHE_CACHE_DIR"):
        NodeTier(tmp_path / "c")


def test_concurrent_creators_agree_on_the_layout(tmp_path: Path) -> None:
    """Processes opening one new directory at once all end up flat, with one LAYOUT file."""
    code = (
        "import sys; from kcache_client._tier import NodeTier; "
        "print(NodeTier(sys.argv[1]).store.flat)"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "t")], stdout=subprocess.PIPE)
        for _ in range(6)
    ]
    outs = [p.communicate()[0].strip() for p in procs]
    assert outs == [b"True"] * 6
    assert (tmp_path / "t" / LAYOUT_FILE).read_text() == "flat\n"
    assert not [p.name for p in (tmp_path / "t").iterdir() if p.name.startswith(f".{LAYOUT_FILE}")]
