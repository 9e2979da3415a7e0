"""Recipe keys: stable across processes and field order, different for any change."""

from __future__ import annotations

import dataclasses
import json
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kcache.errors import InvalidKeyError, RecipeError, UnresolvedRecipeError
from kcache.keys import (
    KEY_FIELDS,
    RECIPE_FIELDS,
    KeyField,
    encode_base_key,
    encode_recipe_key,
    is_hex_key,
    require_hex_key,
    sha256_hex,
)
from kcache.recipe import LinkInput, Recipe
from kcache.specialization import render_macros
from tests.support import VECTOR_ADD

BASE = {
    "source": VECTOR_ADD,
    "name": "kernel.cu",
    "headers": {"a.cuh": "#define A 1\n", "b.cuh": "#define B 2\n"},
    "flags": ["-dopt=on", "-DFOO=1"],
    "target": "sm_90",
    "output": "cubin",
    "name_expressions": ["add"],
    "specialization": {
        "shape": [4, 8],
        "strides": [8, 1],
        "dtype": "float32",
        "alignment": 16,
        "block": [128, 1, 1],
        "num_warps": 4,
        "num_stages": 2,
    },
    "toolchain": "nvrtc13.5-nvjitlink13.5-0123456789abcdef",
}

# Include sets pinned to their contents (name@<digest>), as a key takes them.
_CUB = "cub@" + "c" * 64
_LIB2 = "lib-2@" + "2" * 64


def _variant(path: str, value: object) -> dict[str, object]:
    data = json.loads(json.dumps(BASE))
    *parents, leaf = path.split(".")
    node = data
    for part in parents:
        node = node[part]
    node[leaf] = value
    return data


VARIANTS = {
    "source": _variant("source", VECTOR_ADD + "\n// changed"),
    "name": _variant("name", "other.cu"),
    "toolchain": _variant("toolchain", "nvrtc13.4-nvjitlink13.4-fedcba9876543210"),
    "target": _variant("target", "sm_80"),
    "output": _variant("output", "ptx"),
    "flag text": _variant("flags", ["-dopt=off", "-DFOO=1"]),
    "flag order": _variant("flags", ["-DFOO=1", "-dopt=on"]),
    "shape": _variant("specialization.shape", [4, 9]),
    "strides": _variant("specialization.strides", [8, 2]),
    "dtype": _variant("specialization.dtype", "float16"),
    "alignment": _variant("specialization.alignment", 8),
    "block": _variant("specialization.block", [256, 1, 1]),
    "num_warps": _variant("specialization.num_warps", 8),
    "num_stages": _variant("specialization.num_stages", 3),
    "name expression": _variant("name_expressions", ["add2"]),
    "header byte": _variant("headers.b", None),  # replaced below
}
VARIANTS["header byte"] = _variant("headers", {"a.cuh": "#define A 1\n", "b.cuh": "#define B 3\n"})


def test_every_single_change_gives_a_distinct_key() -> None:
    keys = {"base": Recipe.from_dict(BASE).key()}
    for label, data in VARIANTS.items():
        keys[label] = Recipe.from_dict(data).key()
    assert len(set(keys.values())) == len(keys), keys


def test_key_is_stable_across_processes_and_field_order(tmp_path: Path) -> None:
    forward = tmp_path / "forward.json"
    backward = tmp_path / "backward.json"
    forward.write_text(json.dumps(BASE))
    # Reverse the field order at every level, headers and specialization included.
    reverse = {k: BASE[k] for k in reversed(list(BASE))}
    reverse["specialization"] = dict(reversed(list(BASE["specialization"].items())))  # type: ignore[union-attr]
    reverse["headers"] = dict(reversed(list(BASE["headers"].items())))  # type: ignore[union-attr]
    backward.write_text(json.dumps(reverse, indent=2))
    code = "import sys; from kcache import Recipe; print(Recipe.from_json(open(sys.argv[1]).read()).key())"
    keys = {
        subprocess.run(
            [sys.executable, "-c", code, str(p)], capture_output=True, text=True, check=True
        ).stdout.strip()
        for p in (forward, backward)
    }
    assert keys == {Recipe.from_dict(BASE).key()}


