"""The JSON Schema of a recipe as this server accepts it: the core's checks, stated for clients.

A recipe is validated by the core (:meth:`kcache.recipe.Recipe.from_dict`, then
:meth:`kcache_server.recipe_checks.RecipeChecks.prepare`), with its own messages. This
module states the same rules for the published OpenAPI document, built from the
core's own table of a recipe's fields (:data:`kcache.keys.RECIPE_FIELDS`: what the
keys hash, so exactly the properties published), limits and patterns
(:data:`kcache.recipe.LIMITS`, :data:`kcache.recipe.ALLOWED_FLAGS`,
:data:`kcache.recipe.INCLUDE_NAME_REGEX`, the target grammar
:func:`kcache.targets.target_regex`, :mod:`kcache.specialization`) and
from what this server runs: its toolchain id, the targets its NVRTC compiles for,
and its registered include sets. So the schema allows exactly what the server
takes, with these exceptions that JSON Schema cannot state (each is said in the
field's description, and refused with a 422 naming the field):

- sizes in bytes of UTF-8: ``maxLength`` counts characters, so it is the bound for
  ASCII text and a looser one otherwise; the headers' total size;
- a specialization's macros: two keys that render to one macro (``n`` and ``N``
  are both ``KC_N``), and their rendered size in all.

The cross-field rules are stated as three variants (``anyOf``), each a closed object:
a cubin linked with nvJitLink (``lto: true``, ``link`` allowed), a plain cubin
(``sm_XX`` target), and PTX or LTO-IR (any target, no link). Linked recipes nest
:attr:`~kcache.recipe.LIMITS.link_depth` deep, one schema per level (``LinkedRecipe1``
...), the deepest linking digests only.

Every pattern is the core's own regex, written once in the syntax that means the same
in Python's ``re``, Rust's ``regex`` and JavaScript (explicit classes instead of
``\\S``, ``\\d`` or ``.``), anchored with ``^...$``; nothing here restates or
translates a rule. ``tests/server/test_recipe_schema.py`` checks that ECMA-262 reads
each one as the core's check does.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

from kcache import specialization
from kcache.keys import RECIPE_FIELDS
from kcache.recipe import ALLOWED_FLAGS, CONTROL_CHARACTERS, INCLUDE_NAME_REGEX, LIMITS
from kcache.targets import TARGET_FAMILIES, target_regex
from kcache_server.schemas import HEX_KEY_PATTERN

__all__ = [
    "DTYPE_PATTERN",
    "FLAG_PATTERN",
    "INCLUDE_NAME_PATTERN",
    "LINE_PATTERN",
    "NO_NUL_PATTERN",
    "SPEC_KEY_PATTERN",
    "SPEC_STRING_PATTERN",
    "recipe_components",
    "target_pattern",
]

#: An include name (and a program ``name``): :data:`kcache.recipe.INCLUDE_NAME_REGEX`.
INCLUDE_NAME_PATTERN = f"^(?:{INCLUDE_NAME_REGEX})$"
#: Text without a NUL (``source``, header texts).
NO_NUL_PATTERN = "^[^\\x00]*$"
#: A single line of recipe text (a name expression): no C0 or C1 control character.
LINE_PATTERN = f"^[^{CONTROL_CHARACTERS}]*$"
#: A flag the core allows (:data:`kcache.recipe.ALLOWED_FLAGS`), on one line.
FLAG_PATTERN = f"^(?:{ALLOWED_FLAGS.pattern})$"
#: A specialization key (``kcache.specialization``).
SPEC_KEY_PATTERN = f"^(?:{specialization.KEY_RE.pattern})$"
#: A string value of a specialization.
SPEC_STRING_PATTERN = f"^(?:{specialization.STRING_VALUE_RE.pattern})$"


def _any_case(word: str) -> str:
    """``word`` as a pattern that ignores case (ECMA-262 has no inline ``(?i)``)."""
    return "".join(
        f"[{c.lower()}{c.upper()}]" if c.isalpha() else re.escape(c).replace("\\-", "-")
        for c in word
    )


# canonical_dtype: "torch." then "numpy." stripped (as written), then any case.
_DTYPE_NAMES = sorted({*specialization.DTYPES, *specialization.DTYPE_ALIASES})
#: A ``specialization.dtype`` that :func:`kcache.specialization.canonical_dtype` accepts.
DTYPE_PATTERN = (
    "^(?:torch\\.)?(?:numpy\\.)?(?:" + "|".join(_any_case(n) for n in _DTYPE_NAMES) + ")$"
)


def target_pattern(sms: Iterable[int], *, families: Sequence[str] = TARGET_FAMILIES) -> str:
    """Targets naming one of ``sms``: ``sm_XX``, ``sm_XXa``, ``sm_XXf`` (and ``compute_XX...``).

    The core's own grammar (:func:`kcache.targets.target_regex`, which
    :func:`~kcache.targets.parse_target` matches), narrowed to ``sms``, anchored.
    """
    return f"^(?:{target_regex(sms, families=families)})$"


def _text(limit: int, pattern: str, what: str) -> dict[str, Any]:
    return {
        "type": "string",
        "maxLength": limit,
        "pattern": pattern,
        "description": f"{what}; at most {limit} bytes of UTF-8",
    }


def _specialization_schema() -> dict[str, Any]:
    scalar: dict[str, Any] = {
        "anyOf": [
            {"type": "boolean"},
            {"type": "number"},
            {"type": "string", "maxLength": 256, "pattern": SPEC_STRING_PATTERN},
        ]
    }
    integers = {"type": "array", "maxItems": specialization.MAX_LIST, "items": {"type": "integer"}}
    return {
        "type": "object",
        "maxProperties": specialization.MAX_KEYS,
        "propertyNames": {"pattern": SPEC_KEY_PATTERN},
        "properties": {
            "dtype": {
                "type": "string",
                "pattern": DTYPE_PATTERN,
                "description": "rendered as KC_DTYPE: "
                + ", ".join(f"{k} ({v})" for k, v in specialization.DTYPES.items()),
            },
            "shape": {**integers, "description": "rendered as KC_NDIM and KC_SHAPE_0..."},
            "strides": {**integers, "description": "rendered as KC_STRIDE_0..."},
        },
        "additionalProperties": {
            "anyOf": [
                scalar,
                {"type": "array", "maxItems": specialization.MAX_LIST, "items": scalar},
            ]
        },
        "description": (
            "named values rendered as KC_<KEY> macros (lists as KC_<KEY>_0...). Also refused "
            "(422, not stated by the schema): two keys that render to one macro, and macros of "
            f"more than {specialization.MAX_RENDERED_BYTES} bytes in all"
        ),
    }


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _shared_fields(
    sms: Sequence[int], toolchains: Sequence[str], include_sets: Sequence[str]
) -> dict[str, dict[str, Any]]:
    """Components for what every recipe level shares: its fields' schemas and the two target kinds."""
    return {
        "RecipeSource": _text(LIMITS.source_bytes, NO_NUL_PATTERN, "CUDA C++ text, without NUL"),
        "RecipeName": {
            "type": "string",
            "maxLength": LIMITS.name_chars,
            "pattern": INCLUDE_NAME_PATTERN,
            "default": "kernel.cu",
            "description": (
                "the program name given to NVRTC (it changes the output bytes): relative, "
                "letters, digits and _.+-/, no '.', '..' or empty parts"
            ),
        },
        "RecipeHeaders": {
            "type": "object",
            "maxProperties": LIMITS.header_count,
            "propertyNames": {"maxLength": LIMITS.name_chars, "pattern": INCLUDE_NAME_PATTERN},
            "additionalProperties": _text(
                LIMITS.header_bytes_total, NO_NUL_PATTERN, "the header's text, without NUL"
            ),
            "description": (
                "in-memory headers: include name (as `name`) -> text; at most "
                f"{LIMITS.header_bytes_total} bytes of text in all"
            ),
        },
        "RecipeFlags": {
            "type": "array",
            "maxItems": LIMITS.flag_count,
            "items": _text(
                LIMITS.flag_chars, FLAG_PATTERN, "an NVRTC option that reads and writes no file"
            ),
            "description": "NVRTC options, order kept (-arch is `target`, -dlto is `output`/`lto`)",
        },
        "RecipeNameExpressions": {
            "type": "array",
            "maxItems": LIMITS.name_expressions,
            "items": _text(
                LIMITS.name_expression_bytes, LINE_PATTERN, "e.g. add<float, 256>; one line"
            ),
        },
        "RecipeSpecialization": _specialization_schema(),
        "RecipeToolchain": {
            "enum": [*toolchains, None],
            "description": "this server's toolchain id (GET /v1/toolchains); omitted or null: that",
        },
        "RecipeIncludeSets": {
            "type": "array",
            "maxItems": LIMITS.include_sets if include_sets else 0,
            "items": (
                {
                    "type": "string",
                    # A registered name, or one pinned to a digest of the set's contents.
                    "pattern": f"^(?:{'|'.join(include_sets)})(?:@[0-9a-f]{{64}})?$",
                }
                if include_sets
                else {"type": "string"}
            ),
            "description": (
                "include sets registered on this server (GET /v1/toolchains lists them), each "
                "by name or pinned to its contents as name@<sha256> (include_set_digests); a "
                "recipe pinned to contents a set no longer has is answered by its exact key "
                "only (409 include_set_changed otherwise)"
            ),
        },
        "Target": {
            "type": "string",
            "pattern": target_pattern(sms),
            "description": "sm_XX, sm_XXa, sm_XXf or compute_XX, for an SM this server's NVRTC targets",
        },
        "CubinTarget": {
            "type": "string",
            "pattern": target_pattern(sms, families=("sm",)),
            "description": "sm_XX, sm_XXa or sm_XXf, for an SM this server's NVRTC targets",
        },
    }


