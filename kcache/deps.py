"""Dependencies: which files a compile read, each attributed to one of the recipe's inputs.

A compile may read exactly its inputs: the source, the in-memory ``headers``, the
toolchain's bundled headers and the files of the include sets the recipe names.
:class:`CompileInputs` decides, for a path NVRTC reports, which input it is, or that it
is none of them. NVRTC's own pseudo-files (the builtin header it injects, the
``__nv_name_map`` it compiles name expressions in) belong to the toolchain.

NVRTC has no ``-M``. Its ``--fdevice-time-trace`` JSON has one "Processing Header File"
event per header it opened, nested ones included: in-memory headers under their include
names, files under the path NVRTC opened (an ``-I`` directory or the including file's
directory joined with the include as written, or an absolute path as written). Every
entry must be attributed: :func:`dependencies_from_trace` refuses the recipe
(:class:`~kcache.errors.UnlistedIncludeError`) on the first file that is not an input.

That trace is a side output, and it can be silently short: once a traced compile in a
process stopped on a fatal error inside a header, every later trace of that process
lacks the builtin header and every header the source includes directly but the last
(``docs/design.md`` has the whole finding and ``bench/nvrtc_trace_probe.py`` shows it).
So a trace is recorded only when it is *proven* complete, by two checks that do not
rest on the trace machinery:

- **Shape.** Every complete trace starts with the builtin header, which NVRTC opens
  before the program; a trace without it is refused.
- **Read markers** (:class:`ReadMarkers`). Each in-memory header is compiled with a
  ``#pragma message`` appended that names it by index under a nonce fresh for each
  compile. NVRTC's diagnostics print one line each time the preprocessor reaches the
  end of a header, independently of the trace. The in-memory entries of the trace must
  equal the markers printed, one for one (as counts: the trace's order of nested events
  is not the preprocessor's). This catches a short trace, a trace entry that was really a file of the
  same name read from disk (it carries no marker), and a marker the recipe's own text
  tried to forge (the nonce is unknown to it). The pragma is wrapped in
  ``nv_diagnostic push``/``pop`` with ``nv_diag_remark 20200``, so neither ``-w`` nor a
  recipe's ``diag_suppress`` hides it; it changes no byte of the output (tested with
  ``-G`` and ``-lineinfo``) and costs no second compile.

A check that fails raises :class:`~kcache.errors.DependencyTraceError`; the compile is
not recorded and :mod:`kcache.nvrtc` stops trusting that process's NVRTC.

A dependency is ``(name, sha256)``: ``name`` is the include name of an in-memory
header, or ``<set>:<relative path>`` for a file of a registered include set (a colon
never occurs in an include name). Bundled headers are covered by the toolchain id.
:data:`DEPENDENCY_CHECK` versions the proof: what releases before it recorded is never
used for a manifest match (see :func:`proven`).
"""

from __future__ import annotations

import json
import os
import re
import secrets
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from kcache.errors import DependencyTraceError, RecipeError, UnlistedIncludeError
from kcache.include_sets import IncludeSets
from kcache.keys import sha256_hex

__all__ = [
    "ABSENT",
    "BUILTIN_HEADER",
    "DEPENDENCY_CHECK",
    "NVRTC_PSEUDO_FILES",
    "PROBE",
    "WHOLE_SET",
    "CompileInputs",
    "Dependency",
    "Origin",
    "ReadMarkers",
    "current_hash",
    "dependencies_from_trace",
    "files_read",
    "include_set_files_unchanged",
    "proven",
    "set_place",
    "unchanged",
]

#: The hash an include probe (:mod:`kcache.include_probes`) records where no file was
#: (no file's sha256 is 64 zeros).
ABSENT = "0" * 64
#: The path of a probe standing for a set's whole contents (a computed include).
WHOLE_SET = "*"
#: What separates a probe's set from its path (a file read has ":"; neither occurs in a name).
PROBE = "?"
#: The header NVRTC injects itself; it is part of the toolchain.
BUILTIN_HEADER = "__nv_nvrtc_builtin_header.h"
#: Files NVRTC makes up itself: the builtin header, and the translation unit in which it
#: compiles name expressions (an error in a name expression is reported there).
NVRTC_PSEUDO_FILES = frozenset({BUILTIN_HEADER, "__nv_name_map"})
#: How dependency lists are proven: 0 (or absent) for what releases before the read
#: markers recorded, trusting NVRTC's trace alone; 1 for a trace checked by its shape
#: and by read markers, from an NVRTC that had seen no failed compile; 2 with the
#: include probes beside it (:mod:`kcache.include_probes`: where a lookup failed).
DEPENDENCY_CHECK = 2


