"""The bundle format: many signed artifacts in one stream, the answer of ``POST /v1/bundle``
and the content of a ``.kcb`` file alike.

Streamable and bounded: every part is announced before it is read, so a reader never
holds more than one entry, and never reads further than an entry's header says::

    {"format": "kcache-bundle", "version": 1}\\n                 the header line
    {"recipe_key": K, "artifact": META, "signature": SIG, "size": N}\\n
    <N bytes>\\n                                                    one entry, repeated
    {"missing": K, "reason": "..."}\\n                             a key not served (server)
    {"end": true, "entries": E, "missing": M}\\n                   the trailer

``META`` is the artifact metadata of the API (:func:`kcache.artifact_header.parse_meta`),
``SIG`` the server's signature of the recipe key -> that metadata
(:class:`kcache.signing.Signature`). A line is at most :data:`MAX_LINE_BYTES`; an entry's
bytes at most what the reader accepts. A stream without its trailer, or whose trailer
does not count what came before it, is truncated (:class:`BundleError`): a reader can
tell a cut stream from a whole one, whatever it is cut at.

The reader checks the framing, that each entry's bytes have the size and the digest
its metadata names, and that the signature is well formed. Whether a *trusted* key made
the signature is the consumer's check (the client's :mod:`~kcache_client._trust`): the
core knows no keys.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

from kcache.artifact import ArtifactMeta
from kcache.artifact_header import parse_meta
from kcache.errors import KCacheError
from kcache.keys import is_hex_key
from kcache.signing import Signature, SignatureError

__all__ = [
    "BUNDLE_FORMAT",
    "BUNDLE_MEDIA_TYPE",
    "BUNDLE_VERSION",
    "MAX_LINE_BYTES",
    "BundleEntry",
    "BundleError",
    "BundleMissing",
    "BundleReader",
    "end_line",
    "entry_head",
    "header_line",
    "missing_line",
    "read_chunks",
]

BUNDLE_FORMAT = "kcache-bundle"
BUNDLE_VERSION = 1
BUNDLE_MEDIA_TYPE = "application/x-kcache-bundle"
#: The longest line (an entry's header: its metadata with the dependency list, a few KB).
MAX_LINE_BYTES = 4 << 20
_CHUNK = 1 << 20


class BundleError(KCacheError, ValueError):
    """A bundle stream or file that is malformed, truncated, damaged or over a bound."""


@dataclass(frozen=True)
class BundleEntry:
    """One artifact of a bundle: its bytes match the metadata's size and digest."""

    recipe_key: str
    meta: ArtifactMeta
    signature: Signature
    data: bytes


@dataclass(frozen=True)
class BundleMissing:
    """A recipe key the server could not put into the bundle, and why."""

    recipe_key: str
    reason: str


def _line(value: dict[str, Any]) -> bytes:
    return json.dumps(value, separators=(",", ":"), sort_keys=True).encode() + b"\n"


def header_line() -> bytes:
    """The first line of every bundle."""
    return _line({"format": BUNDLE_FORMAT, "version": BUNDLE_VERSION})


def entry_head(recipe_key: str, meta: ArtifactMeta, signature: Signature) -> bytes:
    """An entry's header line; its ``meta.size`` bytes and a newline follow."""
    return _line(
        {
            "recipe_key": recipe_key,
            "artifact": meta.to_dict(),
            "signature": signature.to_dict(),
            "size": meta.size,
        }
    )


def missing_line(recipe_key: str, reason: str) -> bytes:
    """A key that is not in the bundle."""
    return _line({"missing": recipe_key, "reason": reason[:1024]})


def end_line(entries: int, missing: int) -> bytes:
    """The trailer: without it, or with other counts, a reader takes the bundle as truncated."""
    return _line({"end": True, "entries": entries, "missing": missing})


def read_chunks(handle: BinaryIO, size: int = _CHUNK) -> Iterator[bytes]:
    """A file's bytes in chunks (what :class:`BundleReader` reads)."""
    while True:
        chunk = handle.read(size)
        if not chunk:
            return
        yield chunk


