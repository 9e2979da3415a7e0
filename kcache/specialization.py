"""Deterministic rendering of a recipe's ``specialization`` into ``KC_*`` macros.

``dtype`` -> ``KC_DTYPE`` (the C type), ``shape`` -> ``KC_NDIM`` and
``KC_SHAPE_<i>``, ``strides`` -> ``KC_STRIDE_<i>``, any other key ``k`` ->
``KC_<K>`` with lists spread over ``KC_<K>_<i>``. The result is sorted, so the
same specialization always yields the same ``-D`` flags in the same order.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from kcache.errors import RecipeError

__all__ = [
    "DTYPES",
    "DTYPE_ALIASES",
    "KEY_RE",
    "MAX_KEYS",
    "MAX_LIST",
    "MAX_RENDERED_BYTES",
    "STRING_VALUE_RE",
    "SpecValue",
    "canonical_dtype",
    "normalize_specialization",
    "render_macros",
]

SpecScalar = bool | int | float | str
SpecValue = SpecScalar | tuple[SpecScalar, ...]

DTYPES: dict[str, str] = {
    "float32": "float",
    "float16": "__half",
    "bfloat16": "__nv_bfloat16",
    "float64": "double",
    "int8": "int8_t",
    "int16": "int16_t",
    "int32": "int32_t",
    "int64": "int64_t",
    "uint8": "uint8_t",
    "uint16": "uint16_t",
    "uint32": "uint32_t",
    "uint64": "uint64_t",
    "bool": "bool",
}
#: Other spellings of a dtype, and the name each stands for.
DTYPE_ALIASES = {
    "float": "float32",
    "half": "float16",
    "fp16": "float16",
    "bf16": "bfloat16",
    "double": "float64",
    "fp32": "float32",
    "fp64": "float64",
}
#: A specialization key, and a string value (the server's JSON Schema publishes both).
# Applied with fullmatch: "$" would accept a trailing newline, i.e. a line break in a -D flag.
KEY_RE = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,63}")
STRING_VALUE_RE = re.compile(r"[A-Za-z0-9_ :<>,.*+\-()]{0,256}")

# The limits that keep one recipe's specialization cheap to check, key and compile.
# Values are scalars or flat lists of scalars: nothing nests deeper than one list.
#: Keys in one specialization.
MAX_KEYS = 256
#: Elements in one list value.
MAX_LIST = 64
#: Bytes of all the rendered ``-D`` flags together.
MAX_RENDERED_BYTES = 64 << 10


def canonical_dtype(value: object) -> str:
    """Return the canonical dtype name (``float32`` ...), accepting ``torch.float16`` style too."""
    if not isinstance(value, str):
        raise RecipeError("specialization.dtype", f"must be a string, got {type(value).__name__}")
    name = value.removeprefix("torch.").removeprefix("numpy.").lower()
    name = DTYPE_ALIASES.get(name, name)
    if name not in DTYPES:
        raise RecipeError(
            "specialization.dtype", f"unknown dtype {value!r}; known: {', '.join(sorted(DTYPES))}"
        )
    return name


def _check_scalar(field: str, value: object) -> SpecScalar:
    if isinstance(value, bool | int):
        return value
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise RecipeError(field, "must be a finite number")
        return value
    if isinstance(value, str):
        if not STRING_VALUE_RE.fullmatch(value):
            raise RecipeError(
                field,
                "strings may hold letters, digits, spaces and _:<>,.*+-() (at most 256 characters)",
            )
        return value
    if isinstance(value, list | tuple | Mapping):
        raise RecipeError(field, "values nest at most one list deep (a list of numbers or strings)")
    raise RecipeError(
        field, f"must be a number, a string or a list of them, not {type(value).__name__}"
    )


def normalize_specialization(spec: Mapping[str, object]) -> dict[str, SpecValue]:
    """Validate ``spec`` and return it with canonical values (dtype names normalised).

    Refused, naming the field: more than :data:`MAX_KEYS` keys, a list longer than
    :data:`MAX_LIST`, a list inside a list, and rendered macros over
    :data:`MAX_RENDERED_BYTES` in all.
    """
    if len(spec) > MAX_KEYS:  # checked before looking at any key: a million keys cost nothing
        raise RecipeError("specialization", f"at most {MAX_KEYS} keys, got {len(spec)}")
    out: dict[str, SpecValue] = {}
    for key, value in spec.items():
        if not isinstance(key, str) or not KEY_RE.fullmatch(key):
            # Named in the field when it reads as a name; a long or unprintable key is
            # named in the detail, escaped.
            plain = isinstance(key, str) and len(key) <= 64 and key.isprintable()
            shown = repr(key) if len(repr(key)) <= 80 else repr(key)[:77] + "..."
            raise RecipeError(
                f"specialization.{key}" if plain else "specialization",
                f"key {shown} is not an identifier: a letter, then up to 63 letters, digits or _",
            )
        field = f"specialization.{key}"
        if key == "dtype":
            out[key] = canonical_dtype(value)
        elif isinstance(value, list | tuple):
            if len(value) > MAX_LIST:
                raise RecipeError(field, f"at most {MAX_LIST} elements, got {len(value)}")
            out[key] = tuple(_check_scalar(f"{field}[{i}]", v) for i, v in enumerate(value))
        elif key in ("shape", "strides"):
            raise RecipeError(field, "must be a list of integers")
        else:
            out[key] = _check_scalar(field, value)
        value_list = out[key]
        if key in ("shape", "strides") and isinstance(value_list, tuple):
            for i, v in enumerate(value_list):
                if not isinstance(v, int) or isinstance(v, bool):
                    raise RecipeError(f"{field}[{i}]", "must be an integer")
    rendered = render_macros(out)  # raises when two keys collide on one macro name
    size = sum(len(macro) + len(literal) + 3 for macro, literal in rendered)  # "-D" and "="
    if size > MAX_RENDERED_BYTES:
        raise RecipeError(
            "specialization",
            f"renders to {size} bytes of -D flags; the limit is {MAX_RENDERED_BYTES}",
        )
    return out


def _literal(value: SpecScalar) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, float):
        return repr(value)
    return str(value)


def render_macros(spec: Mapping[str, SpecValue]) -> list[tuple[str, str]]:
    """Return ``(macro, value)`` pairs, sorted by macro name."""
    pairs: list[tuple[str, str]] = []
    for key, value in spec.items():
        if key == "dtype":
            pairs.append(("KC_DTYPE", DTYPES[str(value)]))
        elif key == "shape":
            assert isinstance(value, tuple)
            pairs.append(("KC_NDIM", str(len(value))))
            pairs.extend((f"KC_SHAPE_{i}", _literal(v)) for i, v in enumerate(value))
        elif key == "strides":
            assert isinstance(value, tuple)
            pairs.extend((f"KC_STRIDE_{i}", _literal(v)) for i, v in enumerate(value))
        elif isinstance(value, tuple):
            pairs.extend((f"KC_{key.upper()}_{i}", _literal(v)) for i, v in enumerate(value))
        else:
            pairs.append((f"KC_{key.upper()}", _literal(value)))
    seen: dict[str, str] = {}
    for macro, literal in pairs:
        if macro in seen:
            raise RecipeError("specialization", f"two keys render to the same macro {macro}")
        seen[macro] = literal
    return sorted(pairs)
