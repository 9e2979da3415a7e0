"""``kcache.recipe_diff``: each kind of difference between two recipes of a kernel, in words."""

from __future__ import annotations

import hashlib
from typing import Any

from kcache.recipe import LinkInput, Recipe
from kcache.recipe_diff import (
    HIDDEN,
    MAX_LINE_CHARS,
    MAX_LINES,
    NEVER_SEEN,
    Explanation,
    bounded,
    differences,
    explain,
    fingerprint,
    hide_value,
)

SOURCE = '#include "add.cuh"\nextern "C" __global__ void add(float* x) { x[0] = ADD; }\n'


def _recipe(**fields: Any) -> Recipe:
    base: dict[str, Any] = {
        "source": SOURCE,
        "name": "add.cu",
        "headers": {"add.cuh": "#define ADD 1\n"},
        "flags": ["-DA", "-DB"],
        "target": "sm_80",
        "toolchain": "nvrtc-12.8",
    }
    base.update(fields)
    return Recipe(**base)


def _diff(**changed: Any) -> list[str]:
    return differences(fingerprint(_recipe()), fingerprint(_recipe(**changed)))


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def test_the_same_recipe_has_no_difference() -> None:
    assert _diff() == []
    assert fingerprint(_recipe()) == fingerprint(_recipe())


def test_a_changed_header_is_named_with_both_hashes() -> None:
    old, new = _sha("#define ADD 1\n"), _sha("#define ADD 2\n")
    assert _diff(headers={"add.cuh": "#define ADD 2\n"}) == [
        f"header add.cuh changed ({old[:8]}.. -> {new[:8]}..)"
    ]


def test_a_header_added_and_one_removed() -> None:
    assert _diff(headers={"add.cuh": "#define ADD 1\n", "x.cuh": ""}) == ["header x.cuh added"]
    assert _diff(headers={}) == ["header add.cuh removed"]


def test_flags_added_and_removed() -> None:
    assert _diff(flags=["-DA", "-DB", "-lineinfo"]) == ["flag -lineinfo added"]
    assert _diff(flags=["-DA"]) == ["flag -DB removed"]
    assert _diff(flags=["-DA", "-DN=8"]) == ["flag -DN=8 added", "flag -DB removed"]
    # A flag given twice is one more flag.
    assert _diff(flags=["-DA", "-DB", "-DA"]) == ["flag -DA added"]


def test_reordered_flags_are_a_difference() -> None:
    assert _diff(flags=["-DB", "-DA"]) == ["flags reordered: -DA -DB -> -DB -DA"]
    # The flags both recipes have, each in its own order.
    assert _diff(flags=["-lineinfo", "-DB", "-DA"]) == [
        "flag -lineinfo added",
        "flags reordered: -DA -DB -> -DB -DA",
    ]


def test_target_toolchain_output_and_lto() -> None:
    assert _diff(target="sm_90") == ["target sm_80 -> sm_90"]
    assert _diff(toolchain="nvrtc-13.0") == ["toolchain nvrtc-12.8 -> nvrtc-13.0"]
    assert _diff(output="ptx", target="compute_80") == [
        "target sm_80 -> compute_80",
        "output cubin -> ptx",
    ]
    assert _diff(lto=True) == ["lto off -> on"]
    old, new = fingerprint(_recipe()), fingerprint(_recipe())
    new["toolchain"] = None
    assert differences(old, new) == ["toolchain nvrtc-12.8 -> none"]


def test_specialization_changed_added_and_removed() -> None:
    old = _recipe(specialization={"N": 4, "shape": [2, 3]})
    changed = _recipe(specialization={"N": 8, "shape": [2, 3], "dtype": "float16"})
    assert differences(fingerprint(old), fingerprint(changed)) == [
        "specialization N 4 -> 8",
        "specialization dtype added (float16)",
    ]
    fewer = _recipe(specialization={"N": 4})
    assert differences(fingerprint(old), fingerprint(fewer)) == [
        "specialization shape removed ([2, 3])"
    ]
    assert differences(
        fingerprint(old), fingerprint(_recipe(specialization={"N": 4, "shape": [2, 4]}))
    ) == ["specialization shape [2, 3] -> [2, 4]"]


def test_include_sets_and_name_expressions() -> None:
    assert _diff(include_sets=["cutlass"]) == ["include set cutlass added"]
    assert differences(
        fingerprint(_recipe(include_sets=["cutlass", "cub"])),
        fingerprint(_recipe(include_sets=["cub"])),
    ) == ["include set cutlass removed"]
    # Pinned to its contents: a set is named by name, and new contents are said so.
    old_pin, new_pin = "cutlass@" + "a" * 64, "cutlass@" + "b" * 64
    assert differences(
        fingerprint(_recipe(include_sets=[old_pin])), fingerprint(_recipe(include_sets=[new_pin]))
    ) == ["include set cutlass changed (aaaaaaaa.. -> bbbbbbbb..)"]
    assert _diff(include_sets=[new_pin]) == ["include set cutlass added"]
    assert _diff(name_expressions=["add"]) == ["name expressions changed"]
    assert differences(
        fingerprint(_recipe(name_expressions=["a", "b"])),
        fingerprint(_recipe(name_expressions=["b", "a"])),
    ) == ["name expressions changed"]


