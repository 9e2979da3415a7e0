"""Compiling a recipe with NVRTC, and linking with nvJitLink.

This is the only module that compiles and links with NVRTC and nvJitLink
(:mod:`kcache.toolchain` only finds them, reads their versions and unpacks the headers).
Vendor errors are translated here into :class:`CompileError` carrying the compiler's log.

A compile reads exactly its inputs (see :mod:`kcache.deps`):

- NVRTC resolves includes as it does for anyone: a quoted include is looked up next
  to the including file (so ``<cooperative_groups.h>`` finds its siblings in the
  bundled headers, and a set file its own), among the in-memory headers, then along
  the ``-I`` directories. For the program itself "next to" means the compiling
  process's working directory, which is no input: a file read from there is a
  relative path in the trace that no input has (refused), or has the name of an
  in-memory header but prints no read marker (refused). Server workers and fresh
  compile processes (used for outputs that would record the directory,
  :func:`reads_working_directory`, and from inside an include set) run in a working
  directory that was removed, where nothing is found.
- Every compile passes ``-frandom-seed`` derived from the recipe's base key
  (:func:`compile_seed`), so a recipe compiles to the same bytes in every process.
- After a successful compile every file in the dependency trace must be an input,
  otherwise :class:`UnlistedIncludeError`, and the trace must be proven complete,
  otherwise :class:`DependencyTraceError`; nothing is stored either way.
- NVRTC writes no trace when the compile fails, so the log is read instead: a message
  located in a file that is not an input, or "cannot open source file", refuses the
  recipe with the same :class:`UnlistedIncludeError` whether the file exists or not
  (a missing file, an unreadable one and one read from the host look the same).
- The log a caller gets (and a negative entry keeps) holds NVRTC's messages about the
  recipe's own files and the bundled headers only, with the compiling host's
  directories replaced by ``<nvrtc>/`` and ``<set>:``; other messages are counted,
  not shown.
- ``__has_include`` answers by opening a file but leaves no trace event, so the
  recipe's own text may use it only with a literal, relative operand without ``..``;
  anything else (an absolute path, an escape, a computed operand) is refused before
  compiling. Token pasting can still build the operator where no text scan sees it:
  in an unconfined compile that leaves an existence oracle, which the Landlock
  confinement of server workers closes (a file outside the allowed roots cannot be
  opened, so it answers false like a missing one).

**A process's NVRTC is trusted until its first failed compile.** Once a traced
compile stops on a fatal error inside a header, NVRTC's traces in that process are
short from then on (``docs/design.md``). Which failures do it is NVRTC's business, so
any failed compile counts, and so does a trace that fails its checks:
:func:`compile_in_this_process` notes it (:func:`nvrtc_untrusted` says why), and
:func:`compile_recipe`, the entry point of every in-process compile, runs every later
compile of the process in a fresh process instead (:mod:`kcache.fresh_compile`); it
does the same for a compile whose trace failed its checks, or that ran while another
thread's compile failed. A server worker, which must not start processes, answers its
failure and is replaced (``kcache_server.compile_pool``).

**A failed traced compile leaves NVRTC tracing for everyone.** After a compile that
fails with ``--fdevice-time-trace``, every later compile of the process, whoever makes it
and whatever its options (the user's CuPy or cuda.core beside a client's local compile),
writes a trace named ``.json`` into the working directory (NVRTC 13.5, measured); one
traced compile that succeeds ends that. So every failed compile is followed by a traced
compile of an empty program into the failed one's temporary directory
(:func:`_end_tracing`): kcache leaves nothing behind in the processes it compiles in.
"""

from __future__ import annotations

import os
import re
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from kcache.artifact import CompileOutput
from kcache.deps import CompileInputs, ReadMarkers, dependencies_from_trace
from kcache.elf import validate_cubin
from kcache.errors import (
    CompileError,
    DependencyTraceError,
    RecipeError,
    ToolchainError,
    UnlistedIncludeError,
)
from kcache.include_probes import with_include_probes
from kcache.include_sets import IncludeSets
from kcache.recipe import Recipe
from kcache.toolchain import Toolchain

