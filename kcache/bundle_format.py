"""The bundle format: many signed artifacts in one stream, the answer of ``POST /v1/bundle``
and the content of a ``.kcb`` file alike.

Streamable and bounded: every part is announced before it is read, so a reader never
holds more than one entry, and never reads further than an entry's header says::

    {"format": "kcache-bundle", "version": 1}\\n                 the header line
    {"recipe_key": K, "artifact": META, "signature": SIG, "size": N}\\n
    <N bytes>\\n                                                    one entry, repeated
    {"missing": K, "reason": "..."}\\n                             a key not served (server)
    {"end": true, "entries": E, "missing": M, "signature": SIG}\\n  the trailer

``META`` is the artifact metadata of the API (:func:`kcache.artifact_header.parse_meta`),
``SIG`` the server's signature of the recipe key -> that metadata
(:class:`kcache.signing.Signature`). The trailer's ``SIG`` (a server's answer has it; a
file need not) signs every entry's binding at once (:class:`kcache.signing.BundleDigest`),
so a reader can check one signature instead of one per entry. A line is at most :data:`MAX_LINE_BYTES`; an entry's
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
from dataclasses import dataclass, field
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
    "EntryHead",
    "IndexedEntry",
    "check_entry_bytes",
    "end_line",
    "entry_head",
    "header_line",
    "index_bundle",
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
    #: The entry's header line as read (without its newline), when it was read from a
    #: bundle: a writer of the same entry can copy it instead of encoding it again.
    head: bytes = field(default=b"", repr=False, compare=False)


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


def end_line(entries: int, missing: int, signature: Signature | None = None) -> bytes:
    """The trailer: without it, or with other counts, a reader takes the bundle as truncated.

    ``signature``: the signer's over all entries (:class:`kcache.signing.BundleDigest`).
    """
    trailer: dict[str, Any] = {"end": True, "entries": entries, "missing": missing}
    if signature is not None:
        trailer["signature"] = signature.to_dict()
    return _line(trailer)


def read_chunks(handle: BinaryIO, size: int = _CHUNK) -> Iterator[bytes]:
    """A file's bytes in chunks (what :class:`BundleReader` reads)."""
    while True:
        chunk = handle.read(size)
        if not chunk:
            return
        yield chunk


@dataclass(frozen=True)
class EntryHead:
    """An entry's header line, checked: what its bytes must be (``size`` of them, hashing to
    ``meta.digest``) and who signed it (well formed; whether trusted is the consumer's check)."""

    recipe_key: str
    meta: ArtifactMeta
    signature: Signature

    @property
    def size(self) -> int:
        return self.meta.size


def _json_object(line: bytes, where: str) -> dict[str, Any]:
    try:
        value = json.loads(line)
    except ValueError:
        raise BundleError(f"{where}: a line that is not JSON") from None
    if not isinstance(value, dict):
        raise BundleError(f"{where}: a line that is not a JSON object")
    return value


def _check_header(line: bytes | None, where: str) -> None:
    if line is None:
        raise BundleError(f"{where}: empty, not a bundle")
    head = _json_object(line, where)
    if head.get("format") != BUNDLE_FORMAT:
        raise BundleError(f"{where}: not a kcache bundle")
    if head.get("version") != BUNDLE_VERSION:
        raise BundleError(
            f"{where}: bundle version {head.get('version')!r}; this kcache reads "
            f"version {BUNDLE_VERSION}"
        )


def _check_trailer(item: dict[str, Any], entries: int, missing: int, where: str) -> None:
    if item.get("entries") != entries or item.get("missing") != missing:
        raise BundleError(
            f"{where}: the trailer counts {item.get('entries')} entries and "
            f"{item.get('missing')} missing, the bundle held {entries} and {missing}"
        )


def _trailer_signature(item: dict[str, Any], where: str) -> Signature | None:
    if "signature" not in item:
        return None
    try:
        return Signature.from_dict(item["signature"])
    except SignatureError as exc:
        raise BundleError(f"{where}: the trailer's signature: {exc}") from None


def _missing(item: dict[str, Any], where: str) -> BundleMissing:
    key = item.get("missing")
    if not is_hex_key(key):
        raise BundleError(f"{where}: a missing line without a recipe key")
    return BundleMissing(str(key), str(item.get("reason", ""))[:1024])