def test_source_name_and_link_inputs() -> None:
    old_sha, new_sha = _sha(SOURCE), _sha(SOURCE + "\n")
    assert _diff(source=SOURCE + "\n") == [f"source changed ({old_sha[:8]}.. -> {new_sha[:8]}..)"]
    assert _diff(name="other.cu") == ["name add.cu -> other.cu"]
    digest = "a" * 64
    assert _diff(lto=True, link=[LinkInput(digest=digest)]) == [
        "lto off -> on",
        "link inputs changed",
    ]


def test_several_differences_come_in_a_fixed_order() -> None:
    lines = _diff(
        headers={"add.cuh": "#define ADD 2\n"}, flags=["-DA"], target="sm_90", toolchain="t2"
    )
    assert [line.split()[0] for line in lines] == ["header", "flag", "target", "toolchain"]


def test_lines_and_lists_are_bounded() -> None:
    long_flag = "-DX=" + "y" * 500
    (line,) = _diff(flags=["-DA", "-DB", long_flag])
    assert len(line) == MAX_LINE_CHARS and line.startswith("flag -DX=yyy") and line.endswith("..")
    many = bounded([f"flag -D{i} added" for i in range(20)])
    assert len(many) == MAX_LINES + 1
    assert many[-1] == f"... and {20 - MAX_LINES} more"
    assert bounded(["a", "b"]) == ["a", "b"]


def test_explain_picks_the_fewest_differences_and_on_a_tie_the_most_recent() -> None:
    new = fingerprint(_recipe(flags=["-DA", "-DB", "-lineinfo"], target="sm_90"))
    far = fingerprint(_recipe(flags=[], target="sm_75"))
    near = fingerprint(_recipe(target="sm_90"))
    also_near = fingerprint(_recipe(flags=["-DA", "-DB", "-lineinfo"]))
    got = explain(new, [("f" * 64, far), ("a" * 64, near), ("b" * 64, also_near)])
    assert got == Explanation("a" * 64, ["flag -lineinfo added"])
    assert got.text == f"nearest {'a' * 16}: flag -lineinfo added"
    # Most recent first: on a tie, the first.
    assert explain(new, [("b" * 64, also_near), ("a" * 64, near)]).nearest_key == "b" * 64


def test_nothing_near_is_never_seen() -> None:
    got = explain(fingerprint(_recipe()), [])
    assert got == Explanation(None, []) and got.text == NEVER_SEEN == "never seen"


def test_the_text_joins_the_bounded_lines() -> None:
    new = fingerprint(_recipe(flags=[f"-DM{i}" for i in range(30)]))
    got = explain(new, [("c" * 64, fingerprint(_recipe(flags=[])))])
    assert len(got.differences) == MAX_LINES + 1
    assert got.text.startswith(f"nearest {'c' * 16}: flag -DM0 added; flag -DM1 added; ")
    assert got.text.endswith(f"; ... and {30 - MAX_LINES} more")


def test_a_fingerprint_is_json_and_small() -> None:
    import json

    recipe = _recipe(
        name_expressions=["add<float>"] * 50,
        specialization={"shape": [4, 4], "dtype": "float32"},
        include_sets=["cub"],
    )
    data = json.loads(json.dumps(fingerprint(recipe)))
    assert data == fingerprint(recipe)
    assert "add<float>" not in json.dumps(data)  # name expressions by their hash
    assert SOURCE not in json.dumps(data)


def test_without_values_macros_and_specializations_are_named_never_valued() -> None:
    """What a caller below the compile scope sees: which macro or key, never its value."""
    old = _recipe(flags=["-DA", "-DKEY=hunter2", "-DM=1"], specialization={"T": 4})
    new = _recipe(
        flags=["-DKEY=swordfish", "-DM=1", "-DA"], specialization={"T": 8, "dtype": "bfloat16"}
    )
    shown = differences(fingerprint(old), fingerprint(new))
    hidden = differences(fingerprint(old), fingerprint(new), values=False)
    assert shown == [
        "flag -DKEY=swordfish added",
        "flag -DKEY=hunter2 removed",
        "flags reordered: -DA -DM=1 -> -DM=1 -DA",
        "specialization T 4 -> 8",
        "specialization dtype added (bfloat16)",
    ]
    assert hidden == [
        f"flag -DKEY={HIDDEN} added",
        f"flag -DKEY={HIDDEN} removed",
        f"flags reordered: -DA -DM={HIDDEN} -> -DM={HIDDEN} -DA",
        "specialization T changed",
        "specialization dtype added",
    ]
    text = " ".join(hidden)
    for secret in ("hunter2", "swordfish", "bfloat16", "4", "8", "=1"):
        assert secret not in text, secret
    assert hide_value("-DN=4") == f"-DN={HIDDEN}" and hide_value("-DA") == "-DA"
    assert hide_value("--define-macro=N=4") == f"--define-macro=N={HIDDEN}"
    assert hide_value("-lineinfo") == "-lineinfo"
    # The nearest is chosen on the real values: the same recipe either way.
    candidates = [("k1", fingerprint(old)), ("k2", fingerprint(_recipe()))]
    assert explain(fingerprint(new), candidates, values=False).nearest_key == (
        explain(fingerprint(new), candidates).nearest_key
    )
