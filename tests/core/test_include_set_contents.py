"""Include sets enter a key by their contents, and a manifest match checks where a compile looked.

docs/design.md "What a binding rests on": every edit of a file a compile read, and every
file added where the compile looked (``__has_include``, a file in an earlier set that
shadows the one read), misses; a file added where the compile did not look still hits
(through the manifest, under the set's new digest). Real NVRTC; compiles are seeded, so
"the right kernel" is checked byte for byte against a fresh compile in a new store.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kcache.deps import ABSENT
from kcache.engine import Engine
from kcache.errors import IncludeSetChangedError, UnresolvedRecipeError
from kcache.include_probes import named_includes
from kcache.include_sets import IncludeSets
from kcache.local_engine import open_local_engine
from kcache.recipe import Recipe

SOURCE = """\
#include <tile.h>
#if __has_include(<extra.h>)
#include <extra.h>
#endif
#ifndef EXTRA
#define EXTRA 0
#endif
extern "C" __global__ void k(int* out) { out[0] = TILE + EXTRA; }
"""


def _sets(root: Path) -> dict[str, Path]:
    s1, s2 = root / "s1", root / "s2"
    s1.mkdir(parents=True, exist_ok=True)
    s2.mkdir(parents=True, exist_ok=True)
    return {"s1": s1, "s2": s2}


def _recipe() -> Recipe:
    return Recipe(source=SOURCE, target="sm_80", include_sets=["s1", "s2"])


def _fresh_digest(tmp: Path, sets: dict[str, Path]) -> str:
    """What a compile in a new, empty store makes of the recipe now: the right answer."""
    engine = open_local_engine(tmp, include_sets=sets)
    resolution = engine.resolve(_recipe())
    assert resolution.status == "compiled"
    return resolution.artifact.digest


@pytest.fixture
def layout(tmp_path: Path) -> tuple[Engine, dict[str, Path]]:
    sets = _sets(tmp_path / "sets")
    (sets["s2"] / "tile.h").write_text("#define TILE 8\n")
    (sets["s1"] / "unrelated.h").write_text("// never included\n")
    return open_local_engine(tmp_path / "data", include_sets=sets), sets


def test_a_key_names_a_set_by_its_contents_never_by_its_name_alone(tmp_path: Path) -> None:
    sets = _sets(tmp_path)
    (sets["s1"] / "a.h").write_text("1\n")
    registry = IncludeSets(sets, max_age_s=0)
    recipe = Recipe(source="x", target="sm_80", toolchain="t", include_sets=["s1"])
    with pytest.raises(UnresolvedRecipeError, match="digest of its contents"):
        recipe.key()
    first = recipe.with_defaults(include_sets=registry.digests())
    (sets["s1"] / "a.h").write_text("2\n")  # an edit
    edited = recipe.with_defaults(include_sets=registry.digests())
    (sets["s1"] / "b.h").write_text("")  # an added file
    added = recipe.with_defaults(include_sets=registry.digests())
    keys = {first.key(), edited.key(), added.key()}
    assert len(keys) == 3
    # The base key names the sets only: manifests match across a set's versions.
    assert first.base_key() == edited.base_key() == added.base_key()
    assert first.include_sets[0].startswith("s1@")
    # A pin is kept whatever the mapping says; a set named by digest keys as given.
    assert first.with_defaults(include_sets=registry.digests()).key() == first.key()


def test_an_edit_of_a_file_read_misses_and_an_unread_files_edit_still_hits(
    layout: tuple[Engine, dict[str, Path]], tmp_path: Path
) -> None:
    engine, sets = layout
    first = engine.resolve(_recipe())
    assert first.status == "compiled"
    names = {d.name: d.sha256 for d in first.artifact.dependencies}
    assert "s2:tile.h" in names
    # Where it looked and found nothing: tile.h and extra.h in s1 and s2.
    assert names["s1?tile.h"] == ABSENT and names["s1?extra.h"] == ABSENT
    assert names["s2?extra.h"] == ABSENT
    assert "s2?tile.h" not in names  # read: its hash is the read's

    (sets["s1"] / "unrelated.h").write_text("// edited, never included\n")
    unread = engine.resolve(_recipe())
    assert (unread.status, unread.via) == ("hit", "manifest")
    assert unread.artifact.digest == first.artifact.digest

    (sets["s2"] / "tile.h").write_text("#define TILE 9\n")
    edited = engine.resolve(_recipe())
    assert edited.status == "compiled"
    assert edited.artifact.digest != first.artifact.digest
    assert edited.artifact.digest == _fresh_digest(tmp_path / "fresh", sets)


@pytest.mark.parametrize(
    "added",
    [
        ("s2", "extra.h", "#define EXTRA 1\n"),  # __has_include found nothing before
        ("s1", "extra.h", "#define EXTRA 2\n"),
        ("s1", "tile.h", "#define TILE 5\n"),  # an earlier set shadows the file read
    ],
    ids=["has_include-later-set", "has_include-earlier-set", "shadow-in-earlier-set"],
)
def test_a_file_added_where_the_compile_looked_misses(
    layout: tuple[Engine, dict[str, Path]], tmp_path: Path, added: tuple[str, str, str]
) -> None:
    engine, sets = layout
    first = engine.resolve(_recipe())
    set_name, name, text = added
    (sets[set_name] / name).write_text(text)
    again = engine.resolve(_recipe())
    assert again.status == "compiled", again
    assert again.artifact.digest != first.artifact.digest
    assert again.artifact.digest == _fresh_digest(tmp_path / "fresh", sets)


def test_a_file_added_where_the_compile_did_not_look_still_hits(
    layout: tuple[Engine, dict[str, Path]],
) -> None:
    engine, sets = layout
    first = engine.resolve(_recipe())
    (sets["s1"] / "other.h").write_text("#define OTHER 1\n")
    (sets["s2"] / "sub").mkdir()
    (sets["s2"] / "sub" / "tile.h").write_text("#define TILE 7\n")  # not where <tile.h> is
    again = engine.resolve(_recipe())
    assert (again.status, again.via) == ("hit", "manifest")
    assert again.artifact.digest == first.artifact.digest
    assert again.recipe_key != first.recipe_key  # the set's new contents: a new key


def test_a_recipe_pinned_to_contents_a_set_no_longer_has_is_answered_by_its_key_only(
    layout: tuple[Engine, dict[str, Path]],
) -> None:
    engine, sets = layout
    first = engine.resolve(_recipe())
    pinned = Recipe.from_dict(first.recipe.to_dict())  # as a client sends it: pinned by its author
    assert engine.resolve(pinned).status == "hit"  # its contents unchanged
    (sets["s2"] / "tile.h").write_text("#define TILE 10\n")
    with pytest.raises(IncludeSetChangedError) as caught:
        engine.resolve(pinned)  # neither matched against today's files nor compiled from them
    assert caught.value.name == "s2" and "changed" in str(caught.value)
    # A recipe the engine pinned itself is pinned again, to the contents now.
    again = engine.resolve(first.recipe)
    assert again.status == "compiled" and again.recipe_key != first.recipe_key


def test_a_computed_include_records_each_sets_whole_contents(tmp_path: Path) -> None:
    assert named_includes('#include <a.h>\n# include "b/c.h"\n#include NAME\n') == (
        [("a.h", False), ("b/c.h", True)],
        True,
    )
    sets = _sets(tmp_path / "sets")
    (sets["s1"] / "tile.h").write_text("#define TILE 3\n")
    source = '#define NAME <tile.h>\n#include NAME\nextern "C" __global__ void k(int* o) { o[0] = TILE; }\n'
    engine = open_local_engine(tmp_path / "data", include_sets=sets)
    recipe = Recipe(source=source, target="sm_80", include_sets=["s1", "s2"])
    first = engine.resolve(recipe)
    assert {"s1?*", "s2?*"} <= {d.name for d in first.artifact.dependencies}
    (sets["s2"] / "anything.h").write_text("")  # anywhere: the scan cannot say where it looked
    assert engine.resolve(recipe).status == "compiled"


def test_random_edits_and_additions_always_answer_what_a_fresh_compile_makes(
    tmp_path: Path,
) -> None:
    """A property run (a bounded sample; seeded): each step edits, adds or removes a file
    in one of the sets, then the engine's answer must be byte-identical to a compile of
    the recipe in a new store (compiles are deterministic: -frandom-seed)."""
    rng = random.Random(43)
    sets = _sets(tmp_path / "sets")
    (sets["s2"] / "tile.h").write_text("#define TILE 1\n")
    engine = open_local_engine(tmp_path / "data", include_sets=sets)
    engine.resolve(_recipe())
    files = [("s1", "tile.h"), ("s2", "tile.h"), ("s1", "extra.h"), ("s2", "extra.h")]
    files += [("s1", "noise.h"), ("s2", "deep/noise.h")]
    for step in range(10):
        set_name, name = rng.choice(files)
        path = sets[set_name] / name
        action = rng.choice(["write", "write", "remove"])
        if action == "remove" and path.exists() and (set_name, name) != ("s2", "tile.h"):
            path.unlink()
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            macro = "TILE" if name == "tile.h" else "EXTRA" if name == "extra.h" else "NOISE"
            path.write_text(f"#define {macro} {rng.randint(1, 4)}\n")
        answer = engine.resolve(_recipe())
        fresh = _fresh_digest(tmp_path / f"fresh-{step}", sets)
        assert answer.artifact.digest == fresh, (step, set_name, name, action, answer.via)
