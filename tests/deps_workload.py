"""Random sequences of failing and good compiles, with the headers each good one really reads.

The exact-dependency property (tests/core/test_exact_dependencies.py, the server's
test of it and bench/bdeps_exact_dependencies.py): whatever a process compiled
before, a good compile records exactly the headers it read, and an edit of any of
them is a miss. The truth does not come from NVRTC: each program is generated from
a model (a random include graph over in-memory headers and include-set files, with
conditional includes decided by ``-D`` flags, guards of both kinds, quoted includes
of siblings), and the model says which files the preprocessor reaches.

A sequence mixes in failures of every kind seen to matter (a fatal error inside a
header at some depth, an include a header cannot open, the same in the source, a
syntax error or a ``static_assert`` in a header, a name-expression typo).
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SET_NAME = "deplib"

#: The sequences a default test run checks, seeded: between them every kind of failure
#: in FAILURES comes before good compiles and their edits (4: a fatal error in a header,
#: twice, then good compiles; 7: an include a header cannot open, a name-expression typo,
#: a static_assert; 8: an include the source cannot open, a syntax error in a header).
SAMPLE_SEEDS = (4, 7, 8)
#: Another such sample, for a second test sharing an include set with the first (the
#: same seed makes the same files): 3, 5, 13 and 14 between them fail in every way too.
OTHER_SAMPLE_SEEDS = (3, 5, 13, 14)


def sequence_seeds(full: int, sample: tuple[int, ...] = SAMPLE_SEEDS) -> list[int]:
    """The seeds of a test's sequences: ``sample`` by default; in a ``--slow`` run (or with
    ``KCACHE_DEPS_SEQUENCES``), that many (else ``full``) fresh random ones, printed by
    the caller so that a failure can be run again."""
    from tests.support import full_runs

    count = os.environ.get("KCACHE_DEPS_SEQUENCES")
    if count is None and not full_runs():
        return list(sample)
    base = random.SystemRandom().randrange(1 << 32)
    return list(range(base, base + (int(count) if count else full)))


#: How a failing recipe fails: what it adds to a program that would otherwise compile.
FAILURES = (
    "error_in_header",
    "missing_include_in_header",
    "error_in_source",
    "missing_include_in_source",
    "syntax_error_in_header",
    "static_assert_in_header",
    "name_expression_typo",
)


@dataclass
class _File:
    """One header of the model: in memory (``name``) or in the include set (``set:rel``)."""

    dep_name: str  # how a dependency list names it
    include_as: str  # what an #include of it from the source writes, without delimiters
    in_set: bool
    children: list[tuple[_File, str | None, bool]] = field(default_factory=list)
    guard: str = "once"  # "once" | "ifndef"
    value: int = 0

    def text(self) -> str:
        lines = ["#pragma once"] if self.guard == "once" else []
        macro = "KC_" + "".join(c if c.isalnum() else "_" for c in self.dep_name).upper()
        if self.guard == "ifndef":
            lines += [f"#ifndef {macro}_H", f"#define {macro}_H"]
        for child, condition, quoted in self.children:
            written = (
                child.include_as.rsplit("/", 1)[-1]
                if quoted and child.in_set and self.in_set
                else child.include_as
            )
            include = f'#include "{written}"' if quoted else f"#include <{written}>"
            lines += [f"#if {condition}", include, "#endif"] if condition else [include]
        lines.append(f"#define {macro}_VALUE {self.value}")
        if self.guard == "ifndef":
            lines.append("#endif")
        return "\n".join(lines) + "\n"


@dataclass
class Program:
    """A generated recipe (as a JSON-able dict) and the dependency names it must record."""

    recipe: dict[str, Any]
    reads: set[str]
    set_files: dict[str, Path]  # dep name -> path of each include-set file it may read


@dataclass
class Workload:
    """Programs for one sequence, under a directory of its own inside the include set."""

    rng: random.Random
    set_root: Path
    target: str = "sm_90"
    counter: int = 0

    def _tag(self) -> str:
        self.counter += 1
        return f"q{self.rng.randrange(1 << 30):08x}{self.counter}"

    def program(self) -> Program:
        """A random good program: its recipe and the headers the preprocessor reaches."""
        rng = self.rng
        tag = self._tag()
        directory = self.set_root / tag
        directory.mkdir(parents=True)
        files: list[_File] = []
        for i in range(rng.randint(2, 7)):
            in_set = rng.random() < 0.3
            if in_set:
                rel = f"{tag}/s{i}.h"
                item = _File(f"{SET_NAME}:{rel}", rel, True)
            else:
                name = f"{tag}/h{i}.cuh" if rng.random() < 0.5 else f"{tag}_h{i}.cuh"
                item = _File(name, name, False)
            item.guard = rng.choice(("once", "ifndef"))
            item.value = rng.randrange(1000)
            files.append(item)
        macros: dict[str, int] = {}
        for i, item in enumerate(files):
            for child in files[i + 1 :]:
                if rng.random() < 0.4:
                    condition = None
                    if rng.random() < 0.3:
                        macro = f"KC_USE_{len(macros)}"
                        macros[macro] = rng.randint(0, 1)
                        condition = macro
                    # A quoted include of a sibling set file is found next to its includer.
                    quoted = item.in_set and child.in_set and rng.random() < 0.6
                    item.children.append((child, condition, quoted))
        top: list[tuple[_File, str | None]] = []
        for item in files:
            if rng.random() < 0.6:
                condition = None
                if rng.random() < 0.25:
                    macro = f"KC_USE_{len(macros)}"
                    macros[macro] = rng.randint(0, 1)
                    condition = macro
                top.append((item, condition))
        if not top:
            top.append((files[0], None))
        reads: set[str] = set()

        def reach(item: _File) -> None:
            if item.dep_name in reads:
                return
            reads.add(item.dep_name)
            for child, condition, _ in item.children:
                if condition is None or macros[condition]:
                    reach(child)

        source_lines = []
        for item, condition in top:
            if condition is None or macros[condition]:
                reach(item)
            include = f"#include <{item.include_as}>"
            source_lines += [f"#if {condition}", include, "#endif"] if condition else [include]
        source_lines.append(
            f'extern "C" __global__ void k_{tag}(int* out) {{ out[0] = {rng.randrange(99)}; }}'
        )
        headers = {f.dep_name: f.text() for f in files if not f.in_set}
        set_files: dict[str, Path] = {}
        for item in files:
            if item.in_set:
                path = self.set_root / item.include_as
                path.write_text(item.text())
                set_files[item.dep_name] = path
        recipe: dict[str, Any] = {
            "source": "\n".join(source_lines) + "\n",
            "headers": headers,
            "target": self.target,
            "flags": [f"-D{m}={v}" for m, v in macros.items()],
            "include_sets": [SET_NAME],
        }
        return Program(recipe, reads, set_files)

    def failing(self, kind: str) -> dict[str, Any]:
        """A recipe that fails to compile in the way ``kind`` names (new each time)."""
        tag = self._tag()
        depth = self.rng.randint(1, 3)
        headers = {f"{tag}_d{i}.cuh": f"#include <{tag}_d{i + 1}.cuh>\n" for i in range(depth)}
        last = f"{tag}_d{depth}.cuh"
        body = {
            "error_in_header": "#error a header stops the compile\n",
            "missing_include_in_header": f"#include <{tag}_absent.h>\n",
            "syntax_error_in_header": "__device__ int broken = ;\n",
            "static_assert_in_header": 'static_assert(sizeof(int) == 3, "no");\n',
        }
        source = (
            f'#include <{tag}_d0.cuh>\nextern "C" __global__ void k_{tag}(int* o) {{ o[0] = 1; }}\n'
        )
        recipe: dict[str, Any] = {"target": self.target, "headers": headers}
        headers[last] = body.get(kind, "#define KC_LAST 1\n")
        if kind == "error_in_source":
            source = "#error the source stops the compile\n" + source
        elif kind == "missing_include_in_source":
            source = f"#include <{tag}_absent.h>\n" + source
        elif kind == "name_expression_typo":
            source += f"template <typename T> __global__ void t_{tag}(T* x) {{ x[0] = T(1); }}\n"
            recipe["name_expressions"] = [f"t_{tag}<flaot>"]
        recipe["source"] = source
        return recipe


def edited(program: Program, dep_name: str, serial: int) -> dict[str, Any]:
    """The program's recipe with one in-memory header edited (set files are edited on disk)."""
    recipe = dict(program.recipe)
    headers = dict(recipe["headers"])
    headers[dep_name] = headers[dep_name] + f"// edit {serial}\n#define KC_EDIT_{serial} 1\n"
    recipe["headers"] = headers
    return recipe


