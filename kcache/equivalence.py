"""Are two compiler outputs the same code? The comparator behind "verified hits".

The server recompiles a sample of the artifacts it serves and compares the fresh
output with the stored one. Two compiles of one program by one NVRTC differ in one
way only: the *module id* that EDG (NVRTC's front end) builds into the names of
internal-linkage entities. Where a translation unit has no non-template external
definition (a template kernel reached by a name expression or an explicit
instantiation, say), EDG has nothing stable to derive the id from and puts in 8 hex
digits that change with the clock (from one second to the next, in one process too)
and the compiling process's id. Observed with NVRTC 13.5 (one ``BlockReduce<float, N>``
template kernel compiled in two processes, and a kernel in an anonymous namespace)::

    _ZN44_INTERNAL_00000000_9_kernel_cu_ff6abace_77514cuda3std3__45__cpo5beginE
    _ZN44_INTERNAL_00000000_9_kernel_cu_0bc45642_77894cuda3std3__45__cpo5beginE
    _ZN46_GLOBAL__N__00000000_9_kernel_cu_d6da7603_87451kILi3EEEvPf   (anonymous namespace)

The module id is ``_<8 hex>_<n>_<program name, n chars>_<8 hex>_<pid>``, found after
``_INTERNAL`` (``cuda::std`` constants, CUB's internal globals, ``static`` entities)
and ``_GLOBAL__N_`` (anonymous namespaces), and in a mangled name it is part of a
source name with a decimal length in front (``44`` above), so a pid of another number
of digits (4 and 5 digits were both seen in one test session) changes that length,
the string tables' sizes and every offset after them.
A translation unit that has a non-template external definition gets a deterministic
id instead (the name of the first one, up to 8 characters, else an 8-hex hash of it:
``_INTERNAL_00000000_9_kernel_cu_aa365677``); such programs compile to identical bytes.

Method. Each file's random module ids are found by their shape (length-prefixed,
so the pid's end is known exactly), in order of first appearance. Stored and fresh
must have as many, pairwise equal but for the trailing ``_<8 hex>_<pid>``; otherwise
nothing is unified. Each file is then split at every occurrence of one of its ids
(with ``_INTERNAL`` or ``_GLOBAL__N_`` and the right length prefix before it, or
bare), keeping which id and which form stood there: the pieces between are compared
byte for byte and the tokens by (id's rank, form). Given the ids, the split is
invertible (joining the pieces with the ids gives the file back), so equal splits
mean ``fresh`` *is* ``stored`` with each of stored's ids replaced by its partner
everywhere: a bijective renaming of internal-linkage names and nothing else. Names
with internal linkage are invisible outside the module and referenced only by name
inside it, so the renaming cannot change behaviour, and every other byte is equal.

- PTX (text) and cubins whose ids have equal lengths are compared split as a whole.
- A cubin whose ids differ in length has its layout shifted; it is parsed as ELF64
  (with :mod:`struct`, no dependency) and compared structurally instead: the ELF
  header but for table offsets; every section by index, its name split as above, its
  header fields but for offset (and size, where the contents are compared split),
  its contents split (symbol tables symbol by symbol, names split, other fields
  exact); program headers with each offset as (section, offset in it), and the bytes
  each one loads split-compared; and bytes outside every section zero in both or
  equal. Equal structure without ids of other lengths to explain a shifted layout is
  still ``different``: NVRTC lays one program out one way. Section order is compared
  as it is: NVRTC has never been seen to reorder sections or symbols by a tag, and a
  reorder is reported as a difference, not explained away.
- LTO-IR is compared byte for byte only. Its payload after a 40-byte header is
  scrambled (a one-tag difference changes nearly every byte while the size stays),
  so no renaming can be seen in it; programs that draw a random id therefore report
  ``different`` as LTO-IR, with a detail saying why.

Limits (all on the side of saying ``different``): a section that stores a tagged name
in a layout with offsets (``-G``'s DWARF) compares equal only when the ids have equal
lengths; a changed order of sections or symbols, or two translation units' ids that
pair up in another order, are differences. A ``normalised`` match means the same code
under other internal names: a kernel in an anonymous namespace has another lowered
name in the fresh output, so each artifact goes with its own lowered names.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = ["DETAIL_MAX_CHARS", "Comparison", "How", "compare_outputs"]

How = Literal["bytes", "normalised", "different"]

#: The longest ``Comparison.detail``: a sentence for a log line or an audit row.
DETAIL_MAX_CHARS = 500


@dataclass(frozen=True)
class Comparison:
    """The verdict on two compiler outputs.

    ``how`` is "bytes" (byte-identical), "normalised" (equal once the random
    internal-linkage tags are unified) or "different"; ``detail`` is empty when
    ``same``, else one sentence naming the first difference found.
    """

    same: bool
    how: How
    detail: str = ""

    def __post_init__(self) -> None:
        # Bounded whatever the caller passes: details quote names, which can be long.
        if len(self.detail) > DETAIL_MAX_CHARS:
            object.__setattr__(self, "detail", self.detail[: DETAIL_MAX_CHARS - 3] + "...")


def compare_outputs(stored: bytes, fresh: bytes, kind: str) -> Comparison:
    """Decide whether ``stored`` and ``fresh``, two outputs of one recipe, are the same code.

    ``kind`` is "cubin", "ptx" or "ltoir" (anything else raises :class:`ValueError`).
    Malformed or truncated input is never an error: it is "different", with a detail.
    """
    if kind not in ("cubin", "ptx", "ltoir"):
        raise ValueError(f"kind must be 'cubin', 'ptx' or 'ltoir', not {kind!r}")
    if stored == fresh:
        return Comparison(True, "bytes")
    if kind == "ltoir":
        return _different(
            f"the LTO-IR differs ({_size_or_offset(stored, fresh)}); LTO-IR is compared "
            "byte for byte, as its payload is opaque and a random internal-linkage tag "
            "cannot be told from a real change in it"
        )
    if kind == "ptx":
        return _compare_ptx(stored, fresh)
    return _compare_cubin(stored, fresh)


def _different(detail: str) -> Comparison:
    return Comparison(False, "different", detail)


def _size_or_offset(a: bytes, b: bytes) -> str:
    if len(a) != len(b):
        return f"sizes differ: {len(a)} bytes stored, {len(b)} fresh"
    return f"first at byte {_common_prefix(a, b)} of {len(a)}"


def _common_prefix(a: bytes, b: bytes) -> int:
    """The length of the longest common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]: halve with C-speed slice compares
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _show(name: bytes, limit: int = 120) -> str:
    """A name for a detail sentence: decoded, and cut in the middle when long."""
    text = name.decode("utf-8", "backslashreplace")
    if len(text) <= limit:
        return text
    half = (limit - 3) // 2
    return f"{text[:half]}...{text[-half:]}"


