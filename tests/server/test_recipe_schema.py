"""The published schema states what the server enforces: each pattern against the check it states.

The recipe schema's patterns are the core's own regexes, written once in a syntax
Python's ``re`` and ECMA-262 read alike (:mod:`kcache_server.recipe_schema`), so what
is left to check is that reading: each pattern of the recipe schema, of keys and labels
(:mod:`kcache_server.schemas`) and of the stats times is evaluated as a schema-driven
client evaluates it (``jsonschema_rs``, ECMA-262 semantics: ``$`` ends the string) and
compared, on generated strings that reach every branch and on hostile ones, with the
core's or the server's own check. ``/openapi.json`` publishes those very regexes. Then
the fields and limits: the schema's properties are the core's one table of fields, and
every limit of :data:`kcache.recipe.LIMITS`, of the specialization and every
request-bounding setting appears in ``/openapi.json`` with its value, so a new field or
limit cannot go unpublished.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kcache_server.auditing.query_times import parse_time
from kcache_server.errors import InvalidRequestError
from kcache_server.recipe_schema import (
    DTYPE_PATTERN,
    FLAG_PATTERN,
    INCLUDE_NAME_PATTERN,
    LINE_PATTERN,
    SPEC_KEY_PATTERN,
    SPEC_STRING_PATTERN,
    recipe_components,
    target_pattern,
)
from kcache_server.schemas import HEX_KEY_PATTERN

from kcache import specialization
from kcache.errors import RecipeError
from kcache.keys import HEX_KEY_REGEX, RECIPE_FIELDS, is_hex_key
from kcache.recipe import ALLOWED_FLAGS, INCLUDE_NAME_REGEX, LIMITS, Recipe, check_include_name
from kcache.targets import parse_target, target_regex

SMS = (75, 80, 90, 100, 120)
_FAST = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def published(schema: dict[str, Any]) -> Callable[[object], bool]:
    """``schema`` as a schema-driven client checks it (formats included)."""
    # Imported here: a test run without jsonschema_rs (schemathesis brings it; the GPU
    # image has neither) still collects this module, and only these tests skip.
    jsonschema_rs = pytest.importorskip("jsonschema_rs", reason="needs jsonschema_rs")
    is_valid: Callable[[object], bool] = jsonschema_rs.validator_for(
        schema, validate_formats=True
    ).is_valid
    return is_valid


def accepts(check: Callable[[], object]) -> bool:
    """Whether ``check()`` passes the core's validation."""
    try:
        check()
    except (RecipeError, InvalidRequestError):
        return False
    return True


def _pieces(*words: str) -> st.SearchStrategy[str]:
    """Strings joined from ``words`` and single awkward characters: every branch, and its near misses."""
    awkward = [
        "",
        " ",
        "\n",
        "\t",
        "\x00",
        "\x7f",
        "\x85",
        "é",
        "/",
        ".",
        "-",
        "_",
        "0",
        "9",
        "a",
        "Z",
    ]
    return st.lists(st.sampled_from([*words, *awkward]), max_size=8).map("".join)


@_FAST
@given(_pieces("a", "..", ".", "/", "b.h", "+", "x-y", "\\"))
def test_include_name_pattern_is_check_include_name(name: str) -> None:
    schema = {"type": "string", "maxLength": LIMITS.name_chars, "pattern": INCLUDE_NAME_PATTERN}
    assert published(schema)(name) == accepts(lambda: check_include_name("name", name)), repr(name)


_FLAG_WORDS = (
    "-D",
    "-U",
    "--define-macro=",
    "--undefine-macro=",
    "-O",
    "3",
    "-std=c++",
    "17",
    "--maxrregcount=",
    "128",
    "-I",
    "--ftz=",
    "true",
    "-arch=sm_80",
    "--diag-suppress=",
    "1,2",
    "X=1",
)


@_FAST
@given(_pieces(*_FLAG_WORDS))
def test_flag_pattern_is_the_core_flag_check(flag: str) -> None:
    schema = {"type": "string", "maxLength": LIMITS.flag_chars, "pattern": FLAG_PATTERN}
    core = accepts(lambda: Recipe(source="", target="sm_80", flags=[flag]))
    assert published(schema)(flag) == core, repr(flag)


@_FAST
@given(_pieces("A", "b", "_", "1", "KEY", "x" * 63))
def test_specialization_key_pattern(key: str) -> None:
    core = accepts(lambda: specialization.normalize_specialization({key: 1}))
    assert published({"type": "string", "pattern": SPEC_KEY_PATTERN})(key) == core, repr(key)