def test_base_key_ignores_header_contents_but_not_names() -> None:
    changed = Recipe.from_dict(VARIANTS["header byte"])
    base = Recipe.from_dict(BASE)
    assert changed.key() != base.key()
    assert changed.base_key() == base.base_key()
    renamed = Recipe.from_dict(
        _variant("headers", {"a.cuh": "#define A 1\n", "c.cuh": "#define B 2\n"})
    )
    assert renamed.base_key() != base.base_key()


def test_specialization_renders_sorted_macros() -> None:
    recipe = Recipe.from_dict(BASE)
    assert render_macros(recipe.specialization) == [
        ("KC_ALIGNMENT", "16"),
        ("KC_BLOCK_0", "128"),
        ("KC_BLOCK_1", "1"),
        ("KC_BLOCK_2", "1"),
        ("KC_DTYPE", "float"),
        ("KC_NDIM", "2"),
        ("KC_NUM_STAGES", "2"),
        ("KC_NUM_WARPS", "4"),
        ("KC_SHAPE_0", "4"),
        ("KC_SHAPE_1", "8"),
        ("KC_STRIDE_0", "8"),
        ("KC_STRIDE_1", "1"),
    ]
    assert Recipe.from_dict(_variant("specialization.dtype", "torch.bfloat16")).macro_flags()[
        4
    ] == ("-DKC_DTYPE=__nv_bfloat16")


def test_dtype_aliases_share_a_key() -> None:
    assert (
        Recipe.from_dict(_variant("specialization.dtype", "float")).key()
        == Recipe.from_dict(BASE).key()
    )


def test_unresolved_recipes_have_no_key() -> None:
    with pytest.raises(UnresolvedRecipeError, match="target"):
        Recipe(source=VECTOR_ADD, toolchain="x1").key()
    with pytest.raises(UnresolvedRecipeError, match="toolchain"):
        Recipe(source=VECTOR_ADD, target="sm_90").key()


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"headers": {"../x.h": ""}}, "headers['../x.h']"),
        ({"headers": {"/etc/passwd": ""}}, "headers['/etc/passwd']"),
        ({"flags": ["-I/etc"]}, "flags[0]"),
        ({"flags": ["--pch"]}, "flags[0]"),
        ({"flags": ["--fdevice-time-trace=/tmp/x"]}, "flags[0]"),
        ({"flags": ["-arch=sm_80"]}, "flags[0]"),
        ({"target": "sm_9x"}, "target"),
        ({"output": "fatbin"}, "output"),
        ({"source": "a\x00b"}, "source"),
        ({"specialization": {"dtype": "complex64"}}, "specialization.dtype"),
        ({"specialization": {"bad-key": 1}}, "specialization.bad-key"),
        ({"specialization": {"x": "a;b"}}, "specialization.x"),
        ({"unknown": 1}, "unknown"),
        ({"lto": "yes"}, "lto"),
        ({"target": "compute_90"}, "target"),
    ],
)
def test_bad_fields_are_named(change: dict[str, object], field: str) -> None:
    data = {**BASE, **change}
    with pytest.raises(RecipeError) as info:
        Recipe.from_dict(data)
    assert info.value.field == field


def test_round_trip_through_json() -> None:
    recipe = Recipe.from_dict(BASE)
    assert Recipe.from_json(json.dumps(recipe.to_dict())) == recipe


def test_recipes_are_immutable_so_memoised_keys_stay_true() -> None:
    recipe = Recipe.from_dict(BASE)
    key = recipe.key()
    with pytest.raises(TypeError):
        recipe.headers["a.cuh"] = "#define A 2\n"  # type: ignore[index]
    with pytest.raises(TypeError):
        recipe.specialization["num_warps"] = 8  # type: ignore[index]
    assert recipe.key() == key == Recipe.from_dict(BASE).key()
    clone = pickle.loads(pickle.dumps(recipe))
    assert clone == recipe and clone.key() == key
    assert recipe.with_defaults(toolchain="other") is recipe  # toolchain already set: no copy
    bare = Recipe(source=VECTOR_ADD, target="sm_90")
    assert bare.with_defaults(toolchain="tc1") is bare.with_defaults(toolchain="tc1")
    assert bare.with_defaults(toolchain="tc1").key() != bare.with_defaults(toolchain="tc2").key()