# --- the random module id -------------------------------------------------------------

#: What EDG puts before a module id; each form's identifier is this plus the id.
_ID_PREFIXES = (b"_INTERNAL", b"_GLOBAL__N_")
#: A length-prefixed identifier that may hold a module id. The length is some suffix
#: of group 1 (digits of a pid or a template argument can run into it). Bounded counts
#: keep hostile input linear: a long run of digits costs no backtracking, nor a huge int.
_ID_HEAD_RE = re.compile(rb"([0-9]{1,6})(_INTERNAL|_GLOBAL__N_)_[0-9a-f]{8}_")
#: A module id up to its program name: ``_<8 hex>_<n>_``, the name's n characters follow.
_ID_START_RE = re.compile(rb"\A_[0-9a-f]{8}_([1-9][0-9]{0,5})_")
_ID_NAME_RE = re.compile(rb"[A-Za-z0-9_]+")
#: The random end of a module id: ``_<8 hex>_<pid>``.
_ID_RANDOM_END_RE = re.compile(rb"_[0-9a-f]{8}_[0-9]{1,10}")


def _split_id(module_id: bytes) -> tuple[bytes, bytes] | None:
    """A random-shaped module id as (stable part, random part), else None."""
    start = _ID_START_RE.search(module_id)
    if start is None:
        return None
    name_end = start.end() + int(start.group(1))
    if not _ID_NAME_RE.fullmatch(module_id, start.end(), name_end):
        return None
    if not _ID_RANDOM_END_RE.fullmatch(module_id, name_end):
        return None
    return module_id[:name_end], module_id[name_end:]