@_FAST
@given(_pieces("a b", "<", ">", ",", "*", "(", ")", ":", "+", "x" * 200))
def test_specialization_string_pattern(value: str) -> None:
    core = accepts(lambda: specialization.normalize_specialization({"v": value}))
    schema = {"type": "string", "maxLength": 256, "pattern": SPEC_STRING_PATTERN}
    assert published(schema)(value) == core, repr(value)


@_FAST
@given(_pieces(*specialization.DTYPES, "torch.", "numpy.", "Torch.", "FLOAT", "Half", "bf", "16"))
def test_dtype_pattern_is_canonical_dtype(dtype: str) -> None:
    core = accepts(lambda: specialization.canonical_dtype(dtype))
    assert published({"type": "string", "pattern": DTYPE_PATTERN})(dtype) == core, repr(dtype)


@_FAST
@given(_pieces("sm_", "compute_", "80", "75", "0", "100", "120", "999", "a", "f", "auto"))
def test_target_pattern_is_parse_target_and_the_toolchains_sms(target: str) -> None:
    def check() -> None:
        parsed = parse_target(target)
        if parsed.sm not in SMS:
            raise RecipeError("target", "not supported")

    schema = {"type": "string", "pattern": target_pattern(SMS)}
    assert published(schema)(target) == accepts(check), repr(target)


# Strings that one engine or one careless pattern would take: a trailing newline ("$"
# in Python), non-ASCII digits (a Unicode "\d"), a leading zero (sm_090 would name
# SM 90 under another key), case, padding, and near misses of each part.
_HOSTILE_TARGETS = [
    "sm_90",
    "sm_90a",
    "sm_90f",
    "sm_75a",  # no architecture-specific target below sm_90a (schemathesis found it)
    "compute_89a",
    "sm_100f",
    "sm_100a",
    "compute_120f",
    "compute_90",
    "compute_90a",
    "sm_100",
    "sm_999",
    "sm_90\n",
    "sm_90\r",
    "\nsm_90",
    "sm_90 ",
    " sm_90",
    "sm_90\x00",
    "sm_\u0669\u0660",  # Arabic-Indic 90
    "sm_\uff19\uff10",  # fullwidth 90
    "sm_9\u0660",
    "sm_090",
    "sm_0",
    "sm_00",
    "sm_9",
    "sm_1000",
    "SM_90",
    "Sm_90",
    "sm_90A",
    "sm_90af",
    "sm_90b",
    "sm-90",
    "sm90",
    "sm_",
    "_90",
    "",
    "auto",
    "compute_",
    "computesm_90",
    "sm|compute_90",
]


def _supported(target: str, sms: tuple[int, ...] | None) -> bool:
    """What the core says of ``target``, on a toolchain of ``sms`` (None: any)."""
    try:
        parsed = parse_target(target)
    except RecipeError:
        return False
    return sms is None or parsed.sm in sms


def test_the_one_target_grammar_means_the_same_in_both_dialects() -> None:
    """kcache.targets.target_regex as Python's re and as ECMA-262 (a JSON Schema) read it."""
    for sms in (None, SMS, (90,), ()):
        text = target_regex(sms)
        ecma = published({"type": "string", "pattern": f"^(?:{text})$"})
        for target in _HOSTILE_TARGETS:
            python = re.fullmatch(text, target) is not None
            assert python == ecma(target) == _supported(target, sms), (target, sms)


@pytest.mark.parametrize(
    "key",
    [
        "ab" * 32,
        "0" * 64,
        "ab" * 32 + "\n",
        "\n" + "ab" * 32,
        "AB" * 32,
        "ab" * 31 + "a",
        "ab" * 32 + "a",
        "\u0661" * 64,  # Arabic-Indic digits
        "\uff10" * 64,  # fullwidth digits
        "g" * 64,
        " " + "a" * 63,
        "",
    ],
    ids=ascii,
)
def test_the_hex_key_pattern_is_the_cores_key_check(key: str) -> None:
    python = re.fullmatch(HEX_KEY_REGEX, key) is not None
    assert (
        published({"type": "string", "pattern": HEX_KEY_PATTERN})(key) == python == is_hex_key(key)
    )


@_FAST
@given(_pieces("k<float, 256>", "ns::k", "\x1f", "\x9f", "\xa0", "\u2028", "\r"))
def test_line_pattern_is_the_name_expression_check(expression: str) -> None:
    schema = {"type": "string", "pattern": LINE_PATTERN}
    core = accepts(lambda: Recipe(source="", name_expressions=[expression]))
    assert published(schema)(expression) == core, repr(expression)


