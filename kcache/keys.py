"""The keys: what a recipe key hashes, written by one encoder, and the one check of every key.

A recipe's two keys are sha256 of its canonical JSON: sorted members, compact
separators, ASCII. :data:`KEY_FIELDS` is that JSON's every member, in the order it
is written, and how each is written: the one source of a recipe's fields. Its
readers: the one encoder (:func:`encode_recipe_key`, :func:`encode_base_key`,
a walk of it), :func:`key_material` (what the encoder wrote, parsed), the
fields :meth:`kcache.recipe.Recipe.from_dict` accepts, and the server's published
recipe schema (``kcache_server.recipe_schema``); the :class:`~kcache.recipe.Recipe`
class and its JSON form are checked against it (tests/core/test_keys.py).
``recipe_key`` hashes the headers by their sha256, ``base_key`` by their names only
(it indexes manifests); ``digest`` is the sha256 of an artifact's bytes. All three
are 64 lowercase hex digits: :func:`require_hex_key`.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii
from operator import methodcaller
from typing import Any

from kcache.errors import InvalidKeyError

__all__ = [
    "HEX_KEY_REGEX",
    "KEY_FIELDS",
    "KEY_PREFIX_REGEX",
    "KEY_SCHEMA",
    "MIN_KEY_PREFIX",
    "RECIPE_FIELDS",
    "KeyField",
    "canonical_json",
    "encode_base_key",
    "encode_recipe_key",
    "is_hex_key",
    "is_key_prefix",
    "key_material",
    "require_hex_key",
    "sha256_hex",
]

#: Bumped whenever the canonical form changes, so old keys never alias new ones. 2: an
#: include set enters the recipe key by the digest of its contents (``name@<sha256>``),
#: and every compile is seeded (``-frandom-seed``), so its bytes are a function of the key.
KEY_SCHEMA = 2

#: A key or digest: 64 lowercase hex digits. In the regex syntax Python's ``re`` and
#: ECMA-262 read alike, unanchored: Python matches it with ``fullmatch`` ("$" would
#: also accept a trailing newline), a JSON Schema ``pattern`` as ``^...$``.
HEX_KEY_REGEX = "[0-9a-f]{64}"
_HEX64 = re.compile(HEX_KEY_REGEX)
#: The fewest digits of a key taken as the start of one (git's): shorter ones match by chance.
MIN_KEY_PREFIX = 4
#: A key or the start of one (what ``kcache cache ls`` and the dashboard print), as above.
KEY_PREFIX_REGEX = f"[0-9a-f]{{{MIN_KEY_PREFIX},64}}"
_PREFIX = re.compile(KEY_PREFIX_REGEX)

# One encoder for every call (json.dumps with these arguments builds a new one each time).
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def canonical_json(value: Any) -> bytes:
    """Sorted keys, compact separators, ASCII: the same bytes for the same value anywhere."""
    return _CANONICAL.encode(value).encode()


def sha256_hex(data: bytes | str) -> str:
    """sha256 of ``data`` (UTF-8 for text) as 64 lowercase hex digits."""
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


def is_hex_key(text: object) -> bool:
    """True when ``text`` is a string of exactly 64 lowercase hex digits (a key or digest)."""
    return isinstance(text, str) and _HEX64.fullmatch(text) is not None


def is_key_prefix(text: object) -> bool:
    """True for a key or the start of one: :data:`MIN_KEY_PREFIX` to 64 lowercase hex digits."""
    return isinstance(text, str) and _PREFIX.fullmatch(text) is not None


def require_hex_key(value: object, field: str) -> str:
    """``value`` when it is a recipe key or digest, else :class:`InvalidKeyError` naming ``field``.

    The one check of keys and digests everywhere (core, client, server): a key names
    files and rows, so anything but exactly 64 lowercase hex digits is refused before use.
    """
    if isinstance(value, str) and _HEX64.fullmatch(value) is not None:
        return value
    shown = repr(value[:80]) if isinstance(value, str) else f"a {type(value).__name__}"
    raise InvalidKeyError(field, f"must be 64 lowercase hex digits (a sha256), got {shown}")


# ---------------------------------------------------------------- the members' writers
# Each writes one member's value (as a validated recipe holds it) as canonical JSON:
# what json.dumps(sort_keys=True, separators=(",", ":")) writes for it, faster.
# Strings go through json's own ASCII escaper, so the bytes are json's.
_string = encode_basestring_ascii
_boolean = {True: "true", False: "false"}.__getitem__


def _strings(values: tuple[str, ...]) -> str:
    return "[" + ",".join(map(encode_basestring_ascii, values)) + "]"


def _set_names(values: tuple[str, ...]) -> str:
    """The include sets by name only (the base key: manifests match across a set's versions)."""
    return _strings(tuple(value.partition("@")[0] for value in values))


def _optional_string(value: str | None) -> str:
    return "null" if value is None else encode_basestring_ascii(value)


def _object(value: Mapping[str, Any]) -> str:
    """A flat object of JSON scalars and tuples (the specialization), keys sorted."""
    return _CANONICAL.encode(dict(value)) if value else "{}"


def _links(items: tuple[Any, ...]) -> str:
    """Each link input as its recipe's key (``recipe_key``) or the stored artifact's ``digest``.

    A linked recipe enters with its full key (its :meth:`~kcache.recipe.Recipe._identity`,
    headers by content, also in the base key): manifests match the outer headers only.
    Digests are checked hex: nothing to escape.
    """
    if not items:
        return "[]"
    members = [
        f'{{"digest":"{item.digest}"}}'
        if item.recipe is None
        else f'{{"recipe_key":"{item.recipe._identity()}"}}'
        for item in items
    ]
    return "[" + ",".join(members) + "]"


@dataclass(frozen=True)
class KeyField:
    """One member of the canonical JSON the keys hash.

    ``write`` writes the member's JSON text from the keyed recipe's attribute ``reads``
    (its own name unless said), or is that text itself for a member the key adds
    (``recipe_field`` false: ``schema``, ``kind``). ``write_base`` is the base key's
    writer where it differs from the recipe key's.
    """

    name: str
    write: Callable[[Any], str] | str
    write_base: Callable[[Any], str] | str | None = None
    reads: str | None = None
    recipe_field: bool = True


#: Every member of the canonical JSON, in the order it is written (sorted by name).
#: A recipe field not in this table would not change the keys: every field of
#: :class:`kcache.recipe.Recipe` is one (tests/core/test_keys.py checks), and
#: ``Recipe.from_dict`` refuses any other.
KEY_FIELDS: tuple[KeyField, ...] = (
    KeyField("flags", _strings),  # in the order given: NVRTC reads them in order
    # Include name -> sha256 of the text (recipe key), or the sorted names (base
    # key), as the recipe's checked header set keeps them written out.
    KeyField(
        "headers",
        methodcaller("hashes_json"),
        methodcaller("names_json"),
        reads="_header_set",
    ),
    # ``name@<digest of the set's contents>`` (recipe key), the names alone (base key).
    KeyField("include_sets", _strings, _set_names),
    KeyField("kind", '"recipe"', '"base"', recipe_field=False),
    KeyField("link", _links),
    KeyField("lto", _boolean),
    KeyField("name", _string),
    KeyField("name_expressions", _strings),
    KeyField("output", _string),
    KeyField("schema", json.dumps(KEY_SCHEMA), recipe_field=False),
    KeyField("source", _string),
    KeyField("specialization", _object),
    KeyField("target", _string),
    KeyField("toolchain", _optional_string),
)
#: The fields of a recipe's JSON form: the members the key does not add itself.
RECIPE_FIELDS: tuple[str, ...] = tuple(f.name for f in KEY_FIELDS if f.recipe_field)


def _encoder(fields: tuple[KeyField, ...], *, base: bool) -> Callable[[Any], bytes]:
    """The writer of one key's canonical JSON: ``fields`` walked, each member written in turn.

    The names, separators and constant members are joined here, once; each call reads
    the members' attributes and calls their writers. tests/core/test_keys.py checks
    that the bytes are json.dumps's. About 1 us a key more than the code generated
    from the table it replaced (10,000 recipe keys: 28 ms, were 19 ms; issue 46), next
    to the 19 us of a memory hit on a new equal recipe (B3).
    """
    names = [f.name for f in fields]
    if names != sorted(names) or len(set(names)) != len(names):
        raise ValueError(f"key fields must be unique and in sorted order, got {names}")
    # (the JSON text before the member's value, its attribute, its writer)
    steps: list[tuple[str, str, Callable[[Any], str]]] = []
    literal = ""
    for i, f in enumerate(fields):
        write = f.write_base if base and f.write_base is not None else f.write
        literal += ("," if i else "{") + encode_basestring_ascii(f.name) + ":"
        if isinstance(write, str):
            literal += write
        else:
            steps.append((literal, f.reads or f.name, write))
            literal = ""
    tail = literal + "}"

    def encode(recipe: Any) -> bytes:
        parts: list[str] = []
        for text, attribute, write in steps:
            parts.append(text)
            parts.append(write(getattr(recipe, attribute)))
        parts.append(tail)
        return "".join(parts).encode()

    encode.__qualname__ = encode.__name__ = "encode_base_key" if base else "encode_recipe_key"
    return encode


#: ``encode_recipe_key(recipe)``: the canonical JSON ``recipe_key`` hashes, every member,
#: headers by their sha256, of a :class:`kcache.recipe.Recipe` (resolved or not: an
#: unresolved recipe's identity hashes it too).
encode_recipe_key = _encoder(KEY_FIELDS, base=False)
#: ``encode_base_key(recipe)``: the canonical JSON ``base_key`` hashes, headers by name.
encode_base_key = _encoder(KEY_FIELDS, base=True)


def key_material(recipe: Any, *, with_header_contents: bool = True) -> dict[str, Any]:
    """The canonical object a key hashes, as JSON values (its canonical JSON, parsed)."""
    encode = encode_recipe_key if with_header_contents else encode_base_key
    material: dict[str, Any] = json.loads(encode(recipe))
    return material
