"""The artifact comparator (kcache.equivalence) on real NVRTC output, compiled in two processes.

The random part of NVRTC's internal-linkage names holds the compiling process's id
(and digits that follow the clock), so every "fresh" output here comes from a
subprocess and every "stored" one from this process: their tags surely differ.
No compile here fails: a failing compile would spoil this process's NVRTC trace.
"""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from kcache.equivalence import DETAIL_MAX_CHARS, Comparison, How, compare_outputs
from kcache.include_sets import IncludeSets
from kcache.nvrtc import compile_recipe
from kcache.recipe import Recipe
from kcache.toolchain import Toolchain
from tests.support import VECTOR_ADD

ROOT = Path(__file__).resolve().parents[2]

#: A template kernel has no non-template external definition to name the module by, so
#: NVRTC puts a random tag (and the process id) into every internal-linkage name: CUB's
#: and cuda::std's internal constants here.
CUB_TEMPLATE = """
#include <cub/block/block_reduce.cuh>
template <int N>
__global__ void block_sum(const float* in, float* out) {
  using Reduce = cub::BlockReduce<float, N>;
  __shared__ typename Reduce::TempStorage storage;
  float v = in[blockIdx.x * N + threadIdx.x];
  float s = Reduce(storage).Sum(v);
  if (threadIdx.x == 0) out[blockIdx.x] = s * 2.0f;
}
template __global__ void block_sum<128>(const float*, float*);
"""
#: The same kernel with one constant changed.
CUB_TEMPLATE_TIMES_3 = CUB_TEMPLATE.replace("s * 2.0f", "s * 3.0f")
#: An extern "C" kernel names the module: the tag is a hash of its name, not random.
CUB_EXTERN_C = """
#include <cub/block/block_reduce.cuh>
extern "C" __global__ void block_sum(const float* in, float* out) {
  using Reduce = cub::BlockReduce<float, 128>;
  __shared__ typename Reduce::TempStorage storage;
  float s = Reduce(storage).Sum(in[blockIdx.x * 128 + threadIdx.x]);
  if (threadIdx.x == 0) out[blockIdx.x] = s;
}
"""
#: A cheap program with a random tag: an anonymous namespace and a template kernel.
ANON = """
namespace {
__device__ int calls;
}
template <int N>
__global__ void scale(float* x) {
  x[threadIdx.x] *= N;
  atomicAdd(&calls, 1);
}
template __global__ void scale<2>(float*);
"""
VECTOR_SUB = VECTOR_ADD.replace("x[i] + y[i]", "x[i] - y[i]")
SCALE_2 = """
extern "C" __global__ void scale(const float* x, float* out, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = x[i] * 2.0f;
}
"""
SCALE_3 = SCALE_2.replace("2.0f", "3.0f")

#: Every recipe compiled in both processes: (source, output, flags).
RECIPES: dict[str, tuple[str, str, list[str]]] = {
    "vector_add": (VECTOR_ADD, "cubin", []),
    "anon": (ANON, "cubin", []),
    "anon_lineinfo": (ANON, "cubin", ["-lineinfo"]),  # the PTX, tags and all, in a section
    "anon_ptx": (ANON, "ptx", []),
    "anon_ltoir": (ANON, "ltoir", []),
    "cub": (CUB_TEMPLATE, "cubin", []),
    "cub_ptx": (CUB_TEMPLATE, "ptx", []),
    "cub_times_3": (CUB_TEMPLATE_TIMES_3, "cubin", []),
    "cub_extern_c": (CUB_EXTERN_C, "cubin", []),
}
#: Compared with another recipe's stored output only: not compiled here.
FRESH_ONLY = {"cub_times_3"}