@pytest.mark.parametrize(
    "label",
    ["job-1", "", "a b", "é中", "\u2028", "\xa0", "a\n", "\x00", "\x1f", "\x7f", "\x85", "\x9f"],
    ids=ascii,
)
def test_the_printable_pattern_is_the_label_check(label: str) -> None:
    from kcache_server.schemas import PRINTABLE_PATTERN, check_label

    try:
        check_label(label)
        server = True
    except ValueError:  # pydantic's PydanticCustomError
        server = False
    assert published({"type": "string", "pattern": PRINTABLE_PATTERN})(label) == server


def test_the_schema_publishes_exactly_the_recipe_fields_of_the_one_table(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its properties are kcache.keys.RECIPE_FIELDS, in order; a field it lacks fails the build."""
    from kcache_server import recipe_schema

    components = recipe_components(sms=SMS, toolchains=["t"], include_sets=[])
    for name in ("Recipe", *(f"LinkedRecipe{n}" for n in range(1, LIMITS.link_depth + 1))):
        for variant in components[name]["anyOf"]:
            assert list(variant["properties"]) == list(RECIPE_FIELDS), name
    monkeypatch.setattr(recipe_schema, "RECIPE_FIELDS", (*RECIPE_FIELDS, "new_field"))
    with pytest.raises(RuntimeError, match=r"no schema for \['new_field'\]"):
        recipe_components(sms=SMS, toolchains=["t"], include_sets=[])
    monkeypatch.setattr(recipe_schema, "RECIPE_FIELDS", RECIPE_FIELDS[1:])
    with pytest.raises(RuntimeError, match="fields a recipe has not"):
        recipe_components(sms=SMS, toolchains=["t"], include_sets=[])


def _time_forms() -> dict[str, Any]:
    from kcache_server.routes.stats import _TIME_FORMS

    return {"type": "string", "maxLength": 64, **_TIME_FORMS}


_TIME_WORDS = (
    "1700000000",
    "253402300799",
    "253402300800",
    ".5",
    ".000",
    "-",
    "15m",
    "999999999s",
    "9999999999s",
    "7d",
    "99999d",
    "2024-05-01",
    "1969-12-31",
    "9999-12-31",
    "2024-02-30",
    "T",
    "t",
    "10:00:00",
    "23:59:60",
    "24:00:00",
    "Z",
    "z",
    "+05:30",
    "-05:00",
    "+24:00",
)


@_FAST
@given(_pieces(*_TIME_WORDS))
def test_stats_time_forms_are_parse_time(value: str) -> None:
    core = accepts(lambda: parse_time(value, "since"))
    assert published(_time_forms())(value) == core, repr(value)


@pytest.mark.parametrize(
    ("value", "ok"),
    [
        ("253402300799", True),
        ("253402300799.0", True),
        ("253402300799.5", False),
        ("1795984519.2868872", True),  # str(time.time())
        ("2016-12-31T23:59:60Z", True),  # a leap second
        ("2016-12-31T22:59:60Z", False),
        ("2024-05-01T10:00:00", False),  # no offset: not RFC 3339
        ("9999-12-31T23:59:59-05:00", False),  # past the year 9999 in UTC
        ("", True),
        ("15m\n", False),
    ],
)
def test_stats_time_edges(value: str, ok: bool) -> None:
    assert accepts(lambda: parse_time(value, "since")) is ok
    assert published(_time_forms())(value) is ok


# ---------------------------------------------------------------------- the limits
#: Where each LIMITS field appears in the published components (a JSON pointer and its value).
_LIMIT_PLACES = {
    "source_bytes": ("RecipeSource", "maxLength"),
    "header_count": ("RecipeHeaders", "maxProperties"),
    "header_bytes_total": ("RecipeHeaders", "additionalProperties", "maxLength"),
    "name_chars": ("RecipeName", "maxLength"),
    "flag_count": ("RecipeFlags", "maxItems"),
    "flag_chars": ("RecipeFlags", "items", "maxLength"),
    "name_expressions": ("RecipeNameExpressions", "maxItems"),
    "name_expression_bytes": ("RecipeNameExpressions", "items", "maxLength"),
    "link_inputs": ("Recipe", "anyOf", 0, "properties", "link", "maxItems"),
    "include_sets": ("RecipeIncludeSets", "maxItems"),
}


def _at(node: Any, *path: Any) -> Any:
    for part in path:
        node = node[part]
    return node


@dataclasses.dataclass
class Published:
    """An app's ``/openapi.json``, with the settings and toolchain it was built from."""

    document: dict[str, Any]
    settings: Any
    toolchain: Any


@pytest.fixture(scope="module")
def published_app(tmp_path_factory: pytest.TempPathFactory) -> Published:
    """``/openapi.json`` of an app whose request limits are not the defaults (no server needed)."""
    from kcache_server import Settings, create_app

    settings = Settings(
        data_dir=Path(tmp_path_factory.mktemp("limits")) / "data",
        compile_workers=1,
        max_batch=7,
        max_request_bytes=1 << 20,
        audit={"max_events_per_batch": 3, "max_clock_skew_s": 60.0},
        include_sets={"cutlass": str(tmp_path_factory.mktemp("cutlass"))},
    )
    app = create_app(settings)
    return Published(app.openapi(), settings, app.state.kcache.backends.toolchain)


def test_every_recipe_limit_is_published(published_app: Published) -> None:
    components = published_app.document["components"]["schemas"]
    assert set(_LIMIT_PLACES) | {"link_depth"} == {f.name for f in dataclasses.fields(LIMITS)}, (
        "a new recipe limit: publish it in kcache_server.recipe_schema and name its place here"
    )
    for name, path in _LIMIT_PLACES.items():
        assert _at(components, *path) == getattr(LIMITS, name), name
    levels = [k for k in components if k.startswith("LinkedRecipe")]
    assert len(levels) == LIMITS.link_depth
    deepest = components[f"LinkedRecipe{LIMITS.link_depth}"]["anyOf"][0]["properties"]["link"]
    assert [set(item["properties"]) for item in deepest["items"]["oneOf"]] == [{"digest"}]
    spec = components["RecipeSpecialization"]
    assert spec["maxProperties"] == specialization.MAX_KEYS
    assert spec["properties"]["shape"]["maxItems"] == specialization.MAX_LIST
    assert str(specialization.MAX_RENDERED_BYTES) in spec["description"]


def test_the_servers_own_toolchain_targets_and_include_sets_are_published(
    published_app: Published,
) -> None:
    components = published_app.document["components"]["schemas"]
    toolchain = published_app.toolchain
    assert components["RecipeToolchain"]["enum"] == [toolchain.id, None]
    set_entry = published(components["RecipeIncludeSets"]["items"])
    assert set_entry("cutlass") and set_entry("cutlass@" + "a" * 64)  # by name, or pinned
    assert not set_entry("other") and not set_entry("cutlass@" + "A" * 64)
    assert not set_entry("cutlass@" + "a" * 63) and not set_entry("cutlass@")
    valid = published({"type": "string", "pattern": components["Target"]["pattern"]})
    assert all(valid(f"sm_{sm}") and valid(f"compute_{sm}") for sm in toolchain.supported_sms)
    assert not valid("sm_10") and not valid("sm_80\n")


def test_the_published_patterns_are_the_cores_regexes(published_app: Published) -> None:
    """``/openapi.json`` states the core's grammar itself: its regexes, anchored, nothing restated."""
    components = published_app.document["components"]["schemas"]
    name = f"^(?:{INCLUDE_NAME_REGEX})$"
    assert components["RecipeName"]["pattern"] == name
    assert components["RecipeHeaders"]["propertyNames"]["pattern"] == name
    assert components["RecipeFlags"]["items"]["pattern"] == f"^(?:{ALLOWED_FLAGS.pattern})$"
    sms = published_app.toolchain.supported_sms
    assert components["Target"]["pattern"] == f"^(?:{target_regex(sms)})$"


def test_every_request_limit_setting_is_published(published_app: Published) -> None:
    from kcache_server.serving.openapi import REQUEST_LIMITS, setting_value

    document, settings = published_app.document, published_app.settings
    assert document["info"]["x-limits"] == {n: setting_value(settings, n) for n in REQUEST_LIMITS}
    paths = document["paths"]

    def body(path: str) -> dict[str, Any]:
        schema: dict[str, Any] = paths[path]["post"]["requestBody"]["content"]["application/json"][
            "schema"
        ]
        return schema

    assert body("/v1/resolve/batch")["properties"]["recipes"]["maxItems"] == 7
    events = body("/v1/events")["properties"]["events"]
    assert events["maxItems"] == 3
    assert events["items"]["properties"]["time"]["x-max-clock-skew-s"] == 60.0
    assert body("/v1/resolve")["properties"]["recipe"] == {"$ref": "#/components/schemas/Recipe"}
    from kcache_server.schemas import RECIPE_MARK, SETTING_MARK

    text = str(document)
    assert SETTING_MARK not in text and RECIPE_MARK not in text  # every mark was filled in