__all__ = [
    "answer_one_compile",
    "check_has_include",
    "check_kernels_emitted",
    "compile_in_this_process",
    "compile_recipe",
    "compile_seed",
    "enter_removed_directory",
    "kernel_name",
    "nvrtc_untrusted",
    "reads_working_directory",
    "recipe_log",
]

_GLOBAL_RE = re.compile(r"__global__\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?void\s+(\w+)")
# A kernel template: "template <...>" then, before the body, "__global__".
_TEMPLATE_KERNEL_RE = re.compile(r"\btemplate\s*<[^{;]*?__global__\s")
# Code in a compiler output: a cubin's ".text.<function>" section, PTX's .entry/.func.
_CUBIN_CODE = b".text."
_PTX_CODE_RE = re.compile(rb"^\s*(?:\.visible\s+|\.weak\s+)?\.(?:entry|func)\s", re.M)

# NVRTC's log: "<file>(<line>): <severity>...", indented continuation lines (the source
# line, the caret, "detected during ..."), and a few fixed lines.
_MESSAGE_RE = re.compile(
    r"^(?P<file>.+?)\((?P<line>\d+)\): (?P<text>(?:catastrophic error|error|warning|remark|note)\b.*)$"
)
_END_OF_SOURCE_RE = re.compile(r"^At end of source: ")
_FIXED_LINE_RE = re.compile(
    r"^(?:\d+ (?:catastrophic )?errors? detected in the compilation of \"(?P<program>.*)\"\."
    r"|Compilation terminated\."
    r"|Remark: The warnings can be suppressed with \"-diag-suppress <warning-number>\""
    r"|nvrtc: (?:error|warning): .*)$"
)
_CANNOT_OPEN_RE = re.compile(r"cannot open (?:source|include) file \"(?P<name>.*)\"")
_HAS_INCLUDE_RE = re.compile(r"\b__has_include\w*")
_LITERAL_OPERAND_RE = re.compile(r'\s*\(\s*(?:"(?P<quoted>[^"\n]*)"|<(?P<angled>[^>\n]*)>)\s*\)')
_DEFINED_BEFORE_RE = re.compile(r"(?:\bdefined\s*\(?|#\s*(?:ifdef|ifndef|elifdef|elifndef))\s*$")


class _ProcessNvrtc:
    """Whether this process's NVRTC may still trace a compile (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.untrusted: str | None = None
        #: Counts the events that spoil NVRTC: a compile started before one must not be trusted.
        self.generation = 0

    def spoil(self, why: str) -> None:
        with self._lock:
            self.generation += 1
            if self.untrusted is None:
                self.untrusted = why


_process_nvrtc = _ProcessNvrtc()


def nvrtc_untrusted() -> str | None:
    """Why this process's NVRTC no longer traces compiles reliably, or None while it does."""
    return _process_nvrtc.untrusted