def _random_id(ident: bytes) -> bytes | None:
    """The module id in ``ident`` (``_INTERNAL`` or ``_GLOBAL__N_`` and an id), if random-shaped."""
    for prefix in _ID_PREFIXES:
        if ident.startswith(prefix) and _split_id(ident[len(prefix) :]) is not None:
            return ident[len(prefix) :]
    return None


def _find_random_ids(data: bytes) -> list[bytes]:
    """The distinct random module ids in ``data``, in order of first appearance.

    Only length-prefixed occurrences (mangled names) are trusted to find an id: the
    prefix says where the pid ends. Bare occurrences are unified later all the same.
    """
    found: dict[bytes, None] = {}
    for match in _ID_HEAD_RE.finditer(data):
        digits = match.group(1)
        start = match.start(2)
        for i in range(len(digits) - 1, -1, -1):  # shortest length first
            if digits[i : i + 1] == b"0":
                continue  # a mangled length has no leading zero
            module_id = _random_id(data[start : start + int(digits[i:])])
            if module_id is not None:
                found.setdefault(module_id, None)
                break
    return list(found)


def _stable_part(module_id: bytes) -> bytes:
    parts = _split_id(module_id)
    assert parts is not None  # only ids _random_id accepted get here
    return parts[0]


#: One file split at its ids: pieces of bytes between them, and (id rank, form) tokens.
_Split = tuple[tuple[bytes, ...], tuple[tuple[int, int], ...]]


class _Tags:
    """One file's random module ids, and the split of its bytes at them."""

    def __init__(self, ids: Sequence[bytes]) -> None:
        self.ids = tuple(ids)
        self._form: dict[bytes, tuple[int, int]] = {}
        for rank, module_id in enumerate(self.ids):
            for form, prefix in enumerate(_ID_PREFIXES):
                ident = prefix + module_id
                self._form[str(len(ident)).encode() + ident] = (rank, form)
            self._form[module_id] = (rank, len(_ID_PREFIXES))  # bare
        # Longest first, so that at one position a length-prefixed form wins over the bare id.
        literals = sorted(self._form, key=len, reverse=True)
        self._pattern = (
            re.compile(b"(" + b"|".join(re.escape(lit) for lit in literals) + b")")
            if literals
            else None
        )

    def split(self, data: bytes) -> _Split:
        """``data`` cut at every occurrence of one of the ids' forms."""
        if self._pattern is None:
            return (data,), ()
        parts = self._pattern.split(data)
        return tuple(parts[0::2]), tuple(self._form[lit] for lit in parts[1::2])

    def literal(self, token: tuple[int, int]) -> bytes:
        """The bytes a token stands for in this file."""
        rank, form = token
        module_id = self.ids[rank]
        if form == len(_ID_PREFIXES):
            return module_id
        ident = _ID_PREFIXES[form] + module_id
        return str(len(ident)).encode() + ident


def _pair_tags(stored: bytes, fresh: bytes) -> tuple[_Tags, _Tags, str]:
    """Both files' ids, paired by rank, or two empty sets and why they do not pair."""
    ids_a, ids_b = _find_random_ids(stored), _find_random_ids(fresh)
    if len(ids_a) != len(ids_b):
        why = (
            f"stored has {len(ids_a)} random internal-linkage tag(s), fresh has {len(ids_b)}, "
            "so none were unified"
        )
        return _Tags(()), _Tags(()), why
    for a, b in zip(ids_a, ids_b, strict=True):
        if _stable_part(a) != _stable_part(b):
            why = (
                f"the internal-linkage tags {_show(a)} and {_show(b)} differ in more than their "
                "random part, so none were unified"
            )
            return _Tags(()), _Tags(()), why
    return _Tags(ids_a), _Tags(ids_b), ""