def _entry_head(item: dict[str, Any], n: int, max_entry_bytes: int, where: str) -> EntryHead:
    """Entry ``n``'s header checked: key, metadata, size (within ``max_entry_bytes``), signature."""
    key = item.get("recipe_key")
    if not is_hex_key(key):
        raise BundleError(f"{where}: entry {n} names no valid recipe key")
    try:
        meta = parse_meta(item.get("artifact"), f"entry {n}'s artifact")
    except ValueError as exc:
        raise BundleError(f"{where}: {exc}") from None
    size = item.get("size")
    if size != meta.size or not isinstance(size, int):
        raise BundleError(f"{where}: entry {n}'s size is not its metadata's")
    if size > max_entry_bytes:
        raise BundleError(
            f"{where}: entry {n} is {size} bytes, more than the {max_entry_bytes} "
            "accepted (max_artifact_bytes)"
        )
    try:
        signature = Signature.from_dict(item.get("signature"))
    except (SignatureError, TypeError, AttributeError) as exc:
        raise BundleError(f"{where}: entry {n}'s signature: {exc}") from None
    return EntryHead(str(key), meta, signature)


def check_entry_bytes(head: EntryHead, data: bytes, where: str) -> None:
    """Refuse bytes that do not hash to the digest the entry's metadata names."""
    if hashlib.sha256(data).hexdigest() != head.meta.digest:
        raise BundleError(
            f"{where}: the entry of recipe {head.recipe_key}: its bytes do not hash to the "
            "digest its metadata names (damaged or tampered with)"
        )


class BundleReader:
    """The items of a bundle from its bytes in chunks, checked as they arrive (module docstring).

    Iterating yields :class:`BundleEntry` and :class:`BundleMissing` in stream order and
    ends after a valid trailer; anything else raises :class:`BundleError` naming where.
    ``max_entry_bytes`` bounds each entry (checked on its header, before its bytes are read);
    ``max_items``, when given, the entries and missing lines together (a reader of a
    server's answer knows how many keys it asked for: each is answered at most once), so
    that a stream of endless lines is refused at the first one past it.
    """

    def __init__(
        self,
        chunks: Iterable[bytes],
        *,
        max_entry_bytes: int,
        where: str,
        max_items: int | None = None,
    ) -> None:
        self._chunks = iter(chunks)
        self._buffer = bytearray()
        self._pos = 0  # what of the buffer is read (dropped from its front now and then)
        self._done = False
        self.max_entry_bytes = max_entry_bytes
        self.max_items = max_items
        self.where = where
        self.entries = 0
        self.missing = 0
        #: The trailer's signature over every entry, once the trailer is read (None: it had none).
        self.signature: Signature | None = None

    def _fill(self) -> bool:
        if self._done:
            return False
        for chunk in self._chunks:
            if chunk:
                if self._pos:  # one move per chunk, not one per line read
                    del self._buffer[: self._pos]
                    self._pos = 0
                self._buffer += chunk
                return True
        self._done = True
        return False

    def _read_line(self) -> bytes | None:
        """The next line without its newline; None at a clean end of the bytes."""
        start = self._pos
        while True:
            end = self._buffer.find(b"\n", start)
            if end >= 0:
                line = bytes(self._buffer[self._pos : end])
                self._pos = end + 1
                return line
            if len(self._buffer) - self._pos > MAX_LINE_BYTES:
                raise BundleError(f"{self.where}: a line longer than {MAX_LINE_BYTES} bytes")
            start = len(self._buffer) - self._pos
            if not self._fill():
                if len(self._buffer) > self._pos:
                    raise BundleError(f"{self.where}: truncated inside a line")
                return None
            start += self._pos

    def _read_exact(self, n: int) -> bytes:
        while len(self._buffer) - self._pos < n:
            if not self._fill():
                raise BundleError(
                    f"{self.where}: truncated inside entry {self.entries + 1} "
                    f"({len(self._buffer) - self._pos} of its {n} bytes)"
                )
        data = bytes(self._buffer[self._pos : self._pos + n])
        self._pos += n
        return data

    def __iter__(self) -> Iterator[BundleEntry | BundleMissing]:
        _check_header(self._read_line(), self.where)
        while True:
            raw = self._read_line()
            if raw is None:
                raise BundleError(
                    f"{self.where}: truncated after {self.entries} entries (no trailer)"
                )
            item = _json_object(raw, self.where)
            if item.get("end") is True:
                _check_trailer(item, self.entries, self.missing, self.where)
                self.signature = _trailer_signature(item, self.where)
                if len(self._buffer) > self._pos or self._fill():
                    raise BundleError(f"{self.where}: bytes after the trailer")
                return
            if self.max_items is not None and self.entries + self.missing >= self.max_items:
                raise BundleError(
                    f"{self.where}: more than the {self.max_items} entries and missing lines "
                    "it may hold (one per key asked for)"
                )
            if "missing" in item:
                self.missing += 1
                yield _missing(item, self.where)
                continue
            yield self._entry(item, raw)

    def _entry(self, item: dict[str, Any], line: bytes) -> BundleEntry:
        head = _entry_head(item, self.entries + 1, self.max_entry_bytes, self.where)
        data = self._read_exact(head.size)
        if self._read_exact(1) != b"\n":
            raise BundleError(f"{self.where}: {_misframed(self.entries + 1, head.size, data)}")
        check_entry_bytes(head, data, self.where)
        self.entries += 1
        return BundleEntry(head.recipe_key, head.meta, head.signature, data, line)