def _fields(level: int, target: str) -> dict[str, Any]:
    """Every field of a recipe at nesting ``level`` (``target``: a target component's name)."""
    link_items: list[dict[str, Any]] = [
        {
            "type": "object",
            "required": ["digest"],
            "additionalProperties": False,
            "properties": {"digest": {"type": "string", "pattern": HEX_KEY_PATTERN}},
        }
    ]
    if level < LIMITS.link_depth:
        link_items.insert(
            0,
            {
                "type": "object",
                "required": ["recipe"],
                "additionalProperties": False,
                "properties": {"recipe": _ref(f"LinkedRecipe{level + 1}")},
            },
        )
    target_schema: dict[str, Any] = _ref(target)
    if level > 0:  # "auto" (or nothing) in a linked recipe takes the outer recipe's target
        target_schema = {"anyOf": [target_schema, {"const": "auto"}]}
    fields = {
        "source": _ref("RecipeSource"),
        "name": _ref("RecipeName"),
        "headers": _ref("RecipeHeaders"),
        "flags": _ref("RecipeFlags"),
        "target": target_schema,
        "output": {"type": "string", "enum": ["cubin", "ptx", "ltoir"], "default": "cubin"},
        "name_expressions": _ref("RecipeNameExpressions"),
        "specialization": _ref("RecipeSpecialization"),
        "link": {
            "type": "array",
            "maxItems": LIMITS.link_inputs,
            "items": {"oneOf": link_items},
            "description": (
                "further nvJitLink inputs: a recipe compiled to LTO-IR, or a stored artifact by "
                f"digest; recipes nest at most {LIMITS.link_depth} deep"
            ),
        },
        "lto": {"type": "boolean", "default": False},
        "toolchain": _ref("RecipeToolchain"),
        "include_sets": _ref("RecipeIncludeSets"),
    }
    return _in_key_order(fields)