@pytest.mark.parametrize(
    "value",
    [
        "",
        "a" * 63,
        "a" * 65,
        "A" * 64,  # uppercase: a key has one spelling
        "a" * 64 + "\n",  # "$" would take it; fullmatch does not
        "g" * 64,
        "\u0661" * 64,  # Unicode digits are not hex digits
        "../" + "a" * 61,
        None,
        64,
        b"a" * 64,
    ],
    ids=repr,
)
def test_require_hex_key_refuses_anything_but_64_lowercase_hex_digits(value: object) -> None:
    assert not is_hex_key(value)
    with pytest.raises(InvalidKeyError) as caught:
        require_hex_key(value, "keys[3]")
    assert caught.value.field == "keys[3]"
    assert str(caught.value).startswith("keys[3] must be 64 lowercase hex digits")
    assert isinstance(caught.value, ValueError)  # generic handlers still catch it


def test_require_hex_key_passes_keys_and_digests_through() -> None:
    key = sha256_hex(b"kernel")
    assert is_hex_key(key) and require_hex_key(key, "digest") is key


# ---------------------------------------------------------------- encoder, header checks
# The one key encoder (kcache.keys.KEY_FIELDS walked, issues 32 and 46) writes
# json.dumps's canonical bytes, every recipe field among them; the header checks.

_EVERY_FIELD: dict[str, object] = {
    "source": 'extern "C" __global__ void k() {}\n// é 中 "quoted" \\ back\tslash\x01',
    "target": "sm_90a",
    "name": "dir/k.cu",
    "headers": {"b/x.cuh": "2 é", "a.h": "1\n", "c+d-e_f.hpp": ""},
    "flags": ["-dopt=on", '-DNAME="a b"', "-lineinfo"],
    "name_expressions": ["k<float, 256>", "ns::k2"],
    "specialization": {
        "dtype": "fp16",
        "block": 256,
        "scale": 0.5,
        "on": True,
        "s": "a b",
        "shape": [4, 8],
        "z": [1, 2],
    },
    "lto": True,
    "link": [
        {"recipe": {"source": "x", "output": "ltoir", "target": "compute_90", "toolchain": "t"}},
        {"digest": "ab" * 32},
    ],
    "toolchain": "nvrtc-13.5",
    "include_sets": [_CUB, _LIB2],
}


@pytest.mark.parametrize(
    "fields",
    [
        _EVERY_FIELD,
        {"source": "x", "target": "sm_80", "toolchain": "t"},
        {"source": "x", "target": "compute_80", "output": "ptx", "toolchain": "t"},
        {"source": "x"},  # unresolved: its identity still hashes the canonical form
    ],
)
def test_the_encoded_keys_are_canonical_json_and_the_material_is_what_they_say(
    fields: dict[str, object],
) -> None:
    """The one encoder writes json.dumps's bytes (sorted, compact, ASCII) for what it writes."""
    recipe = Recipe.from_dict(fields)
    for encode in (encode_recipe_key, encode_base_key):
        data = encode(recipe)
        value = json.loads(data)
        assert json.dumps(value, sort_keys=True, separators=(",", ":")).encode() == data
        assert list(value) == [f.name for f in KEY_FIELDS]
    assert recipe._identity() == sha256_hex(encode_recipe_key(recipe))
    if recipe.target != "auto" and recipe.toolchain is not None:
        assert recipe.key() == sha256_hex(canonical(recipe.key_material()))
        material = recipe.key_material(with_header_contents=False)
        assert recipe.base_key() == sha256_hex(canonical(material))
        assert material["headers"] == sorted(recipe.headers)
        assert recipe.key_material()["headers"] == recipe.header_hashes()


def canonical(value: object) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


# One change per recipe field, from _EVERY_FIELD (or the base named): each changes both
# keys. A field added to the recipe must be named here, and so shown to enter the keys.
_NO_LINK = {**_EVERY_FIELD, "link": []}
_FIELD_CHANGES: dict[str, tuple[dict[str, object], dict[str, object]]] = {
    "source": (_EVERY_FIELD, {"source": "other"}),
    "name": (_EVERY_FIELD, {"name": "other.cu"}),
    "headers": (_EVERY_FIELD, {"headers": {"a.h": "1\n"}}),
    "flags": (_EVERY_FIELD, {"flags": ["-dopt=on", "-lineinfo", '-DNAME="a b"']}),
    "target": (_EVERY_FIELD, {"target": "sm_90"}),
    "output": ({**_NO_LINK, "lto": False}, {"output": "ptx"}),
    "name_expressions": (_EVERY_FIELD, {"name_expressions": ["k<float, 256>"]}),
    "specialization": (_EVERY_FIELD, {"specialization": {"block": 256}}),
    "link": (_EVERY_FIELD, {"link": [{"digest": "cd" * 32}]}),
    "lto": (_NO_LINK, {"lto": False}),
    "toolchain": (_EVERY_FIELD, {"toolchain": "nvrtc-13.6"}),
    "include_sets": (_EVERY_FIELD, {"include_sets": [_CUB]}),
}


