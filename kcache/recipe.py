"""The recipe: everything that changes generated code, validated as untrusted input."""

from __future__ import annotations

import functools
import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from json.encoder import encode_basestring_ascii
from types import MappingProxyType
from typing import Any, Literal

from kcache import keys
from kcache.errors import InvalidKeyError, RecipeError, UnresolvedRecipeError
from kcache.keys import (
    RECIPE_FIELDS,
    encode_base_key,
    encode_recipe_key,
    require_hex_key,
    sha256_hex,
)
from kcache.lru import LruCache
from kcache.options import (
    ALLOWED_FLAGS,
    CONTROL_CHARACTERS,
    INCLUDE_NAME_REGEX,
    recipe_flag_refusal,
)
from kcache.specialization import SpecValue, normalize_specialization, render_macros
from kcache.targets import Target, parse_target

__all__ = [
    "ALLOWED_FLAGS",
    "CONTROL_CHARACTERS",
    "INCLUDE_NAME_REGEX",
    "LIMITS",
    "LinkInput",
    "Output",
    "Recipe",
    "include_set_digest",
    "include_set_name",
]

Output = Literal["cubin", "ptx", "ltoir"]
_OUTPUTS = ("cubin", "ptx", "ltoir")


@dataclass(frozen=True)
class _Limits:
    source_bytes: int = 1 << 20
    header_count: int = 256
    header_bytes_total: int = 8 << 20
    name_chars: int = 256
    flag_count: int = 64
    flag_chars: int = 4096
    name_expressions: int = 256
    name_expression_bytes: int = 1024
    link_inputs: int = 32
    link_depth: int = 4  # link recipes inside link recipes: bounded, like JSON nesting
    include_sets: int = 8


LIMITS = _Limits()

# The fields a recipe's JSON form may hold: the key's own table (kcache.keys.KEY_FIELDS).
_FIELDS = frozenset(RECIPE_FIELDS)
# Every pattern here is applied with fullmatch ("$" would accept a trailing newline),
# with ASCII classes (a Unicode "\d" accepts "٩٠" as 90).
_INCLUDE_NAME_RE = re.compile(INCLUDE_NAME_REGEX)
_SET_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_\-]{0,63}")
#: An entry of ``include_sets``: a registered set's name, pinned to the digest of its
#: contents (``name@<sha256>``) once resolved (:meth:`Recipe.with_defaults`).
_SET_ENTRY_RE = re.compile(r"([A-Za-z0-9][A-Za-z0-9_\-]{0,63})(?:@([0-9a-f]{64}))?")
_TOOLCHAIN_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+\-]{0,127}")
_CONTROL_RE = re.compile(f"[{CONTROL_CHARACTERS}]")

# sha256 of header texts seen lately, by text: every new set of headers is hashed
# header by header, and sets differ in a few headers (a kernel's own next to a
# library's). Looking a text up costs its hash and one comparison, a fraction of
# sha256's setup per call; bounded by entries and bytes, emptied when full.
_HEADER_SHA256: dict[str, str] = {}
_HEADER_SHA256_MAX_ENTRIES = 4096
_HEADER_SHA256_MAX_CHARS = 32 << 20
_header_sha256_chars = 0


def _header_sha256(text: str) -> str:
    """``sha256_hex(text.encode())``, remembered for recently seen texts."""
    global _header_sha256_chars
    digest = _HEADER_SHA256.get(text)
    if digest is None:
        digest = hashlib.sha256(text.encode()).hexdigest()
        if (
            len(_HEADER_SHA256) >= _HEADER_SHA256_MAX_ENTRIES
            or _header_sha256_chars + len(text) > _HEADER_SHA256_MAX_CHARS
        ):
            _HEADER_SHA256.clear()
            _header_sha256_chars = 0
        if len(text) <= _HEADER_SHA256_MAX_CHARS:
            _HEADER_SHA256[text] = digest
            _header_sha256_chars += len(text)
    return digest


