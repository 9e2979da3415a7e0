"""A compile from inside one of its include sets reads the set, as a server would.

NVRTC looks a quoted include of the program up in the working directory first. With
``k.cu`` and ``tile.h`` side by side, ``kcache compile k.cu`` rightly refuses ``tile.h``
(no input) and advises ``--include-set NAME=DIR``; given ``--include-set local=.`` from
that directory it refused again with the same advice (the working directory's copy was
read, not the set's). Such a compile now runs where a server's worker does, in a removed
directory: it succeeds, recording ``local:tile.h``, and misses once the header changes.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kcache.dirs import mark_cache_dir
from kcache.errors import UnlistedIncludeError
from kcache.include_sets import IncludeSets
from kcache.nvrtc import compile_recipe
from kcache.recipe import Recipe
from kcache.toolchain import Toolchain
from tests.cli_harness import kcache, user_env

SOURCE = '#include "tile.h"\n__global__ void k(float* x) { x[0] = TILE; }\n'


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "k.cu").write_text(SOURCE)
    (tmp_path / "tile.h").write_text("#define TILE 8\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _recipe(toolchain: Toolchain, sets: IncludeSets, *names: str) -> Recipe:
    recipe = Recipe(source=SOURCE, name="k.cu", target="sm_90", include_sets=list(names))
    return recipe.with_defaults(toolchain=toolchain.id, include_sets=sets.digests())


def test_a_set_rooted_at_the_working_directory_is_read_as_the_set(
    toolchain: Toolchain, project: Path
) -> None:
    none = IncludeSets()
    with pytest.raises(UnlistedIncludeError, match=r"tile\.h"):
        compile_recipe(_recipe(toolchain, none), toolchain, none)
    sets = IncludeSets({"local": "."})
    output = compile_recipe(_recipe(toolchain, sets, "local"), toolchain, sets)
    assert [d.name for d in output.dependencies] == ["local:tile.h"]


def test_the_cli_takes_its_own_advice(project: Path) -> None:
    env = user_env(project)
    refused = kcache("compile", "k.cu", "--target", "sm_90", "--local", env=env, cwd=project)
    assert refused.returncode != 0 and "--include-set NAME=DIR" in refused.stderr
    args = ("compile", "k.cu", "--target", "sm_90", "--local", "--include-set", "local=.")
    first = kcache(*args, env=env, cwd=project)
    assert first.returncode == 0 and '"compiled"' in first.stdout, first.stderr
    (project / "tile.h").write_text("#define TILE 9\n")
    edited = kcache(*args, env=env, cwd=project)
    assert edited.returncode == 0 and '"compiled"' in edited.stdout, edited.stderr


def test_a_cache_directory_under_a_set_is_not_part_of_it(tmp_path: Path) -> None:
    """A node tier kept inside a project changes with every lookup (lock files, statistics):
    the set's digest does not, and no file of it is a file of the set."""
    (tmp_path / "tile.h").write_text("#define TILE 8\n")
    cache = tmp_path / "cache"
    mark_cache_dir(cache)
    (cache / "locks").mkdir()
    sets = IncludeSets({"local": str(tmp_path)})
    before = sets.digest("local", max_age_s=0)
    (cache / "locks" / ("a" * 64 + ".lock")).write_text("")
    (cache / "stats.json").write_text("{}")
    assert sets.digest("local", max_age_s=0) == before
    assert sets.file_hash("local", "cache/stats.json") is None
    (tmp_path / "other.h").write_text("#define OTHER 1\n")  # the set's own files still count
    assert sets.digest("local", max_age_s=0) != before
    # A directory tagged by another tool (not kcache's tag) stays part of the set.
    (tmp_path / "build").mkdir()
    (tmp_path / "build" / "CACHEDIR.TAG").write_text(
        "Signature: 8a477f597d28d172789f06886806bc55\n"
    )
    (tmp_path / "build" / "gen.h").write_text("#define GEN 1\n")
    assert sets.file_hash("local", "build/gen.h") is not None


def test_the_walk_hashes_every_kind_of_entry_as_a_lookup_by_name_does(tmp_path: Path) -> None:
    """The walk hashes each file where it found it, without resolving it again; what it lists
    and each digest equal what :meth:`IncludeSets.file_hash` says of that name: a plain file,
    a link inside the set, a link out of it (not listed), a link into a cache directory
    (listed, unreadable), a file under a cache directory (not listed), a FIFO (not listed)."""
    root = tmp_path / "set"
    (root / "sub").mkdir(parents=True)
    (root / "plain.h").write_text("#define PLAIN 1\n")
    (root / "sub" / "deep.h").write_text("#define DEEP 1\n")
    (root / "inside.h").symlink_to("sub/deep.h")
    (tmp_path / "outside.h").write_text("#define OUT 1\n")
    (root / "escapes.h").symlink_to(tmp_path / "outside.h")
    cache = root / "cache"
    mark_cache_dir(cache)
    (cache / "held.h").write_text("#define HELD 1\n")
    (root / "into_cache.h").symlink_to("cache/held.h")
    (root / "dangling.h").symlink_to("missing.h")
    os.mkfifo(root / "pipe")
    sets = IncludeSets({"s": str(root)})
    _, files = sets.contents("s", max_age_s=0)
    assert sorted(files) == ["inside.h", "into_cache.h", "plain.h", "sub/deep.h"]
    assert files["into_cache.h"] is None
    assert files["inside.h"] == files["sub/deep.h"] is not None
    for relative, digest in files.items():
        assert sets.file_hash("s", relative) == digest, relative
