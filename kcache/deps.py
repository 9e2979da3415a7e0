"""Dependencies: which headers a compile actually read, and whether a recipe still matches them.

NVRTC has no ``-M``. Its ``--fdevice-time-trace`` JSON has one "Processing Header
File" event per header it opened, nested ones included, in-memory headers under
their include names and files under their paths. That list is exact. If the trace
is missing or holds a path we cannot attribute, discovery falls back to a safe
superset (every supplied header and every file of every include set used): it
may miss the cache, never serve a stale artifact.

A dependency is ``(name, sha256)``: ``name`` is the include name of an in-memory
header, or ``<set>:<relative path>`` for a file of a registered include set (a
colon never occurs in an include name).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from kcache.include_sets import IncludeSets
from kcache.keys import sha256_hex

__all__ = [
    "Dependency",
    "dependencies_from_trace",
    "include_set_files_unchanged",
    "superset_dependencies",
    "unchanged",
]

_BUILTIN = "__nv_nvrtc_builtin_header.h"


@dataclass(frozen=True, order=True)
class Dependency:
    """One header a compile read, with the sha256 of the bytes it read."""

    name: str
    sha256: str

    def to_dict(self) -> dict[str, str]:
        """JSON form."""
        return {"name": self.name, "sha256": self.sha256}


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
        and "detail" in e.get("args", {})
    ]


def superset_dependencies(
    headers: dict[str, str], set_names: Iterable[str], include_sets: IncludeSets
) -> tuple[Dependency, ...]:
    """Every supplied header and every file of every include set used: never too few."""
    deps = {Dependency(name, sha256_hex(text)) for name, text in headers.items()}
    for set_name in set_names:
        for relative in include_sets.get(set_name).all_files():
            digest = include_sets.file_hash(set_name, relative)
            if digest is not None:
                deps.add(Dependency(f"{set_name}:{relative}", digest))
    return tuple(sorted(deps))


def dependencies_from_trace(
    trace_file: Path,
    headers: dict[str, str],
    set_names: Iterable[str],
    include_sets: IncludeSets,
    toolchain_include: Path,
) -> tuple[tuple[Dependency, ...], bool]:
    """The exact dependency list from a trace, and whether it was exact.

    Headers under ``toolchain_include`` are part of the toolchain id, not dependencies.
    """
    set_names = list(set_names)
    seen = _trace_headers(trace_file)
    if seen is None:
        return superset_dependencies(headers, set_names, include_sets), False
    toolchain_root = str(toolchain_include.resolve())
    deps: set[Dependency] = set()
    for detail in seen:
        if detail == _BUILTIN or detail.startswith(toolchain_root + "/"):
            continue
        if detail in headers:
            deps.add(Dependency(detail, sha256_hex(headers[detail])))
            continue
        for set_name in set_names:
            relative = include_sets.get(set_name).relative_name(detail)
            if relative is not None:
                digest = include_sets.file_hash(set_name, relative)
                if digest is None:
                    return superset_dependencies(headers, set_names, include_sets), False
                deps.add(Dependency(f"{set_name}:{relative}", digest))
                break
        else:
            # A header we cannot attribute: be conservative rather than wrong.
            return superset_dependencies(headers, set_names, include_sets), False
    return tuple(sorted(deps)), True


def unchanged(
    dependencies: Iterable[Dependency],
    header_hashes: dict[str, str],
    set_names: Iterable[str],
    include_sets: IncludeSets,
) -> bool:
    """True when every dependency has the same hash for this recipe (and the include sets)."""
    usable = set(set_names)
    for dep in dependencies:
        set_name, sep, relative = dep.name.partition(":")
        if sep:
            if set_name not in usable or include_sets.file_hash(set_name, relative) != dep.sha256:
                return False
        elif header_hashes.get(dep.name) != dep.sha256:
            return False
    return True


def include_set_files_unchanged(
    dependencies: Iterable[Dependency], include_sets: IncludeSets
) -> bool:
    """True when every include-set file among ``dependencies`` still has its hash.

    A recipe key covers in-memory headers but not the files of include sets, so an
    exact-key hit must re-check these (cheap: hashes are memoised by stat).
    """
    for dep in dependencies:
        set_name, sep, relative = dep.name.partition(":")
        if sep and include_sets.file_hash(set_name, relative) != dep.sha256:
            return False
    return True