@dataclass(frozen=True)
class IndexedEntry(EntryHead):
    """An entry's checked header and where its bytes lie in a bundle file: ``size`` of them
    from ``offset``. One object per entry (a tier indexes every entry of its packs, and a
    rank holding 800 kernels crosses the collector's thresholds with fewer objects)."""

    offset: int


def index_bundle(handle: BinaryIO, *, max_entry_bytes: int, where: str) -> list[IndexedEntry]:
    """The entries of a seekable bundle file, their framing checked, their bytes not read.

    The header, each entry's header line (as :class:`BundleReader` checks them), that
    each entry's bytes are followed by the newline its size puts there, and the trailer.
    The bytes are not hashed: whoever reads an entry checks them then
    (:func:`check_entry_bytes`), so a reader that needs a few entries of a large file
    hashes only those. Raises :class:`BundleError` for anything else, truncation included.
    """
    _check_header(_file_line(handle, where), where)
    found: list[IndexedEntry] = []
    missing = 0
    while True:
        raw = _file_line(handle, where)
        if raw is None:
            raise BundleError(f"{where}: truncated after {len(found)} entries (no trailer)")
        item = _json_object(raw, where)
        if item.get("end") is True:
            _check_trailer(item, len(found), missing, where)
            if handle.read(1):
                raise BundleError(f"{where}: bytes after the trailer")
            return found
        if "missing" in item:
            _missing(item, where)
            missing += 1
            continue
        head = _entry_head(item, len(found) + 1, max_entry_bytes, where)
        offset = handle.tell()
        handle.seek(head.size, 1)
        end = handle.read(1)
        if end != b"\n":
            if not end:
                raise BundleError(f"{where}: entry {len(found) + 1} is truncated")
            handle.seek(offset)
            data = handle.read(head.size)
            raise BundleError(f"{where}: {_misframed(len(found) + 1, head.size, data)}")
        found.append(IndexedEntry(head.recipe_key, head.meta, head.signature, offset))


def _misframed(number: int, size: int, data: bytes) -> str:
    """Why entry ``number``'s ``size`` bytes (``data``) are not followed by its newline.

    Its bytes ran short when the next entry's header line begins inside them (a
    newline, then a JSON object): the reader took that line for the entry's tail.
    """
    cut = data.find(b'\n{"')
    if cut >= 0:
        return (
            f"entry {number} is shorter than its size ({size} bytes): the next header line "
            f"begins after {cut} of them"
        )
    return f"entry {number} is longer than its size ({size} bytes)"


def _file_line(handle: BinaryIO, where: str) -> bytes | None:
    line = handle.readline(MAX_LINE_BYTES + 1)
    if not line:
        return None
    if not line.endswith(b"\n"):
        if len(line) > MAX_LINE_BYTES:
            raise BundleError(f"{where}: a line longer than {MAX_LINE_BYTES} bytes")
        raise BundleError(f"{where}: truncated inside a line")
    return line[:-1]
