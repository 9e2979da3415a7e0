"""Include probes: where a compile looked for a header, and what it found there.

A dependency list names the files a compile read. A manifest match that rests on it
alone misses the lookups that *failed*: ``#if __has_include(<extra.h>)`` compiled
while no set held ``extra.h``, or ``<shadow.h>`` found in the second include set while
the first had none. Adding ``extra.h``, or a ``shadow.h`` to the first set, changes what
the compile would read, yet every file it read is unchanged. So after a compile the
engine records *probes* beside the files read (docs/design.md "What a binding rests
on"): for every include name the compile's texts name, each include-set path the name
was looked for at, in NVRTC's order, with the hash of the file there or :data:`ABSENT`.

How NVRTC looks (its options put the toolchain's bundled headers first, then each set's
root in the recipe's order): a quoted include in a set's file is looked for next to that
file first; then the bundled headers (covered by the toolchain id, so no probe), then each
set in order until one holds it. In-memory headers answer their own names and are in the
key. The names come from a text scan of every file the compile read (the source, the
in-memory headers read and the set files read): ``#include``, ``#include_next`` and
``__has_include``/``__has_include_next`` with a literal operand. A scan sees names in
branches the preprocessor skipped too: a superset, which may miss a match but never
serves a wrong one. A computed ``#include MACRO`` in any of them names no file the scan
can see, so the compile then records each set's whole digest (``<set>:*``): any change
in those sets misses.

A probe is a :class:`~kcache.deps.Dependency` named ``<set>?<relative path>`` (a file read
is ``<set>:<relative path>``: the list still says exactly what was read), whose hash is the
file's where one was, :data:`ABSENT` where none was, or ``<set>?*`` with the set's digest;
a place whose file was read is not probed again. :func:`kcache.deps.unchanged` compares
reads and probes alike against the sets now.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from kcache.deps import ABSENT, PROBE, WHOLE_SET, Dependency
from kcache.include_sets import IncludeSet, IncludeSets

if TYPE_CHECKING:
    from kcache.recipe import Recipe

__all__ = [
    "include_probes",
    "named_includes",
    "with_include_probes",
]


_INCLUDE_RE = re.compile(
    r'^[ \t]*#[ \t]*include(?:_next)?[ \t]*(?:"(?P<quoted>[^"\n]*)"|<(?P<angled>[^>\n]*)>|(?P<computed>[^\s/]))',
    re.MULTILINE,
)
_HAS_INCLUDE_RE = re.compile(
    r'\b__has_include(?:_next)?\s*\(\s*(?:"(?P<quoted>[^"\n]*)"|<(?P<angled>[^>\n]*)>)'
)


def named_includes(text: str) -> tuple[list[tuple[str, bool]], bool]:
    """The (name, quoted) pairs ``text``'s include directives and tests name; and whether one is computed."""
    names: list[tuple[str, bool]] = []
    computed = False
    for regex in (_INCLUDE_RE, _HAS_INCLUDE_RE):
        for match in regex.finditer(text):
            if match.groupdict().get("computed"):
                computed = True
            elif match.group("quoted") is not None:
                names.append((match.group("quoted"), True))
            else:
                names.append((match.group("angled"), False))
    return names, computed


def _inside(relative: str) -> str | None:
    """``relative`` normalised, or None where it is empty, absolute or leaves its root."""
    if not relative or relative.startswith("/") or "\\" in relative:
        return None
    normal = posixpath.normpath(relative)
    if normal in (".", "..") or normal.startswith("../"):
        return None
    return normal


def include_probes(
    set_entries: Iterable[str],
    source: str,
    headers: Mapping[str, str],
    read: Iterable[str],
    include_sets: IncludeSets,
    toolchain_include: Path,
) -> dict[str, str]:
    """``<set>?<path>`` -> hash (or :data:`ABSENT`) of every place the compile looked in a set.

    ``set_entries`` are the recipe's ``include_sets`` (names, pinned or not, in order);
    ``read`` the names of the dependencies the compile read (in-memory names, and
    ``<set>:<path>`` for set files).
    """
    sets = [include_sets.get(entry) for entry in dict.fromkeys(set_entries)]
    if not sets:
        return {}
    texts: list[tuple[IncludeSet | None, str, str]] = [(None, "", source)]
    for name in read:
        set_name, sep, relative = name.partition(":")
        if not sep:
            if name in headers:
                texts.append((None, "", headers[name]))
            continue
        read_set = include_sets.get(set_name)
        path = read_set.resolve(relative)
        if path is None:
            continue
        try:
            text = path.read_bytes().decode("utf-8", errors="replace")
        except OSError:
            continue
        texts.append((read_set, posixpath.dirname(relative), text))
    probes: dict[str, str] = {}
    for item, directory, text in texts:
        names, computed = named_includes(text)
        if computed:
            for each in sets:
                probes[f"{each.name}{PROBE}{WHOLE_SET}"] = include_sets.digest(
                    each.name, max_age_s=0
                )
        for name, quoted in names:
            if name in headers:
                continue
            if quoted and item is not None:
                beside = _inside(posixpath.join(directory, name))
                if beside is not None and _probe(probes, include_sets, item, beside):
                    continue
            looked_for = _inside(name)
            if looked_for is None or (toolchain_include / looked_for).is_file():
                continue  # outside every set, or a bundled header (in the toolchain id)
            for each in sets:
                if _probe(probes, include_sets, each, looked_for):
                    break
    return probes


def _probe(
    probes: dict[str, str], include_sets: IncludeSets, item: IncludeSet, relative: str
) -> bool:
    """Record what ``item`` holds at ``relative``; True when a file is there."""
    found = include_sets.file_hash(item.name, relative)
    probes[f"{item.name}{PROBE}{relative}"] = found or ABSENT
    return found is not None


def with_include_probes(
    dependencies: tuple[Dependency, ...],
    recipe: Recipe,
    include_sets: IncludeSets,
    toolchain_include: Path,
) -> tuple[Dependency, ...]:
    """A compile's dependencies with its include probes beside them, sorted (a file read keeps its hash)."""
    probes = include_probes(
        recipe.include_sets,
        recipe.source,
        recipe.headers,
        [dep.name for dep in dependencies],
        include_sets,
        toolchain_include,
    )
    if not probes:
        return dependencies
    read = {dep.name for dep in dependencies}
    looked = [
        Dependency(name, digest)
        for name, digest in probes.items()
        if name.replace(PROBE, ":", 1) not in read  # a read already records that file's hash
    ]
    return tuple(sorted((*dependencies, *looked)))
