"""The foreign section of a bundle answer: a job's foreign groups, each whole, in front of its kernels.

``POST /v1/bundle`` with ``foreign`` names answers this section first, then the kcache
bundle (:mod:`kcache.bundle_format`) as always (docs/design.md section 10)::

    {"format": "kcache-foreign-groups", "version": 1}\\n                header
    {"foreign": BK, "binding": {...}, "signature": SIG, "size": N}\\n
    <N bytes: the group's files, in the binding's order>\\n             a group, repeated
    {"foreign_missing": BK, "reason": "..."}\\n                        a name not served
    {"end": "foreign", "groups": G, "missing": M}\\n                   the section's end

``BK`` is the binding key, ``{...}`` the binding (library, version, target, toolchain,
key, files: name, digest, size; writer), ``SIG`` the server's signature of "published by
<writer>" (:meth:`kcache.foreign.ForeignBinding.message`). The groups are kept out of the
kcache bundle on purpose: its entries are kcache's signed artifacts, which packs, bundle
files and layers hold and shared tiers trust; a foreign group is none of those.

:class:`ForeignSectionReader` checks the framing, that the announced size is the sum of
the binding's files, each within the reader's bound, and that every file's bytes hash
to its digest, before it yields the group: a group comes whole or raises
:class:`~kcache.bundle_format.BundleError`. Whether a trusted key made the signature is
the consumer's check. :meth:`ForeignSectionReader.rest` is the answer after the section.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from kcache.bundle_format import MAX_LINE_BYTES, BundleError
from kcache.foreign import ForeignBinding, ForeignName, ForeignNameError, check_files
from kcache.signing import Signature, SignatureError

__all__ = [
    "SECTION_FORMAT",
    "ForeignGroup",
    "ForeignMissing",
    "ForeignSectionReader",
    "end_line",
    "group_head",
    "header_line",
    "missing_line",
]

SECTION_FORMAT = "kcache-foreign-groups"
SECTION_VERSION = 1


def _line(value: dict[str, Any]) -> bytes:
    return json.dumps(value, separators=(",", ":"), sort_keys=True).encode() + b"\n"


def header_line() -> bytes:
    """The section's first line."""
    return _line({"format": SECTION_FORMAT, "version": SECTION_VERSION})


def group_head(binding: ForeignBinding, signature: Signature) -> bytes:
    """The line announcing a group; its files' bytes (in ``binding.files`` order) and a newline follow."""
    body = {
        **binding.name.to_dict(),
        "files": [f.to_dict() for f in binding.files],
        "writer": binding.writer,
    }
    return _line(
        {
            "foreign": binding.binding_key,
            "binding": body,
            "signature": signature.to_dict(),
            "size": binding.size,
        }
    )


def missing_line(key: str, reason: str) -> bytes:
    """A name asked for and not served (``key``: its binding key)."""
    return _line({"foreign_missing": key, "reason": reason[:500]})


def end_line(groups: int, missing: int) -> bytes:
    """The section's last line."""
    return _line({"end": "foreign", "groups": groups, "missing": missing})


@dataclass(frozen=True)
class ForeignGroup:
    """A group of the section: its binding, the server's signature, and every file's bytes (checked)."""

    binding: ForeignBinding
    signature: Signature
    files: dict[str, bytes]


@dataclass(frozen=True)
class ForeignMissing:
    """A name the server did not serve."""

    binding_key: str
    reason: str