def _first_split_difference(
    a: _Split, b: _Split, tags_a: _Tags, tags_b: _Tags
) -> tuple[int, int] | None:
    """Where two splits part, as offsets in the two files' bytes; None when equal."""
    pieces_a, tokens_a = a
    pieces_b, tokens_b = b
    off_a = off_b = 0
    for i in range(max(len(pieces_a), len(pieces_b))):
        if i >= len(pieces_a) or i >= len(pieces_b):
            return off_a, off_b
        if pieces_a[i] != pieces_b[i]:
            common = _common_prefix(pieces_a[i], pieces_b[i])
            return off_a + common, off_b + common
        off_a += len(pieces_a[i])
        off_b += len(pieces_b[i])
        if i < len(tokens_a) and i < len(tokens_b):
            if tokens_a[i] != tokens_b[i]:
                return off_a, off_b
            off_a += len(tags_a.literal(tokens_a[i]))
            off_b += len(tags_b.literal(tokens_b[i]))
        elif i < len(tokens_a) or i < len(tokens_b):
            return off_a, off_b
    return None


# --- PTX ------------------------------------------------------------------------------


def _compare_ptx(stored: bytes, fresh: bytes) -> Comparison:
    tags_a, tags_b, why = _pair_tags(stored, fresh)
    where = _first_split_difference(tags_a.split(stored), tags_b.split(fresh), tags_a, tags_b)
    if where is None:
        # Without ids a split is the bytes themselves: equal splits here unified ids.
        return Comparison(True, "normalised")
    off_a, off_b = where
    line = stored.count(b"\n", 0, off_a) + 1
    detail = (
        f"the PTX differs at line {line}: stored {_show(_line_at(stored, off_a), 150)!r}, "
        f"fresh {_show(_line_at(fresh, off_b), 150)!r}"
    )
    return _different(f"{why}; {detail}" if why else detail)


def _line_at(text: bytes, offset: int) -> bytes:
    start = text.rfind(b"\n", 0, offset) + 1
    end = text.find(b"\n", offset)
    return text[start : end if end >= 0 else len(text)]


# --- cubins: ELF64 --------------------------------------------------------------------

_SHT_SYMTAB = 2
_SHT_STRTAB = 3
_SHT_NOBITS = 8
_SHT_DYNSYM = 11
_SYM_SIZE = 24
_EHDR = struct.Struct("<16sHHIQQQIHHHHHH")
_SHDR = struct.Struct("<IIQQQQIIQQ")
_PHDR = struct.Struct("<IIQQQQQQ")
_SYM = struct.Struct("<IBBHQQ")
# The ELF header's fields in order; e_phoff and e_shoff (unnamed here) are layout only.
_EHDR_FIELDS = (
    "e_ident",
    "e_type",
    "e_machine",
    "e_version",
    "e_entry",
    "",
    "",
    "e_flags",
    "e_ehsize",
    "e_phentsize",
    "e_phnum",
    "e_shentsize",
    "e_shnum",
    "e_shstrndx",
)


class _Malformed(Exception):
    """The bytes are not an ELF64 file this comparator can read; the message says why."""


@dataclass(frozen=True)
class _Section:
    index: int
    name: bytes
    type: int
    flags: int
    addr: int
    offset: int
    size: int
    link: int
    info: int
    addralign: int
    entsize: int

    def contents(self, data: bytes) -> bytes:
        return b"" if self.type == _SHT_NOBITS else data[self.offset : self.offset + self.size]


@dataclass(frozen=True)
class _Elf:
    data: bytes
    header: tuple[int | bytes, ...]  # every e_* field, in order
    phoff: int
    shoff: int
    sections: tuple[_Section, ...]
    segments: tuple[tuple[int, ...], ...]  # p_type, p_flags, p_offset, ... in order