# Compiles each recipe listed in the file argv[1] names into its file, and says its process id.
_COMPILE_ELSEWHERE = """
import json, os, sys
from kcache.include_sets import IncludeSets
from kcache.nvrtc import compile_recipe
from kcache.recipe import Recipe
from kcache.toolchain import load_toolchain

toolchain = load_toolchain()
for source, output, flags, path in json.loads(open(sys.argv[1]).read()):
    recipe = Recipe(source=source, target="sm_90", output=output, flags=flags)
    recipe = recipe.with_defaults(toolchain=toolchain.id)
    with open(path, "wb") as f:
        f.write(compile_recipe(recipe, toolchain, IncludeSets()).data)
print(os.getpid())
"""


def _compile(
    toolchain: Toolchain, source: str, output: str = "cubin", flags: Sequence[str] = ()
) -> bytes:
    recipe = Recipe(source=source, target="sm_90", output=output, flags=flags)  # type: ignore[arg-type]
    return compile_recipe(
        recipe.with_defaults(toolchain=toolchain.id), toolchain, IncludeSets()
    ).data


@pytest.fixture(scope="module")
def _compiled(
    toolchain: Toolchain, tmp_path_factory: pytest.TempPathFactory
) -> tuple[dict[str, bytes], dict[str, bytes], int]:
    """Every recipe compiled here and in another process (started first: both run at once)."""
    out = tmp_path_factory.mktemp("fresh")
    jobs = [(*recipe, str(out / name)) for name, recipe in RECIPES.items()]
    (out / "jobs.json").write_text(json.dumps(jobs))
    elsewhere = subprocess.Popen(
        [sys.executable, "-c", _COMPILE_ELSEWHERE, str(out / "jobs.json")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=os.environ.copy(),  # KCACHE_TOOLCHAIN_DIR: the headers this session extracted
    )
    try:
        here = {
            name: _compile(toolchain, *recipe)
            for name, recipe in RECIPES.items()
            if name not in FRESH_ONLY
        }
        stdout, stderr = elsewhere.communicate(timeout=300)
    finally:
        if elsewhere.poll() is None:
            elsewhere.kill()
            elsewhere.wait()
    assert elsewhere.returncode == 0, stderr
    there = {name: (out / name).read_bytes() for name in RECIPES}
    return here, there, int(stdout.split()[-1])


@pytest.fixture(scope="module")
def stored(_compiled: tuple[dict[str, bytes], dict[str, bytes], int]) -> dict[str, bytes]:
    """Every recipe compiled by this process's compile path."""
    return _compiled[0]


@pytest.fixture(scope="module")
def fresh(_compiled: tuple[dict[str, bytes], dict[str, bytes], int]) -> dict[str, bytes]:
    """Every recipe compiled in another process (same toolchain, same headers)."""
    return _compiled[1]


@pytest.fixture(scope="module")
def fresh_pid(_compiled: tuple[dict[str, bytes], dict[str, bytes], int]) -> int:
    """The id of the process that compiled ``fresh``."""
    return _compiled[2]


#: A random module id of the program "kernel.cu" after its mangled length: the length
#: of ``_INTERNAL`` and the id, two digits, says where the pid ends.
_TAGGED_RE = re.compile(rb"(\d\d)_INTERNAL(_00000000_9_kernel_cu_[0-9a-f]{8}_\d)")
#: The shape of a random id, wherever one is.
_RANDOM_TAIL_RE = re.compile(rb"_INTERNAL_00000000_9_kernel_cu_[0-9a-f]{8}_\d")


def _tag(data: bytes) -> bytes:
    """The one random module id in ``data``."""
    found = {data[m.start(2) : m.start(1) + 2 + int(m.group(1))] for m in _TAGGED_RE.finditer(data)}
    assert len(found) == 1, found
    return found.pop()


def _assert_same(result: Comparison, how: How) -> None:
    assert result == Comparison(True, how, "")


def _assert_different(result: Comparison, *words: str) -> None:
    assert not result.same and result.how == "different", result
    assert result.detail and len(result.detail) <= DETAIL_MAX_CHARS
    for word in words:
        assert word in result.detail, result.detail


# ----------------------------------------------------------------------------- 1: bytes
def test_a_plain_kernel_compiles_to_the_same_bytes_in_two_processes(
    stored: dict[str, bytes], fresh: dict[str, bytes]
) -> None:
    assert stored["vector_add"] == fresh["vector_add"]
    _assert_same(compare_outputs(stored["vector_add"], fresh["vector_add"], "cubin"), "bytes")


@pytest.mark.slow
def test_an_extern_c_cub_kernel_has_a_stable_tag_so_its_bytes_are_equal(
    stored: dict[str, bytes], fresh: dict[str, bytes]
) -> None:
    # The module is named by its first external definition (a hash of "block_sum"),
    # so the internal names hold no process id.
    data = stored["cub_extern_c"]
    assert b"_INTERNAL_00000000_9_kernel_cu_" in data and not _RANDOM_TAIL_RE.search(data)
    _assert_same(compare_outputs(stored["cub_extern_c"], fresh["cub_extern_c"], "cubin"), "bytes")


# ------------------------------------------------------------------------ 2: normalised
@pytest.mark.slow
def test_a_cub_template_kernel_differs_in_its_random_tag_only(
    stored: dict[str, bytes], fresh: dict[str, bytes], fresh_pid: int
) -> None:
    a, b = stored["cub"], fresh["cub"]
    assert a != b  # the normalisation is exercised, not skipped
    tag_a, tag_b = _tag(a), _tag(b)
    assert tag_a != tag_b and tag_b.endswith(b"_%d" % fresh_pid)  # the compiling process
    _assert_same(compare_outputs(a, b, "cubin"), "normalised")
    _assert_same(compare_outputs(b, a, "cubin"), "normalised")


def test_an_anonymous_namespace_differs_in_its_random_tag_only(
    stored: dict[str, bytes], fresh: dict[str, bytes]
) -> None:
    a, b = stored["anon"], fresh["anon"]
    assert a != b
    assert b"_GLOBAL__N_" + _tag(a) in a
    _assert_same(compare_outputs(a, b, "cubin"), "normalised")


def test_tags_inside_a_section_are_unified_too(
    stored: dict[str, bytes], fresh: dict[str, bytes]
) -> None:
    a, b = stored["anon_lineinfo"], fresh["anon_lineinfo"]
    assert b".nv_debug_ptx_txt" in a and a != b
    _assert_same(compare_outputs(a, b, "cubin"), "normalised")
    _assert_different(compare_outputs(stored["anon"], b, "cubin"), "section sets differ")


# ----------------------------------------------------------------------- 3: different
def test_one_changed_instruction_is_different(
    toolchain: Toolchain, stored: dict[str, bytes]
) -> None:
    _assert_different(
        compare_outputs(stored["vector_add"], _compile(toolchain, VECTOR_SUB), "cubin"),
        "section",
        ".text.add",
        "instruction",
    )


def test_one_changed_constant_is_different(toolchain: Toolchain) -> None:
    two, three = _compile(toolchain, SCALE_2), _compile(toolchain, SCALE_3)
    assert len(two) == len(three)
    _assert_different(compare_outputs(two, three, "cubin"), ".text.scale")


@pytest.mark.slow
def test_a_changed_constant_in_a_cub_kernel_is_different_after_normalisation(
    stored: dict[str, bytes], fresh: dict[str, bytes]
) -> None:
    a, b = stored["cub"], fresh["cub_times_3"]
    assert _tag(a) != _tag(b)  # the tags are unified, and still...
    _assert_different(compare_outputs(a, b, "cubin"), ".text._Z9block_sumILi128EEvPKfPf")


def test_a_different_program_is_different(stored: dict[str, bytes]) -> None:
    _assert_different(
        compare_outputs(stored["vector_add"], stored["anon"], "cubin"), "section sets differ"
    )


# ------------------------------------------------------------------ 4: malformed input
def test_truncated_and_foreign_input_is_different_never_an_error(stored: dict[str, bytes]) -> None:
    cubin = stored["anon"]
    for broken in (b"", b"\x7fELF", b"not an ELF file at all" * 10, cubin[:64], cubin[:-1]):
        for a, b in ((cubin, broken), (broken, cubin)):
            _assert_different(compare_outputs(a, b, "cubin"))
    _assert_different(compare_outputs(cubin, cubin[:100], "cubin"), "fresh", "past its end")
    _assert_different(compare_outputs(b"\x7fELF" + bytes(60), cubin, "cubin"), "stored")
    _assert_different(compare_outputs(cubin, cubin[:100], "ptx"), "line")
    _assert_different(compare_outputs(cubin, cubin[:100], "ltoir"), "sizes differ")


def test_corrupted_cubins_never_raise(stored: dict[str, bytes], fresh: dict[str, bytes]) -> None:
    cubin, other = stored["anon"], fresh["anon"]
    # Every header and table byte, one at a time: garbage offsets, counts and sizes.
    (shoff,) = struct.unpack_from("<Q", cubin, 0x28)
    places = [*range(64), *range(shoff, len(cubin))]
    for place in places:
        broken = bytearray(cubin)
        broken[place] ^= 0xFF
        _assert_different(compare_outputs(bytes(broken), other, "cubin"))


def test_hostile_names_cost_no_more_than_a_pass(stored: dict[str, bytes]) -> None:
    digits = b"7" * 200_000  # no backtracking over them, and no int() of them
    for junk in (digits, digits + b"_INTERNAL_00000000_9_kernel_cu_", b"_INTERNAL_" * 50_000):
        started = time.perf_counter()
        _assert_different(compare_outputs(stored["anon_ptx"], stored["anon_ptx"] + junk, "ptx"))
        _assert_different(compare_outputs(stored["anon"], stored["anon"] + junk, "cubin"))
        assert time.perf_counter() - started < 5


def test_unknown_kind_is_a_caller_error() -> None:
    with pytest.raises(ValueError, match="kind"):
        compare_outputs(b"a", b"b", "fatbin")


def test_the_detail_is_bounded() -> None:
    assert len(Comparison(False, "different", "x" * 10_000).detail) == DETAIL_MAX_CHARS


# ------------------------------------------------------------------------------- 5: PTX
@pytest.mark.slow
def test_cub_ptx_from_two_processes_is_the_same(
    stored: dict[str, bytes], fresh: dict[str, bytes]
) -> None:
    a, b = stored["cub_ptx"], fresh["cub_ptx"]
    assert a != b and _tag(a) != _tag(b)
    _assert_same(compare_outputs(a, b, "ptx"), "normalised")


def test_a_ptx_change_is_different_and_named_by_line(
    stored: dict[str, bytes], fresh: dict[str, bytes]
) -> None:
    a, b = stored["anon_ptx"], fresh["anon_ptx"]
    _assert_same(compare_outputs(a, b, "ptx"), "normalised")
    changed = b.replace(b"atom.global.add.u32", b"atom.global.inc.u32", 1)
    assert changed != b
    _assert_different(compare_outputs(a, changed, "ptx"), "PTX differs at line", "inc")


# ---------------------------------------------------------------------------- LTO-IR
def test_ltoir_is_compared_byte_for_byte(stored: dict[str, bytes], fresh: dict[str, bytes]) -> None:
    # The payload is scrambled: a one-tag difference changes nearly every byte, so
    # a program with a random tag cannot be verified as LTO-IR, and says why.
    a, b = stored["anon_ltoir"], fresh["anon_ltoir"]
    assert len(a) == len(b) and sum(x != y for x, y in zip(a, b, strict=True)) > len(a) // 2
    _assert_different(compare_outputs(a, b, "ltoir"), "LTO-IR", "opaque")
    _assert_same(compare_outputs(a, a, "ltoir"), "bytes")


# ---------------------------------------------------------- exactness of the renaming
def _retag_names(data: bytes, old: bytes, new: bytes) -> bytes:
    """``data`` with module id ``old`` replaced by ``new``, mangled lengths adjusted."""
    forms = {}
    for prefix in (b"_INTERNAL", b"_GLOBAL__N_"):
        forms[str(len(prefix + old)).encode() + prefix + old] = (
            str(len(prefix + new)).encode() + prefix + new
        )
    forms[old] = new
    pattern = re.compile(b"|".join(re.escape(f) for f in sorted(forms, key=len, reverse=True)))
    return pattern.sub(lambda m: forms[m.group(0)], data)


def _retag_cubin(cubin: bytes, old: bytes, new: bytes) -> bytes:
    """``cubin`` as a compile with module id ``new`` would lay it out: string tables
    rewritten, st_name and sh_name re-pointed, everything after them moved.

    An independent re-layout (not the comparator's code): it expects what NVRTC writes,
    the string tables first after the ELF header and no tag in any other section.
    """
    (phoff, shoff) = struct.unpack_from("<QQ", cubin, 0x20)
    phnum, _, shnum, shstrndx = struct.unpack_from("<HHHH", cubin, 0x38)
    shdrs = [list(struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + 64 * i)) for i in range(shnum)]
    strtabs = [i for i, h in enumerate(shdrs) if h[1] == 3]
    assert strtabs == sorted(strtabs, key=lambda i: shdrs[i][4])
    start = shdrs[strtabs[0]][4]
    end = shdrs[strtabs[-1]][4] + shdrs[strtabs[-1]][5]
    assert all(h[4] >= end for i, h in enumerate(shdrs) if h[1] not in (0, 3, 8))
    remap: dict[int, dict[int, int]] = {}
    pieces, cursor = [], start
    for i in strtabs:
        old_table = cubin[shdrs[i][4] : shdrs[i][4] + shdrs[i][5]]
        strings = old_table.split(b"\0")[:-1]
        offsets, at = {}, 0
        new_table = b""
        for s in strings:
            offsets[at] = len(new_table)
            at += len(s) + 1
            new_table += _retag_names(s, old, new) + b"\0"
        remap[i] = offsets
        shdrs[i][4], shdrs[i][5] = cursor, len(new_table)
        pieces.append(new_table)
        cursor += len(new_table)
    new_end = cursor
    # A multiple of every alignment keeps each later section aligned (a shorter table
    # may leave the layout as it was, with zeros after it).
    align = max(h[8] for h in shdrs)
    shift = -(-(new_end - end) // align) * align
    data = bytearray(cubin[:start] + b"".join(pieces))
    data += bytes(end + shift - len(data)) + cubin[end:]

    def moved(offset: int) -> int:
        return offset + shift if offset >= end else offset

    struct.pack_into("<QQ", data, 0x20, moved(phoff), moved(shoff))
    for i in range(phnum):
        at = moved(phoff) + 56 * i + 8
        struct.pack_into("<Q", data, at, moved(struct.unpack_from("<Q", data, at)[0]))
    for i, h in enumerate(shdrs):
        h[0] = remap[shstrndx][h[0]]
        if i not in strtabs:
            h[4] = moved(h[4])
        struct.pack_into("<IIQQQQIIQQ", data, moved(shoff) + 64 * i, *h)
        if h[1] == 2:  # SHT_SYMTAB: names into the table sh_link names
            for k in range(h[5] // 24):
                (st_name,) = struct.unpack_from("<I", data, h[4] + 24 * k)
                struct.pack_into("<I", data, h[4] + 24 * k, remap[h[6]][st_name])
    return bytes(data)


@pytest.mark.parametrize(
    "pid_change", [lambda p: p + "7", lambda p: p[:-1]], ids=["longer", "shorter"]
)
def test_a_tag_of_another_length_moves_the_layout_and_is_still_the_same(
    stored: dict[str, bytes], fresh: dict[str, bytes], pid_change: Callable[[str], str]
) -> None:
    # A pid of another number of digits changes every mangled length and the string
    # tables' sizes; a compile in such a process is simulated by re-laying the file out.

    def retagged(tag: bytes) -> bytes:
        head, _, pid = tag.rpartition(b"_")
        return head + b"_" + pid_change(pid.decode()).encode()

    a = stored["anon"]
    tag = _tag(a)
    moved = _retag_cubin(a, tag, retagged(tag))
    assert moved.count(retagged(tag)) == a.count(tag) > 0 and _tag(moved) == retagged(tag)
    _assert_same(compare_outputs(a, moved, "cubin"), "normalised")
    _assert_same(compare_outputs(moved, fresh["anon"], "cubin"), "normalised")
    # The PTX has a tag of its own (compiled at another time: other clock digits).
    ptx = stored["anon_ptx"]
    moved_ptx = _retag_names(ptx, _tag(ptx), retagged(_tag(ptx)))
    assert moved_ptx != ptx
    _assert_same(compare_outputs(ptx, moved_ptx, "ptx"), "normalised")


@pytest.mark.slow
def test_a_cub_cubin_relaid_out_for_a_longer_tag_is_the_same_and_a_change_still_shows(
    stored: dict[str, bytes],
) -> None:
    a = stored["cub"]
    tag = _tag(a)
    moved = _retag_cubin(a, tag, tag + b"1")
    _assert_same(compare_outputs(a, moved, "cubin"), "normalised")
    # One instruction byte changed in the re-laid-out file: the structural path sees it.
    broken = bytearray(moved)
    where = _section_offset(moved, b".text._Z9block_sumILi128EEvPKfPf") + 0x40
    broken[where] ^= 0x01
    _assert_different(compare_outputs(a, bytes(broken), "cubin"), ".text._Z9block_sum", "0x40")


def _section_offset(cubin: bytes, name: bytes) -> int:
    (shoff,) = struct.unpack_from("<Q", cubin, 0x28)
    shnum, shstrndx = struct.unpack_from("<HH", cubin, 0x3C)
    headers = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + 64 * i) for i in range(shnum)]
    names = headers[shstrndx][4]
    for h in headers:
        if cubin[names + h[0] :].split(b"\0", 1)[0] == name:
            return int(h[4])
    raise AssertionError(name)


