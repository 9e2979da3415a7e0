"""Foreign bindings: a group of files a library's own cache hook published under the library's key.

kcache did not compile these and cannot check what their compile read; what it vouches
for is "published by <writer> under <namespace>/<key>" (docs/design.md section 10). A
binding is named by (library, version, target, toolchain, key), each as the library
reports it; :func:`binding_key` is the sha256 of that name, which the server keys its row
by and a node tier files the group under. :meth:`ForeignBinding.message` is what the
server's signature covers: a prefix no recipe binding's message has, so a signature of
one never verifies as the other. The client and the server check names with the same
patterns (:func:`check_name`).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple
from urllib.parse import quote

from kcache.errors import KCacheError

__all__ = [
    "FILE_NAME_PATTERN",
    "KEY_PATTERN",
    "LABEL_PATTERN",
    "LIBRARY_PATTERN",
    "MAX_FILES",
    "ForeignBinding",
    "ForeignConflictError",
    "ForeignFileRef",
    "ForeignName",
    "ForeignNameError",
    "binding_key",
    "check_name",
    "group_digest",
    "refs_of",
]

#: A library's name: lowercase, as ``cupy``, ``cuda-core``, ``triton`` (never ``blobs``).
LIBRARY_PATTERN = "^[a-z][a-z0-9_-]{0,31}$"
#: A version, target or toolchain as the library reports it.
LABEL_PATTERN = "^[A-Za-z0-9][A-Za-z0-9._+:-]{0,127}$"
#: The library's key, verbatim (others are hex-encoded or hashed by the hook).
KEY_PATTERN = "^[A-Za-z0-9_][A-Za-z0-9._=-]{0,255}$"
#: A file's name within its group (Triton's ``kernel.cubin``, ``__grp__kernel.json``).
FILE_NAME_PATTERN = "^[A-Za-z0-9_][A-Za-z0-9._=+-]{0,255}$"
#: Files in one group at most.
MAX_FILES = 64
#: What the signature of a foreign binding signs before its canonical JSON.
MESSAGE_PREFIX = b"kcache-foreign/v1:"
#: What a group's content digest hashes before its files' canonical JSON.
GROUP_PREFIX = b"kcache-foreign-group/v1:"
#: Libraries that cannot be a name: ``blobs`` is the route of a foreign file's bytes.
RESERVED_LIBRARIES = frozenset({"blobs"})

_PATTERNS = {
    "library": re.compile(LIBRARY_PATTERN[1:-1]),
    "version": re.compile(LABEL_PATTERN[1:-1]),
    "target": re.compile(LABEL_PATTERN[1:-1]),
    "toolchain": re.compile(LABEL_PATTERN[1:-1]),
    "key": re.compile(KEY_PATTERN[1:-1]),
    "name": re.compile(FILE_NAME_PATTERN[1:-1]),
}
_HEX64 = re.compile("[0-9a-f]{64}")


class ForeignNameError(KCacheError, ValueError):
    """A foreign binding's name or group is malformed; ``field`` names what."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class ForeignConflictError(ForeignNameError):
    """A group names one file twice with other bytes."""


def check_name(field: str, value: object) -> str:
    """``value`` when it is a valid ``field`` (library, version, target, toolchain, key, name)."""
    pattern = _PATTERNS[field]
    if not isinstance(value, str) or pattern.fullmatch(value) is None:
        raise ForeignNameError(
            field, f"{field} must match {pattern.pattern!r} (got {str(value)[:80]!r})"
        )
    if field == "library" and value in RESERVED_LIBRARIES:
        raise ForeignNameError(field, f"{value!r} cannot be a library's name")
    return value


def binding_key(library: str, version: str, target: str, toolchain: str, key: str) -> str:
    """The sha256 of a foreign binding's name: what the server and a node tier file it under."""
    name = [
        check_name(f, v)
        for f, v in zip(_NAME_FIELDS, (library, version, target, toolchain, key), strict=True)
    ]
    return hashlib.sha256(b"kcache-foreign\x00" + "\x00".join(name).encode("ascii")).hexdigest()


_NAME_FIELDS = ("library", "version", "target", "toolchain", "key")


@dataclass(frozen=True)
class ForeignFileRef:
    """One file of a group: its name in the group, its digest and size."""

    name: str
    digest: str
    size: int

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {"name": self.name, "digest": self.digest, "size": self.size}