def _parse_elf(data: bytes) -> _Elf:
    """The ELF64 little-endian file in ``data``, bounds-checked, or :class:`_Malformed`."""
    if len(data) < _EHDR.size or data[:4] != b"\x7fELF":
        raise _Malformed(f"it is not an ELF file ({len(data)} bytes, no ELF header)")
    if data[4] != 2 or data[5] != 1:
        raise _Malformed("it is not a little-endian ELF64 file")
    header = _EHDR.unpack_from(data, 0)
    phoff, shoff = header[5], header[6]
    phentsize, phnum, shentsize, shnum, shstrndx = header[9:14]
    if shnum and shentsize != _SHDR.size:
        raise _Malformed(f"its section headers are {shentsize} bytes, not {_SHDR.size}")
    if phnum and phentsize != _PHDR.size:
        raise _Malformed(f"its program headers are {phentsize} bytes, not {_PHDR.size}")
    if shoff + shnum * _SHDR.size > len(data):
        raise _Malformed(f"its section headers run past its end ({len(data)} bytes)")
    if phoff + phnum * _PHDR.size > len(data):
        raise _Malformed(f"its program headers run past its end ({len(data)} bytes)")
    raw = [_SHDR.unpack_from(data, shoff + i * _SHDR.size) for i in range(shnum)]
    for i, fields in enumerate(raw):
        if fields[1] != _SHT_NOBITS and fields[4] + fields[5] > len(data):
            raise _Malformed(f"section {i} runs past its end ({len(data)} bytes)")
    if shnum and not 0 < shstrndx < shnum:
        raise _Malformed(f"its section name table index {shstrndx} is out of range")
    names = raw[shstrndx] if shnum else None
    sections = []
    for i, fields in enumerate(raw):
        name = (
            b""
            if names is None
            else _string(data, names[4], names[5], fields[0], f"section {i}'s name")
        )
        sections.append(_Section(i, name, *fields[1:]))
    segments = tuple(_PHDR.unpack_from(data, phoff + i * _PHDR.size) for i in range(phnum))
    for i, segment in enumerate(segments):
        if segment[2] + segment[5] > len(data):
            raise _Malformed(f"program header {i}'s bytes run past its end ({len(data)} bytes)")
    return _Elf(data, header, phoff, shoff, tuple(sections), segments)


def _string(data: bytes, start: int, size: int, offset: int, what: str) -> bytes:
    """The NUL-terminated string at ``offset`` of the string table at ``start``, ``size`` long."""
    end = data.find(b"\0", start + offset, start + size)
    if offset >= size or end < 0:
        raise _Malformed(f"{what} is outside its string table")
    return data[start + offset : end]