def compile_seed(recipe: Recipe) -> int:
    """The ``-frandom-seed`` every compile of ``recipe`` passes: its base key's first 32 bits.

    NVRTC tags internal-linkage names (anonymous namespaces, and every internal symbol
    of a program with no external non-template definition to name it by, such as one
    of template kernels) with a random number and the compiling process's id, so two
    compiles of one recipe differ in bytes. With ``-frandom-seed=S`` the tag is S
    (``_GLOBAL__N__00000000_4_k_cu_<S as 8 hex>``, the process id gone) and the output is
    a function of the inputs. Measured with NVRTC 13.5 across separate processes, a
    template kernel beside an anonymous-namespace ``__device__`` variable and
    ``__global__``:

    - unseeded, cubin, ``-G`` cubin, LTO-IR and PTX differ in every process; seeded,
      all four are byte-identical. A program whose every symbol is external
      (``extern "C"`` kernels) compiles to the same bytes with any seed or none.
    - the form: a decimal number below 2**32 is used as it is (``12345`` tags
      ``00003039``) and is deterministic; ``0x1234567890abcdef`` and ``99999999999`` (past
      32 bits) were *not* (another tag in each process), and a string that is no number
      is hashed (a 64-hex-digit key was deterministic, but a key that happened to be all
      decimal digits would be read as an overflowing number). Hence a decimal of 32 bits.
    - lowered names: a template kernel's (``scale<2>`` -> ``_Z5scaleILi2EEvPf``) does not
      depend on the seed; an anonymous-namespace kernel's does, through the tag
      (``hidden`` -> ``_ZN36_GLOBAL__N__00000000_4_k_cu_000030396hiddenEPf`` with seed
      12345, and a new random one in every unseeded process). What
      ``nvrtcGetLoweredName`` reports is the name in the output of the same compile (the
      artifact stores both), now the same in every compile of the recipe.
    - linking: nvJitLink output is a function of its inputs (identical across
      processes). Each NVRTC program is seeded by its own recipe's base key (a linked
      recipe is resolved and compiled as a recipe of its own). Two LTO-IR inputs with
      the *same* seed and program name carry identical internal names; nvJitLink keeps
      them apart (``counter`` and ``counter$2``, two local symbols), as it already had to
      for two programs compiled unseeded in one process, which share a tag too.

    The base key (the key without header contents) and not the recipe key: a recipe
    served through a manifest match has the base key of the recipe compiled, so the
    bytes a manifest entry names are what a compile of the matching recipe makes.
    Users cannot pass the option (:data:`kcache.recipe.ALLOWED_FLAGS`): the seed is
    kcache's own. The key schema records it (``kcache.keys.KEY_SCHEMA`` 2). A recipe
    compiled with include sets named but not yet pinned to their contents (no key yet)
    gets the same seed as once pinned: the base key has the sets by name alone.
    """
    return int(recipe.base_key()[:8], 16)


#: Options whose output records the compiling process's working directory (DWARF's
#: ``DW_AT_comp_dir``, for line information).
_DEBUG_INFO_FLAGS = frozenset({"-G", "--device-debug", "-lineinfo", "--generate-line-info"})


def reads_working_directory(recipe: Recipe) -> bool:
    """Whether the bytes of ``recipe``'s own NVRTC program depend on the working directory.

    Measured with NVRTC 13.5 (the same seeded recipe, run from three directories):
    LTO-IR differs with the directory (always: its size too), and so do cubins with
    ``-G`` or ``-lineinfo`` (they hold the path); a plain cubin and PTX do not. From a
    working directory that no longer exists NVRTC records none, and the bytes are the
    same whichever removed directory it was: so server workers work in one
    (:func:`enter_removed_directory`), and :func:`compile_recipe` sends such a recipe to
    a fresh process, which enters one, unless this process works in one already.
    """
    return (
        recipe.lto
        or recipe.output == "ltoir"
        or any(flag in _DEBUG_INFO_FLAGS for flag in recipe.flags)
    )


def enter_removed_directory() -> None:
    """Make this process's working directory an empty one that no longer exists.

    For processes that only compile (they use absolute paths): NVRTC then records no
    working directory in any output (:func:`reads_working_directory`), and a quoted
    include looked up "next to" the program finds nothing, since nothing can be
    created in a removed directory.
    """
    import sys

    if _in_removed_directory():
        return
    sys.path[:] = [os.path.abspath(entry) for entry in sys.path]  # "" meant the old directory
    place = os.path.abspath(tempfile.mkdtemp(prefix="kcache-cwd-"))
    os.chdir(place)
    os.rmdir(place)


def _works_in_an_include_set(recipe: Recipe, include_sets: IncludeSets) -> bool:
    """Whether this process's working directory is a directory of one of ``recipe``'s sets.

    NVRTC looks a quoted include of the program up in the working directory before the
    ``-I`` directories: from inside a set it reads the working directory's copy, which
    is no input (refused), where a server reads the set's. ``kcache compile k.cu
    --include-set local=.`` beside ``tile.h`` asked for exactly that set, and was
    refused with the advice to pass that set; a fresh process in a removed directory
    reads what a server reads.
    """
    if not recipe.include_sets:
        return False
    try:
        here = os.path.realpath(os.getcwd())
    except FileNotFoundError:
        return False
    for entry in recipe.include_sets:
        try:
            root = os.path.realpath(include_sets.get(entry).root)
        except RecipeError:
            continue  # the compile itself says what is wrong with it
        if here == root or here.startswith(root + os.sep):
            return True
    return False