class ForeignName(NamedTuple):
    """A foreign binding's name: the library, its version, target and toolchain, and its key.

    The one name type of a library hook's lookup, a published binding and a manifest's
    group; its JSON form is its five fields, flat (:meth:`to_dict`)."""

    library: str
    version: str
    target: str
    toolchain: str
    key: str

    @classmethod
    def checked(cls, fields: Mapping[str, Any]) -> ForeignName:
        """The name in ``fields`` (a JSON object holding the five), checked (:meth:`check`)."""
        return cls(*(check_name(f, fields.get(f)) for f in _NAME_FIELDS))

    def check(self) -> ForeignName:
        """This name, each part checked (:func:`check_name`: ForeignNameError naming the
        first part that is not valid)."""
        for field, value in zip(_NAME_FIELDS, self, strict=True):
            check_name(field, value)
        return self

    @property
    def binding_key(self) -> str:
        """:func:`binding_key`: what the server and the node tier file it under."""
        return binding_key(*self)

    def to_dict(self) -> dict[str, str]:
        """The five fields, as JSON carries them."""
        return dict(zip(_NAME_FIELDS, self, strict=True))

    def path(self) -> str:
        """The route of this name (without the query)."""
        return f"/v1/foreign/{quote(self.library, safe='')}/{quote(self.key, safe='')}"

    def query(self) -> dict[str, str]:
        """The namespace, as the route's query."""
        return {"version": self.version, "target": self.target, "toolchain": self.toolchain}


@dataclass(frozen=True)
class ForeignBinding:
    """A published group under a library's name, and who published it."""

    name: ForeignName
    files: tuple[ForeignFileRef, ...]
    writer: str

    @property
    def binding_key(self) -> str:
        """:func:`binding_key` of this binding's name."""
        return self.name.binding_key

    @property
    def size(self) -> int:
        """The group's bytes."""
        return sum(f.size for f in self.files)

    @property
    def group_digest(self) -> str:
        """:func:`group_digest` of this binding's files: what a withdrawal of it names."""
        return group_digest(self.files)

    def message(self) -> bytes:
        """The bytes the server's signature covers ("published by <writer>")."""
        body = {
            **self.name.to_dict(),
            "files": sorted([f.name, f.digest, f.size] for f in self.files),
            "writer": self.writer,
        }
        text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        return MESSAGE_PREFIX + text.encode("ascii")


def group_digest(files: Iterable[ForeignFileRef]) -> str:
    """A group's content digest: the sha256 of its files' names, digests and sizes, sorted.

    What a withdrawal of a foreign binding names beside its binding key (docs/design.md
    section 3, "What a binding rests on"): the server has it in its rows, a client computes
    it from the bytes it holds (:func:`refs_of`). The writer is not in it: a withdrawal is
    of the bytes under the name, whoever published them.
    """
    listed = sorted([f.name, f.digest, f.size] for f in files)
    text = json.dumps(listed, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(GROUP_PREFIX + text.encode("ascii")).hexdigest()


def refs_of(files: Mapping[str, bytes]) -> tuple[ForeignFileRef, ...]:
    """The references of a group held as bytes (file name -> bytes), sorted by name."""
    return tuple(
        ForeignFileRef(name, hashlib.sha256(data).hexdigest(), len(data))
        for name, data in sorted(files.items())
    )


def check_files(
    files: Sequence[Mapping[str, Any]], max_size: int | None = None
) -> tuple[ForeignFileRef, ...]:
    """A group's files, each checked (names unique, digests hex, sizes within ``max_size``)."""
    if not isinstance(files, Sequence) or not 1 <= len(files) <= MAX_FILES:
        raise ForeignNameError("files", f"a group has 1 to {MAX_FILES} files")
    out: list[ForeignFileRef] = []
    seen: set[str] = set()
    for item in files:
        if not isinstance(item, Mapping):
            raise ForeignNameError("files", "each file is {name, digest, size}")
        name = check_name("name", item.get("name"))
        digest, size = item.get("digest"), item.get("size")
        if not isinstance(digest, str) or _HEX64.fullmatch(digest) is None:
            raise ForeignNameError("files", f"file {name}: digest must be 64 lowercase hex digits")
        if type(size) is not int or size < 0 or (max_size is not None and size > max_size):
            bound = "" if max_size is None else f" at most {max_size}"
            raise ForeignNameError("files", f"file {name}: size must be an integer{bound}")
        ref = ForeignFileRef(name, digest, size)
        if name in seen:
            if ref not in out:
                raise ForeignConflictError("files", f"file {name} is named twice, with other bytes")
            continue  # the same file named twice is named once
        seen.add(name)
        out.append(ref)
    return tuple(sorted(out, key=lambda f: f.name))
