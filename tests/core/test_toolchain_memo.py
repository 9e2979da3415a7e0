"""The toolchain id remembered after a load (kcache.toolchain_memo): equal to the loaded one, never stale.

``kcache key`` keys recipes with :func:`kcache.toolchain.toolchain_id`, which reads the
memo instead of loading NVRTC: a memo that outlived the libraries it describes would
key recipes under the wrong toolchain, so every change the memo is meant to notice
is made here to real files and must make it ignored.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kcache import toolchain_memo
from kcache.dirs import toolchain_dir
from kcache.recipe import Recipe
from kcache.toolchain import Toolchain, load_toolchain, toolchain_id
from tests.support import VECTOR_ADD

ROOT = Path(__file__).resolve().parents[2]


def test_a_load_remembers_its_id_and_a_fresh_process_reads_it_without_loading(
    toolchain: Toolchain, tmp_path: Path
) -> None:
    root = toolchain_dir()
    toolchain_memo.memo_path(root).unlink(missing_ok=True)
    load_toolchain.cache_clear()  # the next load must really run (and write the memo)
    assert load_toolchain().id == toolchain.id
    assert toolchain_memo.recall(root) == toolchain.id

    probe = (
        "import sys; from kcache.toolchain import toolchain_id; print(toolchain_id()); "
        "print(sorted(m for m in sys.modules if m.startswith('cuda')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout.splitlines()
    assert out == [toolchain.id, "[]"]  # the loaded id, and nothing of CUDA imported

    source = tmp_path / "vector_add.cu"
    source.write_text(VECTOR_ADD)
    env = {k: v for k, v in os.environ.items() if k != "KCACHE_URL"}
    key = subprocess.run(
        [sys.executable, "-m", "kcache.cli", "key", str(source), "--target", "sm_90"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
        env=env,
    ).stdout.strip()
    recipe = Recipe(source=VECTOR_ADD, name="vector_add.cu", target="sm_90")
    assert key == recipe.with_defaults(toolchain=toolchain.id).key()


def test_a_memo_that_no_longer_matches_is_not_used(toolchain: Toolchain) -> None:
    root = toolchain_dir()
    load_toolchain.cache_clear()
    load_toolchain()  # writes the memo where there was none
    memo_file = toolchain_memo.memo_path(root)
    memo = json.loads(memo_file.read_text())
    memo["id"] = "nvrtc0.0-nvjitlink0.0-0000000000000000"
    memo["stamp"][-2] += "0"  # as if a library had changed since
    memo_file.write_text(json.dumps(memo))
    assert toolchain_memo.recall(root) is None
    assert toolchain_id() == toolchain.id  # loaded instead
    memo_file.write_text("{not json")
    assert toolchain_memo.recall(root) is None
    assert toolchain_id() == toolchain.id
    load_toolchain.cache_clear()
    load_toolchain()  # the next load writes a good memo over the broken one
    assert toolchain_memo.recall(root) == toolchain.id


@pytest.fixture
def remembered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path, Path]:
    """(toolchain root, a library, the header marker), with an id remembered for them."""
    monkeypatch.delenv("CONDA_PREFIX", raising=False)
    lib_dir = tmp_path / "lib"
    lib_dir.mkdir()
    library = lib_dir / "libnvrtc.so.13"
    library.write_bytes(b"\x7fELF one")
    marker = tmp_path / "headers" / "tree.sha256"
    marker.parent.mkdir()
    marker.write_text("ab" * 32 + "\n")
    root = tmp_path / "toolchains"
    toolchain_memo.remember(root, "tc-1", [library], toolchain_memo.stamp([library]), marker)
    assert toolchain_memo.recall(root) == "tc-1"
    return root, library, marker


def test_a_rewritten_library_invalidates_the_memo(remembered: tuple[Path, Path, Path]) -> None:
    root, library, _ = remembered
    library.write_bytes(b"\x7fELF two, longer")
    assert toolchain_memo.recall(root) is None


def test_a_library_touched_with_the_same_size_invalidates_the_memo(
    remembered: tuple[Path, Path, Path],
) -> None:
    root, library, _ = remembered
    st = library.stat()
    os.utime(library, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert toolchain_memo.recall(root) is None


def test_a_library_replaced_by_another_file_invalidates_the_memo(
    remembered: tuple[Path, Path, Path],
) -> None:
    root, library, _ = remembered
    st, dir_st = library.stat(), library.parent.stat()
    fresh = library.with_name("new")
    fresh.write_bytes(library.read_bytes())  # same size, same mtime below: another inode
    os.utime(fresh, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(fresh, library)
    os.utime(library.parent, ns=(dir_st.st_atime_ns, dir_st.st_mtime_ns))  # only the inode differs
    assert toolchain_memo.recall(root) is None


def test_a_file_added_beside_a_library_invalidates_the_memo(
    remembered: tuple[Path, Path, Path],
) -> None:
    root, library, _ = remembered
    (library.parent / "libnvrtc-builtins.so.13.9").write_bytes(b"newer builtins")
    assert toolchain_memo.recall(root) is None


def test_a_removed_library_or_header_tree_invalidates_the_memo(
    remembered: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    root, library, marker = remembered
    marker.unlink()
    assert toolchain_memo.recall(root) is None
    marker.write_text("ab" * 32 + "\n")
    toolchain_memo.remember(root, "tc-1", [library], toolchain_memo.stamp([library]), marker)
    library.unlink()
    assert toolchain_memo.recall(root) is None


def test_an_install_in_a_searched_directory_invalidates_the_memo(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    conda = tmp_path / "conda"
    conda.mkdir()
    monkeypatch.setenv("CONDA_PREFIX", str(conda))
    (tmp_path / "lib").mkdir()
    library = tmp_path / "lib" / "libnvJitLink.so.13"
    library.write_bytes(b"\x7fELF")
    marker = tmp_path / "tree.sha256"
    marker.write_text("cd" * 32 + "\n")
    root = tmp_path / "toolchains"
    toolchain_memo.remember(root, "tc-2", [library], toolchain_memo.stamp([library]), marker)
    assert toolchain_memo.recall(root) == "tc-2"
    (conda / "lib").mkdir()  # a package installed where cuda-pathfinder looks first
    assert toolchain_memo.recall(root) is None


def test_another_environment_has_its_own_memo(
    remembered: tuple[Path, Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, _, _ = remembered
    monkeypatch.setenv("CONDA_PREFIX", str(tmp_path))  # libraries may be found there first
    assert toolchain_memo.recall(root) is None
    monkeypatch.delenv("CONDA_PREFIX")
    assert toolchain_memo.recall(root) == "tc-1"