@dataclass(frozen=True, order=True)
class Dependency:
    """One header a compile read, with the sha256 of the bytes it read."""

    name: str
    sha256: str

    def to_dict(self) -> dict[str, str]:
        """JSON form."""
        return {"name": self.name, "sha256": self.sha256}


@dataclass(frozen=True)
class Origin:
    """Which input a path NVRTC reported belongs to.

    ``kind`` is ``source`` (the program itself), ``header`` (an in-memory header),
    ``set`` (a file of a named include set; ``set_name`` and ``relative`` say which),
    ``toolchain`` (a bundled header or NVRTC's builtin one). ``display`` is how a
    compile log shows it: no directory of the compiling host appears there.
    """

    kind: str
    display: str
    set_name: str = ""
    relative: str = ""


def _strictly_inside(path: str, root: str) -> str | None:
    """``path`` relative to ``root`` when it lies strictly below it, else None."""
    if path.startswith(root + "/") and len(path) > len(root) + 1:
        return path[len(root) + 1 :]
    return None


class CompileInputs:
    """The inputs of one compile, and the attribution of paths NVRTC reports to them."""

    def __init__(
        self,
        program: str,
        headers: Mapping[str, str],
        set_names: Iterable[str],
        include_sets: IncludeSets,
        toolchain_include: Path,
    ) -> None:
        self.program = program
        self.headers = headers
        self.include_sets = include_sets
        self.sets = [include_sets.get(name) for name in dict.fromkeys(set_names)]
        self._real_dirs: dict[str, str] = {}
        # NVRTC reports files under the -I directory as given; symlinks are resolved separately.
        self._toolchain_given = os.path.normpath(toolchain_include)
        self._toolchain_real = os.path.realpath(toolchain_include)
        # -I directories, longest first, to show an include as it was written.
        self._search_dirs = sorted(
            {self._toolchain_given, os.path.join(self._toolchain_given, "cccl")}
            | {str(item.root) for item in self.sets},
            key=len,
            reverse=True,
        )

    def display_prefixes(self) -> dict[str, str]:
        """Directory prefixes of the compiling host -> how a compile log shows them."""
        shown = {self._toolchain_given + "/": "<nvrtc>/", self._toolchain_real + "/": "<nvrtc>/"}
        shown.update({f"{item.root}/": f"{item.name}:" for item in self.sets})
        return shown

    def as_written(self, path: str) -> str:
        """``path`` with the ``-I`` directory NVRTC joined it to removed: the include as written."""
        for directory in self._search_dirs:
            rest = _strictly_inside(path, directory)
            if rest is not None:
                return rest
        return path

    def origin(self, path: str) -> Origin | None:
        """The input ``path`` (as NVRTC reports it) belongs to, or None when it is none of them.

        A file of an include set must lie strictly inside the set's root both as
        written and after resolving symlinks, so neither ``..`` nor a link that
        points out of the root (nor an absolute path to a link that points into it)
        is attributed to the set.
        """
        if path in NVRTC_PSEUDO_FILES:
            return Origin("toolchain", path)
        if path in self.headers:
            return Origin("header", path)
        if path == self.program:
            return Origin("source", path)
        if not path.startswith("/"):
            return None  # a relative path that no input has: read from the working directory
        lexical = os.path.normpath(path)
        resolved = self._realpath(path)
        inside = _strictly_inside(lexical, self._toolchain_given)
        if inside is None:
            inside = _strictly_inside(lexical, self._toolchain_real)
        if inside is not None and _strictly_inside(resolved, self._toolchain_real) is not None:
            return Origin("toolchain", f"<nvrtc>/{inside}")
        for item in self.sets:
            root = str(item.root)
            if _strictly_inside(lexical, root) is None:
                continue
            relative = _strictly_inside(resolved, root)
            if relative is not None:
                return Origin("set", f"{item.name}:{relative}", item.name, relative)
        return None

    def _realpath(self, path: str) -> str:
        """``os.path.realpath(path)``, with each directory resolved once per compile.

        A cub kernel reads hundreds of headers from a few dozen directories; resolving
        every path from the root would cost tens of milliseconds. The directory part is
        resolved as given (not normalised first: ``link/..`` must follow the link, as
        the kernel does), then only a final component that is a link is followed.
        """
        directory, name = os.path.split(path)
        real_directory = self._real_dirs.get(directory)
        if real_directory is None:
            real_directory = self._real_dirs[directory] = os.path.realpath(directory)
        candidate = os.path.join(real_directory, name)
        return os.path.realpath(candidate) if os.path.islink(candidate) else candidate

    def dependency(self, origin: Origin) -> Dependency | None:
        """The dependency ``origin`` records (None for the program and toolchain files)."""
        if origin.kind == "header":
            return Dependency(origin.display, sha256_hex(self.headers[origin.display]))
        if origin.kind == "set":
            digest = self.include_sets.file_hash(origin.set_name, origin.relative)
            if digest is None:
                raise RecipeError(
                    "include_sets",
                    f"{origin.display} changed or vanished while the recipe was compiling; "
                    "resolve it again",
                )
            return Dependency(origin.display, digest)
        return None