def test_every_field_of_a_recipe_is_a_member_of_its_keys() -> None:
    """The one table (kcache.keys.KEY_FIELDS) holds every field: the class's, the JSON form's."""
    assert {f.name for f in dataclasses.fields(Recipe) if f.init} == set(RECIPE_FIELDS)
    assert set(Recipe.from_dict(_EVERY_FIELD).to_dict()) == set(RECIPE_FIELDS)
    assert [f.name for f in KEY_FIELDS if not f.recipe_field] == ["kind", "schema"]
    with pytest.raises(RecipeError) as caught:
        Recipe.from_dict({"source": "x", "kind": "base"})  # a member the key adds itself
    assert caught.value.field == "kind"
    assert set(_FIELD_CHANGES) == set(RECIPE_FIELDS), "name a change of the new field here"
    for name, (base, change) in _FIELD_CHANGES.items():
        before, after = Recipe.from_dict(base), Recipe.from_dict({**base, **change})
        assert after.key() != before.key(), name
        assert after.base_key() != before.base_key(), name


def test_the_encoder_is_the_table_walked() -> None:
    """A member added to the table is written, in its place; a table out of order is refused."""
    from kcache import keys

    recipe = Recipe.from_dict(_EVERY_FIELD)
    object.__setattr__(recipe, "zzz", "added")  # a field the table would read
    table = (
        *KEY_FIELDS,
        KeyField("zzz", keys._string),
        KeyField("zzzz", "[1]", recipe_field=False),
    )
    data = keys._encoder(table, base=False)(recipe)
    assert data == encode_recipe_key(recipe)[:-1] + b',"zzz":"added","zzzz":[1]}'
    with pytest.raises(ValueError, match="sorted order"):
        keys._encoder((KEY_FIELDS[1], KEY_FIELDS[0]), base=False)


def test_a_copy_with_defaults_keeps_the_header_hashes_and_keys_alike() -> None:
    auto = Recipe(source=VECTOR_ADD, headers={"a.h": "1", "b.h": "2"})
    hashes = auto.header_hashes()
    copy = auto.with_defaults(target="sm_80", toolchain="t")
    assert copy._header_hashes() is auto._header_hashes()  # hashed once
    assert copy.header_hashes() == hashes
    fresh = Recipe(
        source=VECTOR_ADD, headers={"b.h": "2", "a.h": "1"}, target="sm_80", toolchain="t"
    )
    assert copy.key() == fresh.key() and copy.base_key() == fresh.base_key()


_NAMES = [
    "a.h",
    "dir/b.cuh",
    "x",
    "a" * 256,
    "a" * 257,
    "",
    ".",
    "..",
    "a/..",
    "../a",
    "a/./b",
    "a//b",
    "a/",
    "/abs",
    "a\\b",
    "a\nb",
    "a\n",
    "\nb",
    "é.h",
    "a\x00",
    "-a",
    "+a",
    "_a",
    ".hidden",
    "a/.b",
    "a/..b",
    "a..",
    "a/...",
    "a b",
    5,
    None,
]
_TEXTS = ["", "x", "é", "\ud800", "a\x00b", "t" * 10, 7]


def _headers_outcome(headers: dict[object, object]) -> str:
    """What checking ``headers`` says, never answered by a header set checked before."""
    from kcache import recipe as recipe_module

    recipe_module._HEADER_SETS.clear()
    try:
        Recipe(source="x", headers=headers)  # type: ignore[arg-type]
    except RecipeError as exc:
        return f"{exc.field}: {exc.detail}"
    finally:
        recipe_module._HEADER_SETS.clear()
    return "ok"