def _in_removed_directory() -> bool:
    try:
        os.getcwd()
    except FileNotFoundError:
        return True
    return False


def kernel_name(recipe: Recipe) -> str:
    """A human name for audit tables: the first name expression, else the first __global__."""
    if recipe.name_expressions:
        return recipe.name_expressions[0]
    match = _GLOBAL_RE.search(recipe.source)
    return match.group(1) if match else recipe.name


def check_kernels_emitted(recipe: Recipe, data: bytes) -> None:
    """Refuse a cubin or PTX with no code at all from a source that declares a kernel template.

    NVRTC instantiates a ``template <...> __global__`` kernel only for a name expression
    (or an explicit instantiation in the source); without one it compiles successfully
    into an output with no kernel in it, and the mistake shows much later, as a failed
    function lookup on the GPU, for every rank that was served the empty artifact. So
    it is an error here, not a warning: a warning would have to travel from a server's
    compile worker to every client, and an artifact nobody can launch is worth storing
    for no one. The fix is cheap and changes the recipe's key. Outputs that may rightly
    hold no kernel are left alone: LTO-IR, and relocatable code (``-rdc=true``, device
    functions for a later link).
    """
    if recipe.name_expressions or recipe.produces == "ltoir" or recipe.lto:
        return
    if any(f in ("-rdc=true", "--relocatable-device-code=true", "-dc") for f in recipe.flags):
        return
    has_code = (
        _CUBIN_CODE in data if recipe.produces == "cubin" else _PTX_CODE_RE.search(data) is not None
    )
    if has_code:
        return
    match = _TEMPLATE_KERNEL_RE.search(recipe.source)
    if match is None:
        return
    name = _GLOBAL_RE.search(recipe.source, match.start())
    example = f"{name.group(1)}<float>" if name else "kernel<float>"
    raise RecipeError(
        "name_expressions",
        "the compile produced no kernel: the source's __global__ templates are compiled only "
        f"for the instantiations a name expression names; add one for each you launch, e.g. "
        f"name_expressions=[{example!r}] (kcache compile --name-expression {example!r}), or "
        "instantiate the template explicitly in the source",
    )


def _ok(result: tuple[object, ...]) -> bool:
    from cuda.bindings import nvrtc

    return bool(result[0] == nvrtc.nvrtcResult.NVRTC_SUCCESS)


def _end_tracing(trace_dir: Path) -> None:
    """After a failed traced compile: a traced compile that succeeds (an empty program, its
    trace into ``trace_dir``), so NVRTC stops writing ``.json`` for the process's other
    compiles (module docstring). Nothing is raised: it is the process's, not the recipe's."""
    from cuda.bindings import nvrtc

    err, prog = nvrtc.nvrtcCreateProgram(b"", b"kcache-end-tracing.cu", 0, [], [])
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        return
    try:
        option = f"--fdevice-time-trace={trace_dir / 'end-tracing'}".encode()
        nvrtc.nvrtcCompileProgram(prog, 1, [option])
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _get_bytes(prog: object, size_fn: object, get_fn: object) -> bytes:
    result = size_fn(prog)  # type: ignore[operator]
    if not _ok(result):
        raise ToolchainError(f"{size_fn} failed: {result[0]!r}")
    buf = bytearray(result[1])
    result = get_fn(prog, buf)  # type: ignore[operator]
    if not _ok(result):
        raise ToolchainError(f"{get_fn} failed: {result[0]!r}")
    return bytes(buf)


def _program_log(prog: object) -> str:
    from cuda.bindings import nvrtc

    return (
        _get_bytes(prog, nvrtc.nvrtcGetProgramLogSize, nvrtc.nvrtcGetProgramLog)
        .rstrip(b"\x00")
        .decode("utf-8", "replace")
    )


def _escapes(path: str) -> bool:
    return path.startswith("/") or "\\" in path or ".." in path.split("/")