class BundleReader:
    """The items of a bundle from its bytes in chunks, checked as they arrive (module docstring).

    Iterating yields :class:`BundleEntry` and :class:`BundleMissing` in stream order and
    ends after a valid trailer; anything else raises :class:`BundleError` naming where.
    ``max_entry_bytes`` bounds each entry (checked on its header, before its bytes are read).
    """

    def __init__(self, chunks: Iterable[bytes], *, max_entry_bytes: int, where: str) -> None:
        self._chunks = iter(chunks)
        self._buffer = bytearray()
        self._done = False
        self.max_entry_bytes = max_entry_bytes
        self.where = where
        self.entries = 0
        self.missing = 0

    def _fill(self) -> bool:
        if self._done:
            return False
        for chunk in self._chunks:
            if chunk:
                self._buffer += chunk
                return True
        self._done = True
        return False

    def _read_line(self) -> bytes | None:
        """The next line without its newline; None at a clean end of the bytes."""
        start = 0
        while True:
            end = self._buffer.find(b"\n", start)
            if end >= 0:
                line = bytes(self._buffer[:end])
                del self._buffer[: end + 1]
                return line
            if len(self._buffer) > MAX_LINE_BYTES:
                raise BundleError(f"{self.where}: a line longer than {MAX_LINE_BYTES} bytes")
            start = len(self._buffer)
            if not self._fill():
                if self._buffer:
                    raise BundleError(f"{self.where}: truncated inside a line")
                return None

    def _read_exact(self, n: int) -> bytes:
        while len(self._buffer) < n:
            if not self._fill():
                raise BundleError(
                    f"{self.where}: truncated inside entry {self.entries + 1} "
                    f"({len(self._buffer)} of its {n} bytes)"
                )
        data = bytes(self._buffer[:n])
        del self._buffer[:n]
        return data

    def _json(self, line: bytes) -> dict[str, Any]:
        try:
            value = json.loads(line)
        except ValueError:
            raise BundleError(f"{self.where}: a line that is not JSON") from None
        if not isinstance(value, dict):
            raise BundleError(f"{self.where}: a line that is not a JSON object")
        return value

    def __iter__(self) -> Iterator[BundleEntry | BundleMissing]:
        first = self._read_line()
        if first is None:
            raise BundleError(f"{self.where}: empty, not a bundle")
        head = self._json(first)
        if head.get("format") != BUNDLE_FORMAT:
            raise BundleError(f"{self.where}: not a kcache bundle")
        if head.get("version") != BUNDLE_VERSION:
            raise BundleError(
                f"{self.where}: bundle version {head.get('version')!r}; this kcache reads "
                f"version {BUNDLE_VERSION}"
            )
        while True:
            raw = self._read_line()
            if raw is None:
                raise BundleError(
                    f"{self.where}: truncated after {self.entries} entries (no trailer)"
                )
            item = self._json(raw)
            if item.get("end") is True:
                if item.get("entries") != self.entries or item.get("missing") != self.missing:
                    raise BundleError(
                        f"{self.where}: the trailer counts {item.get('entries')} entries and "
                        f"{item.get('missing')} missing, the bundle held {self.entries} and "
                        f"{self.missing}"
                    )
                if self._buffer or self._fill():
                    raise BundleError(f"{self.where}: bytes after the trailer")
                return
            if "missing" in item:
                key = item.get("missing")
                if not is_hex_key(key):
                    raise BundleError(f"{self.where}: a missing line without a recipe key")
                self.missing += 1
                yield BundleMissing(str(key), str(item.get("reason", ""))[:1024])
                continue
            yield self._entry(item)

    def _entry(self, item: dict[str, Any]) -> BundleEntry:
        n = self.entries + 1
        key = item.get("recipe_key")
        if not is_hex_key(key):
            raise BundleError(f"{self.where}: entry {n} names no valid recipe key")
        try:
            meta = parse_meta(item.get("artifact"), f"entry {n}'s artifact")
        except ValueError as exc:
            raise BundleError(f"{self.where}: {exc}") from None
        size = item.get("size")
        if size != meta.size or not isinstance(size, int):
            raise BundleError(f"{self.where}: entry {n}'s size is not its metadata's")
        if size > self.max_entry_bytes:
            raise BundleError(
                f"{self.where}: entry {n} is {size} bytes, more than the {self.max_entry_bytes} "
                "accepted (max_artifact_bytes)"
            )
        try:
            signature = Signature.from_dict(item.get("signature"))
        except (SignatureError, TypeError, AttributeError) as exc:
            raise BundleError(f"{self.where}: entry {n}'s signature: {exc}") from None
        data = self._read_exact(size)
        if self._read_exact(1) != b"\n":
            raise BundleError(f"{self.where}: entry {n} is longer than its size")
        if hashlib.sha256(data).hexdigest() != meta.digest:
            raise BundleError(
                f"{self.where}: entry {n} (recipe {key}): its bytes do not hash to the digest "
                "its metadata names (damaged or tampered with)"
            )
        self.entries += 1
        return BundleEntry(str(key), meta, signature, data)