#: The names of _NAMES a header may have; every other one is refused, by name.
_GOOD_NAMES = {
    "a.h",
    "dir/b.cuh",
    "x",
    "a" * 256,
    "-a",
    "+a",
    "_a",
    "a/.b",
    "a/..b",
    "a..",
    "a/...",
}


def test_header_names_and_texts_are_checked_each_and_the_first_bad_one_named() -> None:
    for name in _NAMES:
        for text in _TEXTS:
            good = name in _GOOD_NAMES and text in ("", "x", "é", "t" * 10)
            for headers in ({name: text}, {"ok.h": "1", name: text, "z.h": "2"}):
                outcome = _headers_outcome(headers)
                assert (outcome == "ok") == good, (name, text, outcome)
                assert good or outcome.startswith(f"headers[{name!r}]: "), (name, text, outcome)


@pytest.mark.parametrize(
    ("name", "said"),
    [
        ("/abs/a.h", "not an absolute path"),
        ("a\\b.h", "holds a backslash: write its parts with '/'"),  # relative: not "absolute"
        ("../a.h", "must not contain '..'"),
    ],
)
def test_a_bad_header_name_is_told_what_is_wrong_with_it(name: str, said: str) -> None:
    assert said in _headers_outcome({name: "x"})


def test_the_headers_size_limits() -> None:
    from kcache.recipe import LIMITS

    half = LIMITS.header_bytes_total // 2
    assert _headers_outcome({"a.h": "x" * half, "b.h": "x" * half}) == "ok"  # at the total
    over = _headers_outcome({"a.h": "x" * half, "b.h": "x" * (half + 1)})
    assert over.startswith("headers: total size")
    assert "larger than the limit" in _headers_outcome({"a.h": "é" * (half + 1)})  # bytes over


def test_remembered_header_hashes_are_the_texts_hashes_and_stay_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import kcache.recipe as recipe_module

    headers = {f"h{i}.cuh": f"#define H{i} {i}\n" for i in range(12)}
    expected = {name: sha256_hex(text.encode()) for name, text in headers.items()}
    fields = {"source": VECTOR_ADD, "target": "sm_90", "toolchain": "tc", "headers": headers}
    cold = Recipe(**fields)  # type: ignore[arg-type]
    assert cold.header_hashes() == expected
    warm = Recipe(**fields)  # type: ignore[arg-type]  # its hashes are remembered ones
    assert warm.header_hashes() == expected and warm.key() == cold.key()
    # An edited header is a new text: a new hash and a new key, never the old one.
    edited = Recipe(**{**fields, "headers": {**headers, "h0.cuh": "#define H0 1\n"}})  # type: ignore[arg-type]
    assert edited.header_hashes()["h0.cuh"] == sha256_hex(b"#define H0 1\n")
    assert edited.key() != cold.key()

    monkeypatch.setattr(recipe_module, "_HEADER_SHA256_MAX_ENTRIES", 5)
    monkeypatch.setattr(recipe_module, "_HEADER_SHA256_MAX_CHARS", 64)
    recipe_module._HEADER_SHA256.clear()
    monkeypatch.setattr(recipe_module, "_header_sha256_chars", 0)
    many = {f"m{i}.cuh": f"// {i}\n" for i in range(40)} | {"big.cuh": "x" * 100}
    hashed = Recipe(**{**fields, "headers": many}).header_hashes()  # type: ignore[arg-type]
    assert hashed == {name: sha256_hex(text.encode()) for name, text in many.items()}
    assert len(recipe_module._HEADER_SHA256) <= 5
    assert "x" * 100 not in recipe_module._HEADER_SHA256  # above the byte bound: not kept
    assert sum(map(len, recipe_module._HEADER_SHA256)) <= 64


# ---------------------------------------------------------------- every way of building a recipe
# The canonical JSON is written from pieces kept per header set and per recipe (issue
# 13, B3); however a recipe is built, its keys must be the sha256 of the canonical JSON
# written here from its fields alone, and stay what earlier kcache versions computed.