def edit_set_file(path: Path, serial: int) -> None:
    """Edit an include-set file (its size changes, so no stat memo can hide it)."""
    path.write_text(path.read_text() + f"// edit {serial}\n#define KC_EDIT_{serial} 1\n")


@dataclass
class Mismatch:
    """One way a sequence broke the property."""

    seed: int
    step: int
    what: str


def run_sequence(
    seed: int,
    set_root: Path,
    resolve: Callable[[dict[str, Any]], tuple[str, list[str]]],
    *,
    steps: int = 6,
    edits: int = 2,
) -> Iterator[Mismatch]:
    """Run one seeded sequence against ``resolve``; yield every broken expectation.

    ``resolve(recipe)`` compiles or looks up a recipe and returns the status ("compiled",
    "hit", ...; "error" for a refused recipe) and the recorded dependency names.
    """
    rng = random.Random(seed)
    work = Workload(rng, set_root)
    serial = 0
    for step in range(steps):
        if rng.random() < 0.45:
            kind = rng.choice(FAILURES)
            status, _ = resolve(work.failing(kind))
            if status != "error":
                yield Mismatch(seed, step, f"a {kind} recipe was answered {status}")
            continue
        program = work.program()
        status, deps = resolve(program.recipe)
        if status != "compiled" or set(deps) != program.reads:
            yield Mismatch(
                seed,
                step,
                f"good compile: {status}, recorded {sorted(deps)}, read {sorted(program.reads)}",
            )
            continue
        for name in rng.sample(sorted(program.reads), min(edits, len(program.reads))):
            serial += 1
            if name in program.set_files:
                edit_set_file(program.set_files[name], serial)
                recipe = program.recipe
            else:
                recipe = edited(program, name, serial)
                program.recipe = recipe  # later edits build on this one
            status, _ = resolve(recipe)
            if status != "compiled":
                yield Mismatch(seed, step, f"edit of {name} was answered {status}")