class _HeaderSet:
    """One checked set of headers, frozen in name order, and the pieces of JSON its keys hold.

    A process builds recipes from the same few header sets over and over (a rank per
    kernel launch, a server per request): :func:`_header_set` finds a set equal to one
    it checked lately, name for name and text for text, and the recipe takes that set
    (its frozen mapping, hashes and JSON) instead of checking, sorting, hashing and
    escaping every header again. Shared by recipes and threads: every field is either
    set here or computed once from the frozen mapping (a race computes it twice, alike).
    """

    __slots__ = ("_hashes", "_hashes_json", "_names_json", "chars", "mapping")

    def __init__(self, headers: Mapping[str, str]) -> None:
        ordered = dict(sorted(headers.items()))
        self.mapping: Mapping[str, str] = MappingProxyType(ordered)
        self.chars = sum(map(len, ordered)) + sum(map(len, ordered.values()))
        self._hashes: dict[str, str] | None = None
        self._hashes_json: str | None = None
        self._names_json: str | None = None

    def hashes(self) -> dict[str, str]:
        """Include name -> sha256 of the text, in name order (not to be changed)."""
        hashes = self._hashes
        if hashes is None:
            hashes = self._hashes = {
                name: _header_sha256(text) for name, text in self.mapping.items()
            }
        return hashes

    def hashes_json(self) -> str:
        """Canonical JSON of :meth:`hashes` (the recipe key's ``headers``)."""
        text = self._hashes_json
        if text is None:
            esc = encode_basestring_ascii  # hashes are hex: nothing to escape
            pairs = ",".join([f'{esc(name)}:"{h}"' for name, h in self.hashes().items()])
            text = self._hashes_json = "{" + pairs + "}"
        return text

    def names_json(self) -> str:
        """Canonical JSON of the sorted names (the base key's ``headers``)."""
        text = self._names_json
        if text is None:
            text = self._names_json = (
                "[" + ",".join(map(encode_basestring_ascii, self.mapping)) + "]"
            )
        return text


_NO_HEADERS = _HeaderSet({})
# Header sets checked lately, by their (name, text) pairs in the order given; bounded
# by the characters they hold (names and texts) and by count.
_HEADER_SETS: LruCache[tuple[tuple[Any, Any], ...], _HeaderSet] = LruCache(
    max_bytes=32 << 20, max_entries=1024, size=lambda header_set: header_set.chars
)


def _header_set(headers: object) -> _HeaderSet:
    """``headers`` checked (:func:`_check_headers`) and frozen, or the equal set checked lately.

    The set kept is the one that was checked: an equal set found here is never taken
    as given, so a mapping whose strings compare equal to checked ones yields exactly
    those checked strings.
    """
    if not isinstance(headers, _MAPPING) or not headers or len(headers) > LIMITS.header_count:
        _check_headers(headers)  # raises, unless the mapping is empty
        return _NO_HEADERS
    content = tuple(headers.items())
    try:
        found = _HEADER_SETS.get(content)
    except TypeError:  # a text that cannot be hashed: the checks say what is wrong
        _check_headers(headers)
        raise
    if found is not None:
        return found
    _check_headers(headers)
    header_set = _HeaderSet(headers)
    _HEADER_SETS.put(content, header_set)
    return header_set


# The ABCs the fields are checked against, with the builtins named first: isinstance
# tries them in order, and a tuple's check against Sequence alone costs about a
# microsecond each time (three per recipe).
_SEQUENCE = (tuple, list, Sequence)
_MAPPING = (dict, Mapping)