_LINKED = {"source": "y", "output": "ltoir", "target": "sm_90", "toolchain": "nvrtc-13.5"}
_REFERENCE: dict[str, Any] = {
    "source": 'extern "C" __global__ void k() {}\n// é "quoted" \\ back\tslash\x01',
    "name": "dir/k.cu",
    "headers": {f"h{i:02d}/x.cuh": f"#define H{i} {i}\n// é\n" * (i + 1) for i in range(12)},
    "flags": ["-dopt=on", '-DNAME="a b"'],
    "target": "sm_90",
    "output": "cubin",
    "name_expressions": ["k<float, 256>"],
    "specialization": {"block": 256, "shape": [4, 8], "s": "a b", "on": True, "scale": 0.5},
    "link": [{"recipe": _LINKED}, {"digest": "ab" * 32}],
    "lto": True,
    "toolchain": "nvrtc-13.5",
    "include_sets": [_CUB],
}
# The key of _REFERENCE as kcache computed it before the canonical JSON was kept in
# pieces (commit 471d7c0): the bytes hashed must never change under a schema version.
_REFERENCE_KEY = "27e72ab3c5dfd3f2cfaf3a530e2230c6fd4ed84b632edd75cc413b5847bbecce"


def _reference_canonical(fields: dict[str, Any], *, with_header_contents: bool = True) -> bytes:
    """The canonical JSON of a recipe's fields (as in ``_REFERENCE``), written without ``Recipe``."""
    headers: dict[str, str] = fields.get("headers", {})
    material = {
        "schema": 2,
        "kind": "recipe" if with_header_contents else "base",
        "source": fields["source"],
        "name": fields.get("name", "kernel.cu"),
        "headers": {n: sha256_hex(t.encode()) for n, t in headers.items()}
        if with_header_contents
        else sorted(headers),
        "flags": fields.get("flags", []),
        "target": fields["target"],
        "output": fields.get("output", "cubin"),
        "name_expressions": fields.get("name_expressions", []),
        "specialization": fields.get("specialization", {}),
        "link": [
            {"recipe_key": sha256_hex(_reference_canonical(item["recipe"]))}
            if "recipe" in item
            else item
            for item in fields.get("link", [])
        ],
        "lto": fields.get("lto", False),
        "toolchain": fields["toolchain"],
        "include_sets": fields.get("include_sets", [])
        if with_header_contents
        else [entry.partition("@")[0] for entry in fields.get("include_sets", [])],
    }
    return json.dumps(material, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def _every_way(fields: dict[str, Any]) -> dict[str, Recipe]:
    """The same recipe, built every way there is (and twice where a second build is cheaper)."""
    as_json = json.dumps(fields)
    objects = {
        **fields,
        "link": [
            LinkInput(recipe=Recipe(**item["recipe"])) if "recipe" in item else LinkInput(**item)
            for item in fields["link"]
        ],
    }
    reversed_headers = dict(reversed(list(fields["headers"].items())))
    unresolved = json.loads(as_json)
    del unresolved["toolchain"], unresolved["link"][0]["recipe"]["toolchain"]
    unresolved["target"] = unresolved["link"][0]["recipe"]["target"] = "auto"
    from_dict = Recipe.from_dict(fields)
    return {
        "constructor": Recipe(**objects),
        "constructor again (header set found again)": Recipe(**objects),
        "from_dict": from_dict,
        "from_json (equal strings, new objects)": Recipe.from_json(as_json),
        "headers in another order": Recipe.from_dict({**fields, "headers": reversed_headers}),
        "with_defaults": Recipe.from_dict(unresolved).with_defaults(
            target="sm_90", toolchain="nvrtc-13.5"
        ),
        "pickled": pickle.loads(pickle.dumps(from_dict)),
        "dataclasses.replace": dataclasses.replace(from_dict),
        "to_dict round trip": Recipe.from_dict(from_dict.to_dict()),
    }


def test_keys_of_a_recipe_built_every_way_are_the_reference_canonical_jsons_sha256() -> None:
    key = sha256_hex(_reference_canonical(_REFERENCE))
    base_key = sha256_hex(_reference_canonical(_REFERENCE, with_header_contents=False))
    assert key == _REFERENCE_KEY
    for way, recipe in _every_way(_REFERENCE).items():
        assert recipe.key() == key, way
        assert recipe.base_key() == base_key, way
        assert encode_recipe_key(recipe) == _reference_canonical(_REFERENCE), way
        assert hash(recipe) == hash(Recipe.from_dict(_REFERENCE)), way
    # One header text changed: another key, computed from that text (not a remembered one).
    edited = {**_REFERENCE, "headers": {**_REFERENCE["headers"], "h03/x.cuh": "#define H3 4\n"}}
    for way, recipe in _every_way(edited).items():
        assert recipe.key() == sha256_hex(_reference_canonical(edited)) != key, way
        assert recipe.base_key() == base_key, way  # same names


# ---------------------------------------------------------------- golden keys
# Keys of recipes of every shape, as kcache computed them before the one key encoder
# (kcache.keys.KEY_FIELDS, issue 32): recipe_key, base_key and the identity that
# equality and hashing use. A stored artifact is found by these: they must never
# change under one KEY_SCHEMA (regenerated for schema 2: include sets pinned by contents).
_LINKED_LTOIR = {"source": "y", "output": "ltoir", "target": "compute_90", "toolchain": "t"}
_GOLDEN: dict[str, tuple[dict[str, Any], str | None, str | None, str]] = {
    "minimal": (
        {"source": "x", "target": "sm_80", "toolchain": "t"},
        "595dcb452ca32b0b5a5cd02ad13149dd9696b3394a1d6540b53bf1b115359c04",
        "cd2400a0300adb81ed2bfcf1385bcba3b513265fe10bea7553268f6831c4491f",
        "595dcb452ca32b0b5a5cd02ad13149dd9696b3394a1d6540b53bf1b115359c04",
    ),
    "ptx": (
        {"source": "x", "target": "compute_80", "output": "ptx", "toolchain": "t"},
        "cb0332ad022d36150f7e578289606417ab5757d6fa0de48b61b90290b72a28b8",
        "eef405dcce9820ceac2f178f9f8feb9dc1968d49ea19750bbfc985d17103710a",
        "cb0332ad022d36150f7e578289606417ab5757d6fa0de48b61b90290b72a28b8",
    ),
    "ltoir": (
        {"source": "x", "target": "sm_100a", "output": "ltoir", "toolchain": "t"},
        "61520f0854592c7cbb1063663c6485e8715a4a9316427973f06c0c095da4d255",
        "5f7cb061d6c953ff9daf8d8e09d3ba3c5ea1da4762020f561ebd4749f8371ee7",
        "61520f0854592c7cbb1063663c6485e8715a4a9316427973f06c0c095da4d255",
    ),
    "unresolved": (
        {"source": "x"},
        None,
        None,
        "6725f8c5d4ae744614464bfe7a4681a8bf316576d38c0fe657fcaaa29e9defec",
    ),
    "unresolved target": (
        {"source": "x", "toolchain": "t"},
        None,
        None,
        "966bde5e2e4b2825ec8e97f9270c2bf7c8adc7ea37a1d2b11e0ab9cbfd935e67",
    ),
    "every field": (
        {
            "source": 'extern "C" __global__ void k() {}\n// \u00e9 \u4e2d "quoted" \\ back\tslash'
            "\x01\x7f\u2028\U0001f600",
            "target": "sm_90a",
            "name": "dir/k+1.cu",
            "headers": {"b/x.cuh": "2 \u00e9", "a.h": "1\n", "c+d-e_f.hpp": "", "Z.h": "\x1f"},
            "flags": ["-dopt=on", '-DNAME="a b"', "-lineinfo", "-DU=\u00e9"],
            "name_expressions": ["k<float, 256>", "ns::k2", "\u00e9"],
            "specialization": {
                "dtype": "torch.FP16",
                "block": 256,
                "scale": 0.5,
                "on": True,
                "off": False,
                "s": "a b",
                "shape": [4, 8],
                "z": [1, 2.5, True, "q"],
                "big": 10**30,
                "neg": -7,
                "tiny": 1e-300,
                "huge": 1e300,
                "nz": -0.0,
            },
            "lto": True,
            "link": [
                {"recipe": _LINKED_LTOIR},
                {"digest": "ab" * 32},
                {
                    "recipe": {
                        "source": "w",
                        "output": "ltoir",
                        "target": "sm_90",
                        "toolchain": "t2",
                        "lto": False,
                        "headers": {"w.h": "w"},
                    }
                },
            ],
            "toolchain": "nvrtc-13.5+x_y.z",
            "include_sets": [_CUB, _LIB2],
        },
        "94eed3056e3255903a8383f604f5e74b18a1f5565ca50c41637673317ac5d2c4",
        "6b706854742521772bfbc639d7918d758fa9c9c08e73b3f6804e7496bcde4246",
        "94eed3056e3255903a8383f604f5e74b18a1f5565ca50c41637673317ac5d2c4",
    ),
    "nested links": (
        {
            "source": "outer",
            "target": "sm_90",
            "toolchain": "t",
            "lto": True,
            "link": [
                {
                    "recipe": {
                        "source": "mid",
                        "target": "sm_90",
                        "toolchain": "t",
                        "output": "cubin",
                        "lto": True,
                        "link": [
                            {
                                "recipe": {
                                    "source": "in",
                                    "target": "compute_90",
                                    "output": "ltoir",
                                    "toolchain": "t",
                                }
                            }
                        ],
                    }
                }
            ],
        },
        "40a8156c98249a63d6d6b258fde4b028bc8756db4a2f374d2f1bd0d5d28475ef",
        "35ecd002557f77d21aa0d21b73d1343cbe3998838802e05a5755e2997faa6f78",
        "40a8156c98249a63d6d6b258fde4b028bc8756db4a2f374d2f1bd0d5d28475ef",
    ),
    "sm_120f and flags": (
        {
            "source": "k",
            "target": "sm_120f",
            "toolchain": "tc",
            "flags": ["--std=c++17", "-G", "--maxrregcount=128", "-UFOO"],
        },
        "ef3fa42c29ba7f3f318c3098e4bf4b30e44bc1e95ef6bc181385409279b03bd8",
        "3125d2fb5de6ed2f4654355f34b4403c2e0c0cb69a906dcf713490eb3d6ea343",
        "ef3fa42c29ba7f3f318c3098e4bf4b30e44bc1e95ef6bc181385409279b03bd8",
    ),
}


@pytest.mark.parametrize("label", list(_GOLDEN))
def test_keys_are_the_golden_keys(label: str) -> None:
    fields, key, base_key, identity = _GOLDEN[label]
    recipe = Recipe.from_dict(fields)
    assert recipe._identity() == identity
    assert hash(recipe) == hash(identity)
    if key is None:
        with pytest.raises(UnresolvedRecipeError):
            recipe.key()
        return
    assert (recipe.key(), recipe.base_key()) == (key, base_key)
    assert sha256_hex(canonical(recipe.key_material())) == key
    assert sha256_hex(canonical(recipe.key_material(with_header_contents=False))) == base_key


# ---------------------------------------------------------------- header sets found again


def test_an_equal_header_set_is_found_again_and_the_recipe_holds_the_checked_one() -> None:
    headers = {f"s{i}.cuh": f"// set {i}\n" * 5 for i in range(6)}
    first = Recipe(source="x", headers=headers)
    # Equal names and texts in new string objects (as every request body brings them).
    copied = {"".join(list(n)): "".join(list(t)) for n, t in headers.items()}
    again = Recipe(source="x", headers=copied)
    assert again.headers is first.headers  # the set checked before, frozen once
    assert again._header_hashes() is first._header_hashes()  # hashed once
    assert again == first and hash(again) == hash(first)

    class Liar(str):
        """A name that claims to equal a checked one."""

        def __eq__(self, other: object) -> bool:
            return True

        def __hash__(self) -> int:
            return hash(self.target)

        target = "s0.cuh"

    lying = {
        Liar("../../etc/passwd"): headers["s0.cuh"],
        **{k: headers[k] for k in list(headers)[1:]},
    }
    try:
        taken = Recipe(source="x", headers=lying)
    except RecipeError:
        return  # refused: as safe
    assert dict(taken.headers) == headers  # else the checked strings, never the liar's own
    assert all(type(name) is str for name in taken.headers)


def test_a_refused_header_set_is_refused_every_time_and_never_kept() -> None:
    from kcache import recipe as recipe_module

    bad = {"ok.h": "1", "../up.h": "2"}
    kept = len(recipe_module._HEADER_SETS)
    for _ in range(3):
        with pytest.raises(RecipeError) as caught:
            Recipe(source="x", headers=bad)
        assert caught.value.field == "headers['../up.h']"
    unhashable = {"ok.h": ["not", "text"]}
    for _ in range(2):
        with pytest.raises(RecipeError, match="must be a string"):
            Recipe(source="x", headers=unhashable)  # type: ignore[arg-type]
    assert len(recipe_module._HEADER_SETS) == kept
