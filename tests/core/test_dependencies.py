"""Dependency-aware lookup: manifests over the headers a compile actually read."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kcache.artifact import ArtifactMeta
from kcache.engine import Engine
from kcache.local_engine import open_local_engine
from kcache.recipe import Recipe

KERNEL = """
#include "a.cuh"
extern "C" __global__ void scaled(int* out) { out[0] = VALUE; }
"""
HEADERS = {
    "a.cuh": '#pragma once\n#include "b.cuh"\n#define VALUE (B_VALUE + 1)\n',
    "b.cuh": "#pragma once\n#define B_VALUE 41\n",
    "unused.cuh": "#define UNUSED 1\n",
}


def _recipe(headers: dict[str, str] | None = None, **fields: object) -> Recipe:
    fields.setdefault("source", KERNEL)
    fields.setdefault("target", "compute_90")
    fields.setdefault("output", "ptx")
    return Recipe(headers=headers if headers is not None else HEADERS, **fields)  # type: ignore[arg-type]


def _stored_constant(engine: Engine, recipe: Recipe) -> int:
    """The constant the kernel stores, read from its PTX (mov.u32 %r1, N; st.global.u32 [..], %r1)."""
    ptx = engine.read(engine.resolve(recipe).artifact).decode()
    match = re.search(r"mov\.[bu]32\s+(%r\d+),\s*(\d+);\s*st\.global\.u32\s+\[[^\]]+\],\s*\1;", ptx)
    assert match, ptx
    return int(match.group(2))


@pytest.fixture()
def engine(tmp_path: Path) -> Engine:
    return open_local_engine(tmp_path / "data")


def test_manifest_hits_on_unused_header_misses_on_nested_edit(engine: Engine) -> None:
    first = engine.resolve(_recipe())
    assert first.status == "compiled"
    assert {d.name for d in first.artifact.dependencies} == {"a.cuh", "b.cuh"}
    assert first.artifact.dependencies_exact
    assert _stored_constant(engine, _recipe()) == 42

    unused_edit = engine.resolve(_recipe({**HEADERS, "unused.cuh": "#define UNUSED 2\n"}))
    assert unused_edit.status == "hit"
    assert unused_edit.recipe_key != first.recipe_key
    assert unused_edit.artifact.digest == first.artifact.digest  # one blob for both

    nested = {**HEADERS, "b.cuh": "#pragma once\n#define B_VALUE 99\n"}
    edited = engine.resolve(_recipe(nested))
    assert edited.status == "compiled"
    assert _stored_constant(engine, _recipe(nested)) == 100

    restored = engine.resolve(_recipe({**HEADERS, "unused.cuh": "// yet another"}))
    assert restored.status == "hit" and restored.artifact.digest == first.artifact.digest


def test_alias_is_recorded_after_a_manifest_match(engine: Engine) -> None:
    first = engine.resolve(_recipe())
    other = _recipe({**HEADERS, "unused.cuh": "// edited"})
    assert engine.resolve(other).status == "hit"  # by the manifest: its key was new
    resolved = other.with_defaults(toolchain=engine.toolchain_id)
    looked_up = engine.index.lookup(resolved.key())
    # The new key now names the same artifact directly (no manifest walk next time).
    assert isinstance(looked_up, ArtifactMeta), looked_up
    assert looked_up.digest == first.artifact.digest


def test_header_in_an_untaken_if_branch_is_not_a_dependency(engine: Engine) -> None:
    source = '#if 0\n#include "never.cuh"\n#endif\n#include "a.cuh"\nextern "C" __global__ void k(int* o) { o[0] = VALUE; }'
    headers = {**HEADERS, "never.cuh": "#error never\n"}
    first = engine.resolve(_recipe(headers, source=source))
    assert "never.cuh" not in {d.name for d in first.artifact.dependencies}
    assert (
        engine.resolve(
            _recipe({**headers, "never.cuh": "#error still never\n"}, source=source)
        ).status
        == "hit"
    )


def test_computed_include_is_tracked(engine: Engine) -> None:
    source = '#define PICK "picked.cuh"\n#include PICK\nextern "C" __global__ void k(int* o) { o[0] = PICKED; }'
    headers = {"picked.cuh": "#define PICKED 7\n", "other.cuh": ""}
    assert engine.resolve(_recipe(headers, source=source)).status == "compiled"
    assert engine.resolve(_recipe({**headers, "other.cuh": "//"}, source=source)).status == "hit"
    edited = {**headers, "picked.cuh": "#define PICKED 8\n"}
    assert engine.resolve(_recipe(edited, source=source)).status == "compiled"
    assert _stored_constant(engine, _recipe(edited, source=source)) == 8


def test_include_set_files_are_dependencies(tmp_path: Path) -> None:
    library = tmp_path / "lib"
    (library / "lib").mkdir(parents=True)
    (library / "lib" / "value.h").write_text("#pragma once\n#define LIB_VALUE 5\n")
    (library / "lib" / "other.h").write_text("#pragma once\n")
    engine = open_local_engine(tmp_path / "data", include_sets={"mylib": library})
    source = '#include <lib/value.h>\nextern "C" __global__ void k(int* o) { o[0] = LIB_VALUE; }'
    recipe = _recipe({}, source=source, include_sets=["mylib"])
    first = engine.resolve(recipe)
    assert first.status == "compiled"
    assert [d.name for d in first.artifact.dependencies] == ["mylib:lib/value.h"]
    (library / "lib" / "other.h").write_text("#pragma once\n// edited, never included\n")
    assert engine.resolve(recipe).status == "hit"
    (library / "lib" / "value.h").write_text("#pragma once\n#define LIB_VALUE 6\n")
    edited = engine.resolve(recipe)  # same recipe key, but a dependency in the set changed
    assert edited.status == "compiled"
    assert _stored_constant(engine, recipe) == 6


def test_stale_header_case_scale_one_to_two(engine: Engine) -> None:
    source = (
        '#include "scale.cuh"\n'
        "__device__ int combine(int x, int y) { return (x + y) * SCALE; }\n"
        'extern "C" __global__ void k(int* out) { out[0] = combine(4, 5); }'
    )
    one = _recipe({"scale.cuh": "#define SCALE 1\n"}, source=source)
    two = _recipe({"scale.cuh": "#define SCALE 2\n"}, source=source)
    assert _stored_constant(engine, one) == 9
    assert engine.resolve(two).status == "compiled"
    assert _stored_constant(engine, two) == 18
    assert engine.resolve(two).artifact.digest != engine.resolve(one).artifact.digest


def test_include_set_hash_memo_never_hides_an_edit(tmp_path: Path) -> None:
    """Same size, same mtime: a memo keyed on stat alone would serve the old hash."""
    import os

    from kcache.include_sets import IncludeSets

    header = tmp_path / "h.h"
    header.write_text("#define X 1\n")
    sets = IncludeSets({"s": tmp_path})
    first = sets.file_hash("s", "h.h")
    st = header.stat()
    header.write_text("#define X 2\n")  # same size, within the same clock tick or not
    os.utime(header, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert sets.file_hash("s", "h.h") != first  # a young file is never served from the memo

    old = st.st_mtime_ns - 3_600 * 10**9
    os.utime(header, ns=(old, old))
    settled = sets.file_hash("s", "h.h")  # an old file is memoised...
    header.write_text("#define X 3\n")
    os.utime(header, ns=(old, old))  # ...but an edit still moves its ctime
    assert sets.file_hash("s", "h.h") not in (settled, first)