class ReadMarkers:
    """The read markers of one compile: header texts to compile, and the log lines they print.

    ``names`` are the in-memory headers' include names, in a fixed order; marker ``i``
    names ``names[i]``. The nonce is fresh for each compile, so no recipe text can
    print a marker of its own.
    """

    #: NVRTC's diagnostic number for ``#pragma message``.
    _MESSAGE_DIAGNOSTIC = 20200

    def __init__(self, names: Sequence[str]) -> None:
        self.names = list(names)
        self.nonce = secrets.token_hex(8)
        self._line = re.compile(
            r'\S.*#pragma message: "kcache-read-' + self.nonce + r'-(?P<index>\d+)"'
        )

    def marked(self, name: str, index: int, text: str) -> str:
        """``text`` of header ``name`` (number ``index``) with its marker appended.

        Two newlines first: a last line ending in a backslash continues into an empty
        line, never into the marker.
        """
        number = self._MESSAGE_DIAGNOSTIC
        return (
            f"{text}\n\n#pragma nv_diagnostic push\n#pragma nv_diag_remark {number}\n"
            f'#pragma message("kcache-read-{self.nonce}-{index}")\n#pragma nv_diagnostic pop\n'
        )

    def split_log(self, log: str) -> tuple[str, list[str]]:
        """NVRTC's ``log`` without the markers' messages, and the headers they name, in order.

        A marker's message is one line located in the header plus indented lines (the
        source line and a caret); all of them are removed.
        """
        kept: list[str] = []
        read: list[str] = []
        dropping = False
        for line in log.split("\n"):
            if line[:1] in (" ", "\t") or not line:
                if not dropping:
                    kept.append(line)
                continue
            match = self._line.fullmatch(line)
            dropping = match is not None
            if match is None:
                kept.append(line)
                continue
            index = int(match.group("index"))
            read.append(self.names[index] if index < len(self.names) else f"#{index}")
        return "\n".join(kept), read


def _trace_headers(trace_file: Path) -> list[str] | None:
    try:
        data = json.loads(trace_file.read_text())
    except (OSError, ValueError):
        return None
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        return None
    return [
        str(e["args"]["detail"])
        for e in events
        if isinstance(e, dict)
        and e.get("name") == "Processing Header File"
        and isinstance(e.get("args"), dict)
        and "detail" in e["args"]
    ]


def _check_complete(seen: list[str], inputs: CompileInputs, marked_reads: Sequence[str]) -> None:
    """Refuse a trace that is not proven complete (:class:`~kcache.errors.DependencyTraceError`)."""
    if not seen or seen[0] != BUILTIN_HEADER:
        raise DependencyTraceError(
            "NVRTC's dependency trace of a successful compile does not start with its builtin "
            f"header ({BUILTIN_HEADER}), so it may miss headers the compile read; nothing was stored"
        )
    traced = Counter(path for path in seen if path in inputs.headers)
    reached = Counter(marked_reads)
    for name in traced - reached:
        if os.path.lexists(name):
            # Traced under a header's name, but no marker: the file of that name here.
            raise RecipeError(
                "headers",
                f"NVRTC read {name!r} from the working directory instead of the in-memory header "
                "of that name (a quoted include is looked up next to the program first); "
                "rename or remove that file, or compile from another directory",
            )
    if traced != reached:
        differ = sorted((traced - reached) + (reached - traced))
        raise DependencyTraceError(
            "NVRTC's dependency trace and the headers the preprocessor reached disagree "
            f"({traced.total()} in-memory header reads traced, {reached.total()} reached; first "
            f"difference: {differ[0]}), so what the compile read is not proven; nothing was stored"
        )