def _symbols(elf: _Elf, section: _Section) -> Iterator[tuple[bytes, tuple[int, ...]]]:
    """Each symbol of a symbol table: its name and its other fields."""
    if section.entsize != _SYM_SIZE or section.size % _SYM_SIZE:
        raise _Malformed(
            f"symbol table {_show(section.name)} has entries of {section.entsize} bytes"
        )
    if not 0 < section.link < len(elf.sections):
        raise _Malformed(f"symbol table {_show(section.name)} names no string table")
    strtab = elf.sections[section.link]
    for i in range(section.size // _SYM_SIZE):
        st_name, *rest = _SYM.unpack_from(elf.data, section.offset + i * _SYM_SIZE)
        name = _string(elf.data, strtab.offset, strtab.size, st_name, f"symbol {i}'s name")
        yield name, tuple(rest)


def _compare_cubin(stored: bytes, fresh: bytes) -> Comparison:
    try:
        elf_a = _parse_elf(stored)
    except _Malformed as exc:
        return _different(f"stored is not a readable ELF64 cubin: {exc}")
    try:
        elf_b = _parse_elf(fresh)
    except _Malformed as exc:
        return _different(f"fresh is not a readable ELF64 cubin: {exc}")
    tags_a, tags_b, why = _pair_tags(stored, fresh)
    # Whole files split equal: fresh is stored renamed, byte for byte (ids of one length).
    if tags_a.ids and tags_a.split(stored) == tags_b.split(fresh):
        return Comparison(True, "normalised")
    try:
        detail = _structural_difference(elf_a, elf_b, tags_a, tags_b)
    except _Malformed as exc:
        return _different(f"a cubin is not readable: {exc}")
    lengths_differ = any(len(a) != len(b) for a, b in zip(tags_a.ids, tags_b.ids, strict=True))
    if detail is None:
        if lengths_differ:
            return Comparison(True, "normalised")
        # Same sections, other layout, and no tag of another length to explain it.
        detail = "the cubins differ only in their layout (offsets or padding), not in any section"
    return _different(f"{why}; {detail}" if why else detail)


def _structural_difference(a: _Elf, b: _Elf, tags_a: _Tags, tags_b: _Tags) -> str | None:
    """The first difference between two ELF files once renamed and laid out alike, or None."""
    names_a = [tags_a.split(s.name) for s in a.sections]
    names_b = [tags_b.split(s.name) for s in b.sections]
    if names_a != names_b:
        return _section_set_difference(a, b, names_a, names_b)
    for field, x, y in zip(_EHDR_FIELDS, a.header, b.header, strict=True):
        if field and x != y:
            return f"the ELF headers differ in {field} ({_hex(x)} stored, {_hex(y)} fresh)"
    for sa, sb in zip(a.sections, b.sections, strict=True):
        detail = _section_difference(a, b, sa, sb, tags_a, tags_b)
        if detail is not None:
            return detail
    for i, (pa, pb) in enumerate(zip(a.segments, b.segments, strict=True)):
        place = _place(a, pa[2])
        if pa[:2] + pa[3:] != pb[:2] + pb[3:] or place != _place(b, pb[2]):
            return f"program header {i} differs (type {pa[0]:#x}, offset or sizes)"
        # What the loader maps, compared as loaded: equal sections could still sit in a
        # segment with other bytes between them. A segment of just the program headers
        # holds file offsets, which differ with the layout; they were compared above.
        if place[0] != "program headers" or pa[5] > len(a.segments) * _PHDR.size:
            load_a = a.data[pa[2] : pa[2] + pa[5]]
            load_b = b.data[pb[2] : pb[2] + pb[5]]
            split_a, split_b = tags_a.split(load_a), tags_b.split(load_b)
            if _first_split_difference(split_a, split_b, tags_a, tags_b) is not None:
                return f"the bytes program header {i} (type {pa[0]:#x}) loads differ"
    gaps_a, gaps_b = _gaps(a), _gaps(b)
    if (gaps_a.strip(b"\0") or gaps_b.strip(b"\0")) and gaps_a != gaps_b:
        return "the bytes outside every section and header differ"
    return None


def _hex(value: int | bytes) -> str:
    return value.hex() if isinstance(value, bytes) else f"{value:#x}"


def _section_set_difference(a: _Elf, b: _Elf, names_a: list[_Split], names_b: list[_Split]) -> str:
    only_a = [s.name for s, n in zip(a.sections, names_a, strict=True) if n not in names_b]
    only_b = [s.name for s, n in zip(b.sections, names_b, strict=True) if n not in names_a]
    if only_a or only_b:
        shown_a = ", ".join(_show(n, 60) for n in only_a[:3]) or "none"
        shown_b = ", ".join(_show(n, 60) for n in only_b[:3]) or "none"
        return (
            f"the section sets differ ({len(a.sections)} sections stored, {len(b.sections)} "
            f"fresh): only stored has {shown_a}; only fresh has {shown_b}"
        )
    for sa, na, nb in zip(a.sections, names_a, names_b, strict=False):
        if na != nb:
            return (
                f"the sections are in another order, from section {sa.index} ({_show(sa.name)}) on"
            )
    return "the section names differ"  # equal lists of names were not passed here


def _section_difference(
    a: _Elf, b: _Elf, sa: _Section, sb: _Section, tags_a: _Tags, tags_b: _Tags
) -> str | None:
    what = f"section {sa.index} ({_show(sa.name)})"
    header_a = (sa.type, sa.flags, sa.addr, sa.link, sa.info, sa.addralign, sa.entsize)
    header_b = (sb.type, sb.flags, sb.addr, sb.link, sb.info, sb.addralign, sb.entsize)
    if header_a != header_b:
        return f"{what} has other header fields (type, flags, address, link, info, alignment)"
    if sa.type == _SHT_NOBITS:
        if sa.size != sb.size:
            return f"{what} differs in size ({sa.size} bytes stored, {sb.size} fresh)"
        return None
    if sa.type in (_SHT_SYMTAB, _SHT_DYNSYM):
        return _symbol_difference(a, b, sa, sb, tags_a, tags_b)
    # Contents, split at the ids: their size may differ only with the ids' lengths.
    data_a, data_b = sa.contents(a.data), sb.contents(b.data)
    where = _first_split_difference(tags_a.split(data_a), tags_b.split(data_b), tags_a, tags_b)
    if where is None:
        return None
    if len(data_a) != len(data_b) and not tags_a.ids:
        return f"{what} differs in size ({len(data_a)} bytes stored, {len(data_b)} fresh)"
    offset = where[0]
    instruction = f", instruction {offset // 16}" if sa.name.startswith(b".text.") else ""
    return (
        f"{what} differs first at byte {offset:#x}{instruction} "
        f"({len(data_a)} bytes stored, {len(data_b)} fresh)"
    )


def _symbol_difference(
    a: _Elf, b: _Elf, sa: _Section, sb: _Section, tags_a: _Tags, tags_b: _Tags
) -> str | None:
    symbols_a, symbols_b = list(_symbols(a, sa)), list(_symbols(b, sb))
    if len(symbols_a) != len(symbols_b):
        return (
            f"the symbol tables differ in size ({len(symbols_a)} symbols stored, "
            f"{len(symbols_b)} fresh)"
        )
    fields = ("st_info", "st_other", "st_shndx", "st_value", "st_size")
    for i, ((name_a, rest_a), (name_b, rest_b)) in enumerate(
        zip(symbols_a, symbols_b, strict=True)
    ):
        if tags_a.split(name_a) != tags_b.split(name_b):
            return f"symbol {i} is {_show(name_a)} stored but {_show(name_b)} fresh"
        for field, x, y in zip(fields, rest_a, rest_b, strict=True):
            if x != y:
                return (
                    f"symbol {i} ({_show(name_a)}) differs in {field} ({x:#x} stored, {y:#x} fresh)"
                )
    return None


def _place(elf: _Elf, offset: int) -> tuple[str, int, int]:
    """A file offset as a place that survives a shifted layout: (what, section, offset in it)."""
    if offset == elf.phoff and elf.segments:
        return ("program headers", 0, 0)
    for s in elf.sections:
        if s.type != _SHT_NOBITS and s.offset <= offset < s.offset + s.size:
            return ("section", s.index, offset - s.offset)
    for s in elf.sections:
        if s.offset == offset and s.index:
            return ("section", s.index, 0)
    if offset < _EHDR.size:
        return ("ELF header", 0, offset)
    return ("file", 0, offset)


def _gaps(elf: _Elf) -> bytes:
    """The bytes of the file outside the headers, the header tables and every section."""
    spans = [(0, _EHDR.size), (elf.phoff, elf.phoff + len(elf.segments) * _PHDR.size)]
    spans.append((elf.shoff, elf.shoff + len(elf.sections) * _SHDR.size))
    spans += [(s.offset, s.offset + s.size) for s in elf.sections if s.type != _SHT_NOBITS]
    gaps = []
    covered = 0
    for start, end in sorted(spans):
        if start > covered:
            gaps.append(elf.data[covered:start])
        covered = max(covered, end)
    gaps.append(elf.data[covered:])
    return b"".join(gaps)