def check_has_include(recipe: Recipe) -> None:
    """Refuse ``__has_include`` uses in the recipe's text that could test files outside its inputs.

    Allowed: a literal, relative operand without ``..`` (it is looked up among the
    in-memory headers and the ``-I`` directories, all inputs), and ``defined``/``#ifdef``
    tests of the operator itself. Refused: an absolute or escaping operand
    (:class:`UnlistedIncludeError`), and a computed one or an alias of the operator
    (:class:`RecipeError`), since no text scan can tell where those point.
    """
    texts = [("source", recipe.source)]
    texts += [(f'headers["{name}"]', text) for name, text in recipe.headers.items()]
    for field, text in texts:
        for match in _HAS_INCLUDE_RE.finditer(text):
            operand = _LITERAL_OPERAND_RE.match(text, match.end())
            if operand is not None:
                path = operand.group("quoted")
                path = operand.group("angled") if path is None else path
                if _escapes(path):
                    raise UnlistedIncludeError(path, field)
                continue
            if _DEFINED_BEFORE_RE.search(text, max(0, match.start() - 64), match.start()):
                continue
            raise RecipeError(
                field,
                f"{match.group(0)} needs a string or <...> literal naming a header by a relative "
                "path; a computed operand or an alias of the operator could test for files "
                "outside the recipe's inputs",
            )


def recipe_log(log: str, inputs: CompileInputs) -> tuple[str, list[str]]:
    """NVRTC's ``log`` reduced to messages about the recipe's inputs, and the includes it names
    that are not inputs (as written, in order).

    A message located in a file that is no input is dropped (with its continuation
    lines) and its file counted as an unlisted include; so is the target of "cannot
    open source file". Lines of no known form are dropped too. Kept lines show the
    bundled headers as ``<nvrtc>/...`` and set files as ``<set>:...``, never a
    directory of the compiling host. A last line says how many messages were dropped.
    """
    replacements = sorted(inputs.display_prefixes().items(), key=lambda kv: -len(kv[0]))
    kept: list[str] = []
    unlisted: list[str] = []
    dropped = 0
    keeping = False
    # split("\n") and not splitlines(): a form feed or other separator in a quoted
    # source line must not start a line of its own that escapes its message.
    for line in log.split("\n"):
        if not line.strip():
            continue
        if line[0] in " \t":
            if keeping:
                kept.append(_rewrite(line, replacements))
            continue
        match = _MESSAGE_RE.match(line)
        if match is not None:
            origin = inputs.origin(match.group("file"))
            keeping = origin is not None
            if origin is None:
                unlisted.append(inputs.as_written(match.group("file")))
                dropped += 1
                continue
            opened = _CANNOT_OPEN_RE.search(match.group("text"))
            if opened is not None:
                unlisted.append(opened.group("name"))
            kept.append(
                f"{origin.display}({match.group('line')}): {_rewrite(match.group('text'), replacements)}"
            )
            continue
        fixed = _FIXED_LINE_RE.match(line)
        keeping = _END_OF_SOURCE_RE.match(line) is not None
        if keeping or (fixed is not None and fixed.group("program") in (None, inputs.program)):
            kept.append(_rewrite(line, replacements))
        else:
            dropped += 1
    if dropped:
        kept.append(
            f"({dropped} compiler message{'s' if dropped != 1 else ''} about files outside the "
            "recipe's inputs left out)"
        )
    return "\n".join(kept), unlisted


def _rewrite(line: str, replacements: list[tuple[str, str]]) -> str:
    for prefix, shown in replacements:
        line = line.replace(prefix, shown)
    return line


def _link(recipe: Recipe, own_ltoir: bytes, link_inputs: Sequence[bytes]) -> tuple[bytes, str]:
    from cuda.bindings import nvjitlink

    options = [f"-arch={recipe.parsed_target.text}", "-lto"]
    handle = nvjitlink.create(len(options), options)
    try:
        try:
            for i, data in enumerate([own_ltoir, *link_inputs]):
                kind = (
                    nvjitlink.InputType.LTOIR
                    if not data.startswith(b"\x7fELF")
                    else nvjitlink.InputType.CUBIN
                )
                nvjitlink.add_data(handle, kind, data, len(data), f"input{i}")
            nvjitlink.complete(handle)
        except nvjitlink.nvJitLinkError as exc:
            size = nvjitlink.get_error_log_size(handle)
            log = bytearray(size)
            nvjitlink.get_error_log(handle, log)
            raise CompileError(
                None, f"nvJitLink: {exc}\n{log.rstrip(bytes(1)).decode('utf-8', 'replace')}"
            ) from exc
        size = nvjitlink.get_linked_cubin_size(handle)
        cubin = bytearray(size)
        nvjitlink.get_linked_cubin(handle, cubin)
        info_size = nvjitlink.get_info_log_size(handle)
        info = bytearray(info_size)
        nvjitlink.get_info_log(handle, info)
        return bytes(cubin), info.rstrip(b"\x00").decode("utf-8", "replace")
    finally:
        nvjitlink.destroy(handle)