def dependencies_from_trace(
    trace_file: Path, inputs: CompileInputs, marked_reads: Sequence[str]
) -> tuple[Dependency, ...]:
    """The exact dependency list of a successful compile, every file attributed to an input.

    ``marked_reads`` are the in-memory headers the compile's read markers named, in
    order (:meth:`ReadMarkers.split_log`). Raises
    :class:`~kcache.errors.UnlistedIncludeError` for the first file that is not an
    input (named as written), and :class:`~kcache.errors.DependencyTraceError` when
    NVRTC left no readable trace or one that is not proven complete: then nothing
    about the compile can be trusted.
    """
    seen = _trace_headers(trace_file)
    if seen is None:
        raise DependencyTraceError(
            "NVRTC wrote no dependency trace for a successful compile, so what it read is "
            "unknown; nothing was stored (is the compile scratch directory writable?)"
        )
    deps: set[Dependency] = set()
    for path in dict.fromkeys(seen):  # a header included from many places is listed each time
        origin = inputs.origin(path)
        if origin is None:
            raise UnlistedIncludeError(inputs.as_written(path))
        dep = inputs.dependency(origin)
        if dep is not None:
            deps.add(dep)
    _check_complete(seen, inputs, marked_reads)
    return tuple(sorted(deps))


def proven(dependency_check: int, *, manifest: bool, include_sets: IncludeSets) -> bool:
    """True when a dependency list recorded with ``dependency_check`` may be relied on.

    A manifest match rests on the list alone: it needs the current proof. An exact-key
    hit rests on it only for include-set files (the key covers the source and every
    in-memory header), so an older list still serves by key where there are no
    include sets to have missed.
    """
    if dependency_check >= DEPENDENCY_CHECK:
        return True
    return not manifest and not include_sets.names


def files_read(dependencies: Iterable[Dependency]) -> tuple[Dependency, ...]:
    """The dependencies that are files a compile read, without its include probes."""
    return tuple(dep for dep in dependencies if PROBE not in dep.name)


def set_place(name: str) -> tuple[str | None, str]:
    """(set, relative path) of a dependency read in a set (``set:path``) or a probe
    (``set?path``); (None, name) for an in-memory header."""
    cut = min((i for i in (name.find(":"), name.find("?")) if i >= 0), default=-1)
    if cut < 0:
        return None, name
    return name[:cut], name[cut + 1 :]


def current_hash(include_sets: IncludeSets, set_name: str, relative: str) -> str | None:
    """What a set holds now where a dependency or probe was recorded (None: the set is gone).

    A file's sha256, :data:`~kcache.include_probes.ABSENT` where no file is, or the set's
    digest for a whole-set probe (:data:`~kcache.include_probes.WHOLE_SET`).
    """
    if set_name not in include_sets.names:
        return None
    if relative == WHOLE_SET:
        return include_sets.digest(set_name)
    return include_sets.file_hash(set_name, relative) or ABSENT


def unchanged(
    dependencies: Iterable[Dependency],
    header_hashes: dict[str, str],
    set_names: Iterable[str],
    include_sets: IncludeSets,
) -> bool:
    """True when every dependency and probe is as recorded for this recipe (and the include sets)."""
    usable = {entry.partition("@")[0] for entry in set_names}
    for dep in dependencies:
        set_name, relative = set_place(dep.name)
        if set_name is not None:
            if (
                set_name not in usable
                or current_hash(include_sets, set_name, relative) != dep.sha256
            ):
                return False
        elif header_hashes.get(dep.name) != dep.sha256:
            return False
    return True


def include_set_files_unchanged(
    dependencies: Iterable[Dependency], include_sets: IncludeSets
) -> bool:
    """True when every include-set file and probe among ``dependencies`` is as recorded.

    A recipe key covers a set by its digest, which the server keeps current within a
    second; this re-check (cheap: hashes are memoised by stat) closes that second for
    the files the compile read and the places it looked.
    """
    for dep in dependencies:
        set_name, relative = set_place(dep.name)
        if set_name is not None and current_hash(include_sets, set_name, relative) != dep.sha256:
            return False
    return True