class ForeignSectionReader:
    """The section's items from the answer's chunks, each group checked whole (module docstring).

    ``max_file_bytes`` bounds each file (checked on the group's line, before its bytes
    are read), ``max_items`` the groups and missing lines together (one per name asked).
    """

    def __init__(
        self, chunks: Iterable[bytes], *, max_file_bytes: int, max_items: int, where: str
    ) -> None:
        self._chunks = iter(chunks)
        self._buffer = bytearray()
        self._pos = 0
        self.max_file_bytes = max_file_bytes
        self.max_items = max_items
        self.where = where
        self.groups = 0
        self.missing = 0

    def _fill(self) -> bool:
        for chunk in self._chunks:
            if chunk:
                del self._buffer[: self._pos]
                self._pos = 0
                self._buffer += chunk
                return True
        return False

    def _read_line(self) -> bytes:
        start = self._pos
        while (end := self._buffer.find(b"\n", start)) < 0:
            if len(self._buffer) - self._pos > MAX_LINE_BYTES:
                raise BundleError(f"{self.where}: a line longer than {MAX_LINE_BYTES} bytes")
            start = len(self._buffer) - self._pos
            if not self._fill():
                raise BundleError(f"{self.where}: the foreign section is truncated")
            start += self._pos
        line = bytes(self._buffer[self._pos : end])
        self._pos = end + 1
        return line

    def _read_exact(self, n: int) -> bytes:
        while len(self._buffer) - self._pos < n:
            if not self._fill():
                raise BundleError(f"{self.where}: truncated inside foreign group {self.groups + 1}")
        data = bytes(self._buffer[self._pos : self._pos + n])
        self._pos += n
        return data

    def _json(self) -> dict[str, Any]:
        try:
            item = json.loads(self._read_line())
        except ValueError:
            raise BundleError(f"{self.where}: a foreign section line that is not JSON") from None
        if not isinstance(item, dict):
            raise BundleError(f"{self.where}: a foreign section line that is not an object")
        return item

    def __iter__(self) -> Iterator[ForeignGroup | ForeignMissing]:
        head = self._json()
        if head.get("format") != SECTION_FORMAT or head.get("version") != SECTION_VERSION:
            raise BundleError(
                f"{self.where}: not a foreign section of version {SECTION_VERSION} ({head!r:.200})"
            )
        while True:
            item = self._json()
            if item.get("end") == "foreign":
                if item.get("groups") != self.groups or item.get("missing") != self.missing:
                    raise BundleError(
                        f"{self.where}: the foreign section's end counts {item.get('groups')} "
                        f"groups and {item.get('missing')} missing, not the {self.groups} and "
                        f"{self.missing} it held"
                    )
                return
            if self.groups + self.missing >= self.max_items:
                raise BundleError(
                    f"{self.where}: more than the {self.max_items} foreign groups and missing "
                    "lines it may hold (one per name asked for)"
                )
            if "foreign_missing" in item:
                key, reason = item.get("foreign_missing"), item.get("reason", "")
                if not isinstance(key, str) or not isinstance(reason, str):
                    raise BundleError(f"{self.where}: a malformed foreign missing line")
                self.missing += 1
                yield ForeignMissing(key, reason)
                continue
            yield self._group(item)

    def _group(self, item: dict[str, Any]) -> ForeignGroup:
        n = self.groups + 1
        try:
            body = item["binding"]
            name = ForeignName.checked(body)
            files = check_files(body["files"], self.max_file_bytes)
            binding = ForeignBinding(name, files, str(body["writer"]))
            signature = Signature.from_dict(item["signature"])
            size = item["size"]
        except (KeyError, TypeError, ForeignNameError, SignatureError) as exc:
            raise BundleError(f"{self.where}: foreign group {n} is malformed ({exc})") from None
        if item.get("foreign") != binding.binding_key:
            raise BundleError(f"{self.where}: foreign group {n} names another binding key")
        if type(size) is not int or size != binding.size:
            raise BundleError(
                f"{self.where}: foreign group {n} announces {size!r} bytes, its files make "
                f"{binding.size}"
            )
        data = self._read_exact(size)
        if self._read_exact(1) != b"\n":
            raise BundleError(f"{self.where}: foreign group {n} is not followed by a newline")
        out: dict[str, bytes] = {}
        offset = 0
        for ref in binding.files:
            piece = data[offset : offset + ref.size]
            offset += ref.size
            if hashlib.sha256(piece).hexdigest() != ref.digest:
                raise BundleError(
                    f"{self.where}: file {ref.name} of foreign group {n} "
                    f"({name.library}:{name.key}) does not hash to its digest"
                )
            out[ref.name] = piece
        self.groups += 1
        return ForeignGroup(binding, signature, out)

    def rest(self) -> Iterator[bytes]:
        """The answer's bytes after the section (what is buffered, then the rest as it comes)."""
        left = bytes(self._buffer[self._pos :])
        self._buffer.clear()
        self._pos = 0
        if left:
            yield left
        yield from self._chunks