def compile_recipe(
    recipe: Recipe,
    toolchain: Toolchain,
    include_sets: IncludeSets,
    link_inputs: Sequence[bytes] = (),
) -> CompileOutput:
    """Compile ``recipe`` with NVRTC (and link it with nvJitLink when ``lto`` is set).

    ``link_inputs`` are the bytes of the recipe's ``link`` entries, in order (LTO-IR
    or cubins), fetched by the caller. Raises :class:`CompileError` with the log.
    Runs in this process while its NVRTC is trusted, else in a fresh one; so does a
    recipe whose bytes would record this process's working directory
    (:func:`reads_working_directory`), and one that names an include set this process
    works in (:func:`_works_in_an_include_set`), unless that is a removed one.
    """
    here = _in_removed_directory() or not (
        reads_working_directory(recipe) or _works_in_an_include_set(recipe, include_sets)
    )
    if here and _process_nvrtc.untrusted is None:
        generation = _process_nvrtc.generation
        try:
            output = compile_in_this_process(recipe, toolchain, include_sets, link_inputs)
        except DependencyTraceError:
            pass  # this process's NVRTC is spoiled: a fresh one decides
        else:
            if _process_nvrtc.generation == generation:
                return output
            # Another thread's compile failed meanwhile: this trace may be short too.
    from kcache.fresh_compile import compile_in_fresh_process

    return compile_in_fresh_process(recipe, toolchain, include_sets, link_inputs)