@dataclass(frozen=True)
class LinkInput:
    """One further nvJitLink input: a recipe compiled to LTO-IR, or a stored artifact by digest."""

    recipe: Recipe | None = None
    digest: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The JSON form: ``{"recipe": {...}}`` or ``{"digest": "..."}``."""
        if self.recipe is not None:
            return {"recipe": self.recipe.to_dict()}
        return {"digest": self.digest}


@dataclass(frozen=True, eq=False)
class Recipe:
    """Everything that changes the generated code of one kernel (docs/design.md, section 3).

    Construct it directly or with :meth:`from_dict` / :meth:`from_json`; every field
    is validated, and a bad one raises :class:`RecipeError` naming it.

    Recipes are equal when their canonical forms are (the JSON the keys hash, headers
    by their sha256), and hash accordingly, so they work as dict keys and set members;
    for a resolved recipe that identity is its :meth:`key`.
    """

    source: str
    target: str = "auto"
    name: str = "kernel.cu"
    headers: Mapping[str, str] = field(default_factory=dict)
    flags: Sequence[str] = ()
    output: Output = "cubin"
    name_expressions: Sequence[str] = ()
    specialization: Mapping[str, SpecValue] = field(default_factory=dict)
    link: Sequence[LinkInput] = ()
    lto: bool = False
    toolchain: str | None = None
    include_sets: Sequence[str] = ()
    # Keys and derived copies, computed once: every container above is frozen.
    _memo: dict[Any, Any] = field(default_factory=dict, init=False, repr=False, compare=False)
    # The checked headers with their hashes and JSON, shared by equal recipes and copies.
    _header_set: _HeaderSet = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        header_set = _validate(self)
        # Freeze every container: a recipe cannot change under its key, so the keys
        # (and the defaults-filled copy) can be computed once per object and memoised.
        object.__setattr__(self, "_header_set", header_set)
        object.__setattr__(self, "headers", header_set.mapping)
        object.__setattr__(self, "flags", tuple(self.flags))
        object.__setattr__(self, "name_expressions", tuple(self.name_expressions))
        spec = normalize_specialization(self.specialization) if self.specialization else {}
        object.__setattr__(self, "specialization", MappingProxyType(spec))
        object.__setattr__(self, "link", tuple(self.link))
        object.__setattr__(self, "include_sets", tuple(self.include_sets))

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # Mapping proxies do not pickle; the JSON form round-trips exactly.
        return (Recipe.from_dict, (self.to_dict(),))

    def __eq__(self, other: object) -> bool:
        if other is self:
            return True
        if not isinstance(other, Recipe):
            return NotImplemented
        return self._identity() == other._identity()

    def __hash__(self) -> int:
        return hash(self._identity())

    def _derive(
        self,
        *,
        target: str,
        toolchain: str | None,
        link: tuple[LinkInput, ...],
        include_sets: tuple[str, ...],
    ) -> Recipe:
        """A copy with these four fields, built without validating again the fields it keeps.

        The alternate constructor of :meth:`with_defaults`: the caller checks the
        changed fields itself, and gives them already frozen. The copy shares the
        header set (hashed once).
        """
        copy = object.__new__(Recipe)
        state = {
            **vars(self),
            "target": target,
            "toolchain": toolchain,
            "link": link,
            "include_sets": include_sets,
            "_memo": {},
        }
        vars(copy).update(state)  # frozen: object.__setattr__ would do the same, field by field
        return copy

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Recipe:
        """Build a recipe from its JSON object; unknown fields are refused."""
        return cls._from_dict(data, 0)

    @classmethod
    def _from_dict(cls, data: Mapping[str, Any], depth: int) -> Recipe:
        if not isinstance(data, Mapping):
            raise RecipeError("recipe", "must be a JSON object")
        unknown = sorted(set(data) - _FIELDS)
        if unknown:
            raise RecipeError(
                unknown[0], f"unknown field; known fields: {', '.join(sorted(_FIELDS))}"
            )
        if "source" not in data:
            raise RecipeError("source", "is required")
        kwargs = dict(data)
        link = kwargs.get("link", ())
        if not isinstance(link, list | tuple):
            raise RecipeError("link", "must be a list")
        if len(link) > LIMITS.link_inputs:
            raise RecipeError("link", f"at most {LIMITS.link_inputs} inputs")
        kwargs["link"] = tuple(_link_from_dict(i, item, depth) for i, item in enumerate(link))
        return cls(**kwargs)

    @classmethod
    def from_json(cls, text: str | bytes) -> Recipe:
        """Parse a recipe from JSON text."""
        try:
            data = json.loads(text)
        except (ValueError, UnicodeDecodeError) as exc:
            raise RecipeError("recipe", f"is not valid JSON: {exc}") from exc
        return cls.from_dict(data)

    @classmethod
    def from_cupy(
        cls,
        code: str,
        options: Sequence[str] = (),
        name_expressions: Sequence[str] | None = (),
        **kwargs: Any,
    ) -> Recipe:
        """The recipe of ``cupy.RawModule(code=..., options=..., name_expressions=...)``.

        Every option is translated or refused by name; CuPy's implicit options are
        added. See :func:`kcache.options.cupy_recipe_fields` for the keywords.
        """
        from kcache.options import cupy_recipe_fields

        return cls(**cupy_recipe_fields(code, options, name_expressions, **kwargs))

    @classmethod
    def from_cuda_core(
        cls,
        code: str,
        options: Any = None,
        target_type: str = "cubin",
        name_expressions: Sequence[str] = (),
        **kwargs: Any,
    ) -> Recipe:
        """The recipe of cuda.core's ``Program(code, "c++", options).compile(target_type, ...)``.

        ``options`` is a ``ProgramOptions``, a list of NVRTC options or None. See
        :func:`kcache.options.cuda_core_recipe_fields` for the keywords.
        """
        from kcache.options import cuda_core_recipe_fields

        fields = cuda_core_recipe_fields(code, options, target_type, name_expressions, **kwargs)
        return cls(**fields)

    def to_dict(self) -> dict[str, Any]:
        """The JSON object form, with header texts (round-trips through :meth:`from_dict`)."""
        out: dict[str, Any] = {
            "source": self.source,
            "name": self.name,
            "headers": dict(self.headers),
            "flags": list(self.flags),
            "target": self.target,
            "output": self.output,
            "name_expressions": list(self.name_expressions),
            "specialization": {
                k: list(v) if isinstance(v, tuple) else v for k, v in self.specialization.items()
            },
            "link": [item.to_dict() for item in self.link],
            "lto": self.lto,
            "include_sets": list(self.include_sets),
        }
        if self.toolchain is not None:
            out["toolchain"] = self.toolchain
        return out

    def with_defaults(
        self,
        *,
        target: str | None = None,
        toolchain: str | None = None,
        include_sets: Mapping[str, str] | None = None,
    ) -> Recipe:
        """A copy with ``target="auto"``, a missing toolchain and unpinned include sets filled in.

        ``include_sets`` maps a set's name to the digest of its contents; each entry
        naming a set without a digest becomes ``name@<digest>`` (recursively, as the
        target and toolchain). An entry already pinned is kept, whatever the mapping
        says: the caller decides what a pin to another version means.
        """
        sets = tuple(sorted(include_sets.items())) if include_sets else ()
        memo_key = ("with_defaults", target, toolchain, sets)
        cached: Recipe | None = self._memo.get(memo_key)
        if cached is None:
            cached = self._memo[memo_key] = self._with_defaults(target, toolchain, dict(sets))
        return cached

    def _with_defaults(
        self, target: str | None, toolchain: str | None, set_digests: Mapping[str, str]
    ) -> Recipe:
        new_target = target if self.target == "auto" and target is not None else self.target
        new_toolchain = self.toolchain if self.toolchain is not None else toolchain
        new_sets = tuple(
            f"{entry}@{set_digests[entry]}"
            if include_set_digest(entry) is None and entry in set_digests
            else entry
            for entry in self.include_sets
        )
        link = tuple(
            LinkInput(
                recipe=item.recipe.with_defaults(
                    target=new_target, toolchain=new_toolchain, include_sets=set_digests
                )
            )
            if item.recipe is not None
            else item
            for item in self.link
        )
        if (new_target, new_toolchain, link, new_sets) == (
            self.target,
            self.toolchain,
            self.link,
            self.include_sets,
        ):
            return self
        # Only these fields change; check them alone instead of re-validating every
        # header of an already validated recipe (the pinned digests are checked hex).
        for i, digest in enumerate(set_digests.values()):
            require_hex_key(digest, f"include_sets[{i}]")
        copy = self._derive(
            target=new_target, toolchain=new_toolchain, link=link, include_sets=new_sets
        )
        _validate_target_and_toolchain(copy)
        if new_sets != self.include_sets:
            copy._memo["pinned_from"] = self.pinned_from() or self
        return copy

    def pinned_from(self) -> Recipe | None:
        """The recipe :meth:`with_defaults` pinned this one's include sets from, if it did.

        Whoever pinned a set may pin it again when the set changed (an engine whose
        kept digest was a moment old); a pin the recipe came with is its author's.
        """
        origin: Recipe | None = self._memo.get("pinned_from")
        return origin

    def unpinned_include_sets(self) -> list[str]:
        """Names of the include sets this recipe (or a linked one) names without a digest."""
        names = [entry for entry in self.include_sets if include_set_digest(entry) is None]
        for item in self.link:
            if item.recipe is not None:
                names += item.recipe.unpinned_include_sets()
        return list(dict.fromkeys(names))

    # ------------------------------------------------------------------ derived
    @property
    def parsed_target(self) -> Target:
        """The target, parsed (raises for ``auto``)."""
        self._require_resolved(include_sets=False)
        return _parse_target(self.target)

    @property
    def produces(self) -> Output:
        """What the compile hands back: ``lto`` recipes are linked into a cubin."""
        return "cubin" if self.lto else self.output

    def header_hashes(self) -> dict[str, str]:
        """Include name -> sha256 of the header text (a fresh dict; computed once per recipe)."""
        return dict(self._header_hashes())

    def _header_hashes(self) -> dict[str, str]:
        """The memoised :meth:`header_hashes` itself (not to be changed), shared with equal sets."""
        return self._header_set.hashes()

    def macro_flags(self) -> list[str]:
        """The ``-D`` options rendered from ``specialization``."""
        return [f"-D{macro}={value}" for macro, value in render_macros(self.specialization)]

    def key_material(self, *, with_header_contents: bool = True) -> dict[str, Any]:
        """The canonical object hashed into the keys (:func:`kcache.keys.key_material`)."""
        self._require_resolved(include_sets=with_header_contents)
        return keys.key_material(self, with_header_contents=with_header_contents)

    def _identity(self) -> str:
        """sha256 of the canonical form: :meth:`key` once resolved; equality and hash use it."""
        identity: str | None = self._memo.get("identity")
        if identity is None:
            identity = self._memo["identity"] = sha256_hex(encode_recipe_key(self))
        return identity

    def key(self) -> str:
        """``recipe_key``: sha256 of the canonical JSON of everything, headers by their hash."""
        self._require_resolved()
        return self._identity()

    def base_key(self) -> str:
        """``base_key``: the same without header contents (names only); indexes manifests."""
        key: str | None = self._memo.get("base_key")
        if key is None:
            self._require_resolved(include_sets=False)  # the base key names sets only
            key = self._memo["base_key"] = sha256_hex(encode_base_key(self))
        return key

    def _require_resolved(self, *, include_sets: bool = True) -> None:
        """Raise unless the target and toolchain are concrete here and in every linked recipe,
        and (``include_sets``) every include set is pinned to its contents."""
        if self.target == "auto":
            raise UnresolvedRecipeError(
                "target", '"auto" must be resolved to the device\'s sm_XX before keying'
            )
        if self.toolchain is None:
            raise UnresolvedRecipeError(
                "toolchain", "must be resolved to a concrete toolchain id before keying"
            )
        for i, entry in enumerate(self.include_sets if include_sets else ()):
            if include_set_digest(entry) is None:
                # A key names what a compile could read: a set by its contents, never by
                # its name alone (an edited or added file must give another key).
                raise UnresolvedRecipeError(
                    f"include_sets[{i}]",
                    f"include set {entry!r} must be resolved to the digest of its contents "
                    "(name@<sha256>, what GET /v1/toolchains lists) before keying",
                )
        for item in self.link:
            if item.recipe is not None:
                item.recipe._require_resolved(include_sets=include_sets)


def _link_from_dict(index: int, item: object, depth: int) -> LinkInput:
    field_name = f"link[{index}]"
    if not isinstance(item, Mapping) or len(item) != 1 or not ({"recipe", "digest"} & set(item)):
        raise RecipeError(field_name, 'must be {"recipe": {...}} or {"digest": "<sha256>"}')
    if "recipe" in item:
        if depth >= LIMITS.link_depth:
            raise RecipeError(
                f"{field_name}.recipe", f"link recipes nest at most {LIMITS.link_depth} deep"
            )
        try:
            return LinkInput(recipe=Recipe._from_dict(item["recipe"], depth + 1))
        except RecipeError as exc:
            raise RecipeError(f"{field_name}.{exc.field}", exc.detail) from exc
    return LinkInput(digest=item["digest"])


def _check_text(field_name: str, value: object, limit: int) -> str:
    if not isinstance(value, str):
        raise RecipeError(field_name, f"must be a string, not {type(value).__name__}")
    if "\x00" in value:
        raise RecipeError(field_name, "contains a NUL byte")
    if value.isascii():  # the common case: no surrogate possible, one byte a character
        size = len(value)
    else:
        try:
            size = len(value.encode("utf-8"))
        except UnicodeEncodeError as exc:  # a lone surrogate (JSON "\ud800") is not text
            raise RecipeError(
                field_name,
                f"holds a lone UTF-16 surrogate ({value[exc.start]!r} at character {exc.start}); "
                "send valid Unicode text",
            ) from None
    if size > limit:
        raise RecipeError(field_name, f"is larger than the limit of {limit} bytes")
    return value


def _check_line(field_name: str, value: object, limit: int) -> str:
    """A single line of text: :func:`_check_text` without control characters."""
    text = _check_text(field_name, value, limit)
    control = _CONTROL_RE.search(text)
    if control is not None:
        raise RecipeError(
            field_name,
            f"holds the control character {control.group()!r} at character {control.start()}",
        )
    return text


def check_include_name(field_name: str, name: object) -> str:
    """Include names are relative, free of ``..``, and made of safe characters.

    The rule is :data:`INCLUDE_NAME_REGEX` (:mod:`kcache.options`, which reads ``-I``
    directories by it) and the length; the checks after it only
    say what is wrong with a name it refuses.
    """
    if (
        isinstance(name, str)
        and len(name) <= LIMITS.name_chars
        and _INCLUDE_NAME_RE.fullmatch(name)
    ):
        return name
    if not isinstance(name, str) or not name:
        raise RecipeError(field_name, "include names are non-empty strings")
    if "\x00" in name:
        raise RecipeError(field_name, "contains a NUL byte")
    if len(name) > LIMITS.name_chars:
        raise RecipeError(field_name, f"is longer than {LIMITS.name_chars} characters")
    if name.startswith("/"):
        raise RecipeError(field_name, f"{name!r} must be a relative name, not an absolute path")
    if "\\" in name:
        raise RecipeError(field_name, f"{name!r} holds a backslash: write its parts with '/'")
    if any(part in ("..", ".", "") for part in name.split("/")):
        raise RecipeError(field_name, f"{name!r} must not contain '..', '.' or empty path parts")
    raise RecipeError(field_name, f"{name!r} may hold only letters, digits and _.+-/")


def _check_headers(headers: object) -> None:
    """Each header's name and text, then their total size.

    Run once per header set a process sees (:func:`_header_set` keeps the checked sets):
    B2 and B3 run it once per run, so it is one path, header by header (issue 46: the
    joined-names check beside it saved 8 us on B2's 20 headers, once, and cost 90 us on
    256 headers of 29 KB).
    """
    if not isinstance(headers, _MAPPING):
        raise RecipeError("headers", "must be an object of include name -> text")
    if len(headers) > LIMITS.header_count:
        raise RecipeError("headers", f"at most {LIMITS.header_count} headers, got {len(headers)}")
    total = 0
    for name, text in headers.items():
        check_include_name(f"headers[{name!r}]", name)
        total += len(_check_text(f"headers[{name!r}]", text, LIMITS.header_bytes_total))
    if total > LIMITS.header_bytes_total:
        raise RecipeError(
            "headers", f"total size {total} is over the limit of {LIMITS.header_bytes_total} bytes"
        )


def _validate(recipe: Recipe) -> _HeaderSet:
    """Check every field (the first bad one raises); the checked headers, frozen."""
    _check_text("source", recipe.source, LIMITS.source_bytes)
    check_include_name("name", recipe.name)
    header_set = _header_set(recipe.headers)
    if isinstance(recipe.flags, str) or not isinstance(recipe.flags, _SEQUENCE):
        raise RecipeError("flags", "must be a list of strings")
    if len(recipe.flags) > LIMITS.flag_count:
        raise RecipeError("flags", f"at most {LIMITS.flag_count} flags")
    for i, flag in enumerate(recipe.flags):
        _check_line(f"flags[{i}]", flag, LIMITS.flag_chars)
        if not ALLOWED_FLAGS.fullmatch(flag):
            raise RecipeError(f"flags[{i}]", recipe_flag_refusal(flag))
    if recipe.output not in _OUTPUTS:
        raise RecipeError("output", f"{recipe.output!r} is not one of {', '.join(_OUTPUTS)}")
    if isinstance(recipe.name_expressions, str) or not isinstance(
        recipe.name_expressions, _SEQUENCE
    ):
        raise RecipeError("name_expressions", "must be a list of strings")
    if len(recipe.name_expressions) > LIMITS.name_expressions:
        raise RecipeError("name_expressions", f"at most {LIMITS.name_expressions} entries")
    for i, expr in enumerate(recipe.name_expressions):
        _check_line(f"name_expressions[{i}]", expr, LIMITS.name_expression_bytes)
    if not isinstance(recipe.specialization, _MAPPING):
        raise RecipeError("specialization", "must be an object")
    if not isinstance(recipe.lto, bool):
        raise RecipeError("lto", "must be true or false")
    if len(recipe.link) > LIMITS.link_inputs:
        raise RecipeError("link", f"at most {LIMITS.link_inputs} inputs")
    for i, item in enumerate(recipe.link):
        if not isinstance(item, LinkInput) or (item.recipe is None) == (item.digest is None):
            raise RecipeError(f"link[{i}]", "must give exactly one of a recipe or a digest")
        if item.digest is not None:
            try:
                require_hex_key(item.digest, f"link[{i}].digest")
            except InvalidKeyError as exc:
                raise RecipeError(exc.field, exc.detail) from None
    if recipe.link and not recipe.lto:
        raise RecipeError("link", 'link inputs need "lto": true (they are linked with nvJitLink)')
    if recipe.lto and recipe.output != "cubin":
        raise RecipeError(
            "output", '"lto": true compiles to LTO-IR and links a cubin; leave output "cubin"'
        )
    if isinstance(recipe.include_sets, str) or not isinstance(recipe.include_sets, _SEQUENCE):
        raise RecipeError("include_sets", "must be a list of registered include set names")
    if len(recipe.include_sets) > LIMITS.include_sets:
        raise RecipeError("include_sets", f"at most {LIMITS.include_sets} include sets")
    for i, entry in enumerate(recipe.include_sets):
        if not isinstance(entry, str) or not _SET_ENTRY_RE.fullmatch(entry):
            raise RecipeError(
                f"include_sets[{i}]",
                "a registered include set's name (letters, digits, _ and -), optionally "
                "pinned to its contents as name@<sha256 of the set> (GET /v1/toolchains)",
            )
    _validate_target_and_toolchain(recipe)
    return header_set


@functools.lru_cache(maxsize=64)
def _parse_target(text: str) -> Target:
    """:func:`parse_target`, remembered: a process keys recipes for a handful of targets.

    Only valid targets are remembered (an error is raised, not cached), so the few
    dozen entries bound nothing a caller could grow.
    """
    return parse_target(text)


def include_set_name(entry: str) -> str:
    """The set's name of an ``include_sets`` entry (``name`` or ``name@<digest>``)."""
    return entry.partition("@")[0]


def include_set_digest(entry: str) -> str | None:
    """The content digest an ``include_sets`` entry is pinned to, or None when it names only the set."""
    digest = entry.partition("@")[2]
    return digest or None


def _validate_target_and_toolchain(recipe: Recipe) -> None:
    """The checks of the two fields ``with_defaults`` fills in."""
    if not isinstance(recipe.target, str):
        raise RecipeError("target", "must be a string")
    target = None if recipe.target == "auto" else _parse_target(recipe.target)
    if recipe.toolchain is not None and (
        not isinstance(recipe.toolchain, str) or not _TOOLCHAIN_RE.fullmatch(recipe.toolchain)
    ):
        raise RecipeError(
            "toolchain", "must be a toolchain id such as the server's GET /v1/toolchains lists"
        )
    if target is not None and recipe.output == "cubin" and target.is_virtual:
        raise RecipeError(
            "target", f"{recipe.target} is virtual; a cubin needs sm_XX (or set output to ptx)"
        )