def _one_occurrence_retagged(data: bytes, tag: bytes, new: bytes) -> bytes:
    """``data`` with the tag changed in its first mangled name only: no consistent renaming."""
    ident = b"_INTERNAL" + tag
    old_form = str(len(ident)).encode() + ident
    new_ident = b"_INTERNAL" + new
    assert old_form in data
    return data.replace(old_form, str(len(new_ident)).encode() + new_ident, 1)


@pytest.mark.parametrize("kind", ["cubin", "ptx"])
def test_only_a_consistent_renaming_of_the_random_part_is_unified(
    stored: dict[str, bytes], kind: str
) -> None:
    a = stored["anon" if kind == "cubin" else "anon_ptx"]
    tag = _tag(a)
    head, _, pid = tag.rpartition(b"_")
    other = head[:-8] + b"12345678_" + pid  # another random part, same length
    # Renamed in one name only: two names of one module no longer share its id.
    _assert_different(compare_outputs(a, _one_occurrence_retagged(a, tag, other), kind))
    # Renamed everywhere, but in the stable part (the program name): not a random tag.
    renamed = tag.replace(b"kernel_cu", b"kernel_cv")
    _assert_different(compare_outputs(a, _retag_names(a, tag, renamed), kind), "random part")
    # Renamed everywhere in the random part: the same code.
    _assert_same(compare_outputs(a, _retag_names(a, tag, other), kind), "normalised")


def test_a_byte_outside_the_names_is_never_explained_by_a_tag(
    stored: dict[str, bytes], fresh: dict[str, bytes]
) -> None:
    a, b = stored["anon"], bytearray(fresh["anon"])
    where = _section_offset(bytes(b), b".text._Z5scaleILi2EEvPf") + 0x10
    b[where] ^= 0x04
    _assert_different(compare_outputs(a, bytes(b), "cubin"), ".text._Z5scaleILi2EEvPf", "0x10")