def compile_in_this_process(
    recipe: Recipe,
    toolchain: Toolchain,
    include_sets: IncludeSets,
    link_inputs: Sequence[bytes] = (),
) -> CompileOutput:
    """:func:`compile_recipe` in this process, whatever NVRTC saw before.

    A failed compile, and a trace that fails its checks, mark this process's NVRTC
    untrusted (:func:`nvrtc_untrusted`); the caller must not compile here again.
    """
    from cuda.bindings import nvrtc

    toolchain.check(recipe)
    target = recipe.parsed_target
    set_dirs = [
        include_sets.get(name, f"include_sets[{i}]") for i, name in enumerate(recipe.include_sets)
    ]
    check_has_include(recipe)
    inputs = CompileInputs(
        recipe.name, recipe.headers, recipe.include_sets, include_sets, toolchain.include_dir
    )
    names = list(recipe.headers)
    markers = ReadMarkers(names)
    wants_ltoir = recipe.lto or recipe.output == "ltoir"
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kcache-trace-") as trace_dir:
        trace_base = Path(trace_dir) / "trace"
        options = [
            f"-arch={target.text}",
            *(["-dlto"] if wants_ltoir else []),
            *toolchain.include_flags,
            *(f"-I{item.root}" for item in set_dirs),
            *recipe.macro_flags(),
            *recipe.flags,
            f"-frandom-seed={compile_seed(recipe)}",
            # NVRTC appends ".json". Never a PCH option: automatic PCH ignores header edits.
            f"--fdevice-time-trace={trace_base}",
        ]
        err, prog = nvrtc.nvrtcCreateProgram(
            recipe.source.encode(),
            recipe.name.encode(),
            len(names),
            [markers.marked(n, i, recipe.headers[n]).encode() for i, n in enumerate(names)],
            [n.encode() for n in names],
        )
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise ToolchainError(f"nvrtcCreateProgram failed: {err!r}")
        result: tuple[object, ...] | None = None
        try:
            for expr in recipe.name_expressions:
                if not _ok(nvrtc.nvrtcAddNameExpression(prog, expr.encode())):
                    raise RecipeError(
                        "name_expressions", f"NVRTC refused the name expression {expr!r}"
                    )
            result = nvrtc.nvrtcCompileProgram(prog, len(options), [o.encode() for o in options])
            if not _ok(result):
                _process_nvrtc.spoil(f"a compile in this process failed ({result[0]!r})")
            raw_log, marked_reads = markers.split_log(_program_log(prog))
            log, unlisted = recipe_log(raw_log, inputs)
            if unlisted:
                raise UnlistedIncludeError(unlisted[0])
            if not _ok(result):
                raise CompileError(None, log or f"NVRTC failed with {result[0]!r} and no log")
            # Before anything is read out: a compile that read a file outside its inputs,
            # or whose reads are not proven, must not produce an artifact.
            try:
                deps = dependencies_from_trace(
                    trace_base.with_suffix(".json"), inputs, marked_reads
                )
            except DependencyTraceError as exc:
                _process_nvrtc.spoil(str(exc))
                raise
            deps = with_include_probes(deps, recipe, include_sets, toolchain.include_dir)
            lowered: dict[str, str] = {}
            for expr in recipe.name_expressions:
                res = nvrtc.nvrtcGetLoweredName(prog, expr.encode())
                if not _ok(res):
                    raise CompileError(None, f"{log}\nno lowered name for {expr!r}: {res[0]!r}")
                lowered[expr] = res[1].decode()
            if wants_ltoir:
                data = _get_bytes(prog, nvrtc.nvrtcGetLTOIRSize, nvrtc.nvrtcGetLTOIR)
            elif recipe.output == "ptx":
                data = _get_bytes(prog, nvrtc.nvrtcGetPTXSize, nvrtc.nvrtcGetPTX).rstrip(b"\x00")
            else:
                data = _get_bytes(prog, nvrtc.nvrtcGetCUBINSize, nvrtc.nvrtcGetCUBIN)
        finally:
            nvrtc.nvrtcDestroyProgram(prog)
            if result is not None and not _ok(result):
                _end_tracing(Path(trace_dir))
    if recipe.lto:
        data, link_log = _link(recipe, data, link_inputs)
        log = "\n".join(part for part in (log, link_log) if part.strip())
    kind = recipe.produces
    if kind == "cubin":
        validate_cubin(data, target)
    check_kernels_emitted(recipe, data)
    return CompileOutput(
        data=data,
        kind=kind,
        target=target.text,
        toolchain=toolchain.id,
        log=log,
        lowered_names=lowered,
        dependencies=deps,
        dependencies_exact=True,  # every file the compile read is attributed, or it was refused
        compile_seconds=time.perf_counter() - started,
    )


def answer_one_compile() -> None:
    """A fresh compile process's whole life (:mod:`kcache.fresh_compile` starts it).

    Reads the request from stdin, compiles once in this new process and leaves the
    :mod:`kcache.compile_replies` tuple where the request says.
    """
    import pickle
    import sys

    from kcache.compile_replies import reply_of
    from kcache.fresh_compile import REPLY_FIELD
    from kcache.toolchain import load_toolchain

    request = pickle.loads(sys.stdin.buffer.read())
    recipe = Recipe.from_dict(request["recipe"])
    # Every path in the request is absolute. A removed directory reads as a server's
    # worker does: nothing found "next to" the program, no directory in the bytes.
    enter_removed_directory()
    toolchain = load_toolchain(Path(request["toolchain_dir"]))

    def compile() -> CompileOutput:
        if toolchain.id != request["toolchain_id"]:
            raise ToolchainError(
                f"the fresh compile process loaded toolchain {toolchain.id}, "
                f"not {request['toolchain_id']}"
            )
        return compile_in_this_process(
            recipe,
            toolchain,
            IncludeSets(request["include_sets"]),
            request["link_inputs"],
        )

    reply = reply_of(compile)
    answer = Path(request[REPLY_FIELD])
    partial = answer.with_suffix(".partial")
    partial.write_bytes(pickle.dumps(reply))
    partial.rename(answer)