def _in_key_order(fields: dict[str, Any]) -> dict[str, Any]:
    """``fields`` in the order of the core's one table of a recipe's fields (:data:`kcache.keys.RECIPE_FIELDS`).

    That table decides what a recipe holds (and its keys hash): a field it gains
    that this schema does not state, or one it loses that this schema still
    states, fails here, when the app is built.
    """
    missing = [name for name in RECIPE_FIELDS if name not in fields]
    unknown = sorted(set(fields) - set(RECIPE_FIELDS))
    if missing or unknown:
        raise RuntimeError(
            f"the recipe schema is out of step with kcache.keys.KEY_FIELDS: "
            f"no schema for {missing}, schemas for fields a recipe has not {unknown}"
        )
    return {name: fields[name] for name in RECIPE_FIELDS}


def _variant(
    fields: dict[str, Any], title: str, required: Sequence[str], **overrides: dict[str, Any]
) -> dict[str, Any]:
    return {
        "title": title,
        "type": "object",
        "required": list(required),
        "additionalProperties": False,
        "properties": {**fields, **overrides},
    }


def _recipe(level: int) -> dict[str, Any]:
    """The recipe schema at nesting ``level``: its three variants."""
    required = ["source", "target"] if level == 0 else ["source"]
    cubin_fields = _fields(level, "CubinTarget")
    any_fields = _fields(level, "Target")
    cubin = {"type": "string", "const": "cubin", "default": "cubin"}
    plain = {"type": "boolean", "const": False, "default": False}
    where = "a recipe" if level == 0 else f"a linked recipe (level {level})"
    return {
        "description": (
            f"{where}: everything that changes the generated code, checked as the server's "
            "compiles need it (its toolchain, its NVRTC's targets, its include sets)"
            + ("" if level == 0 else "; target and toolchain default to the outer recipe's")
        ),
        "anyOf": [
            _variant(
                cubin_fields,
                "cubin linked by nvJitLink (lto)",
                [*required, "lto"],
                lto={"type": "boolean", "const": True},
                output=cubin,
            ),
            _variant(
                cubin_fields,
                "cubin",
                required,
                lto=plain,
                output=cubin,
                link={**cubin_fields["link"], "maxItems": 0},
            ),
            _variant(
                any_fields,
                "PTX or LTO-IR",
                [*required, "output"],
                lto=plain,
                output={"type": "string", "enum": ["ptx", "ltoir"]},
                link={**any_fields["link"], "maxItems": 0},
            ),
        ],
    }


def recipe_components(
    *, sms: Sequence[int], toolchains: Sequence[str], include_sets: Sequence[str]
) -> dict[str, dict[str, Any]]:
    """OpenAPI components ``Recipe``, ``LinkedRecipe1``... and their parts, for a server with these targets.

    ``sms`` are the SM numbers its NVRTC compiles for, ``toolchains`` its toolchain
    ids, ``include_sets`` its registered include set names.
    """
    components = {"Recipe": _recipe(0)}
    for level in range(1, LIMITS.link_depth + 1):
        components[f"LinkedRecipe{level}"] = _recipe(level)
    components.update(_shared_fields(sms, toolchains, include_sets))
    return components
