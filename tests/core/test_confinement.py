"""A compile reads exactly its inputs: probes for host files are refused without echoing them.

In-process compiles (the CLI, a client compiling locally) with real NVRTC: includes of
host files by absolute path, ``/proc``, ``../`` escapes, computed includes,
``__has_include`` probes, symlinks out of an include set and headers in the working
directory are all refused with ``UnlistedIncludeError``; nothing is stored; logs keep
only messages about the recipe's own files.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from kcache.artifact import ArtifactMeta
from kcache.deps import PROBE, CompileInputs
from kcache.engine import Engine
from kcache.errors import CompileError, RecipeError, UnlistedIncludeError
from kcache.include_sets import IncludeSets
from kcache.local_engine import open_local_engine
from kcache.nvrtc import compile_recipe, recipe_log
from kcache.recipe import LinkInput, Recipe
from kcache.toolchain import Toolchain

KERNEL = 'extern "C" __global__ void k(int* o) { o[0] = 1; }\n'


@pytest.fixture()
def outside(tmp_path: Path) -> Path:
    """A directory outside every allowed root, with a marker header that is valid C++."""
    directory = tmp_path / "outside"
    directory.mkdir()
    return directory


@pytest.fixture()
def library(tmp_path: Path, outside: Path) -> Path:
    """An include set with a real header, an inner link and a link that points out of it."""
    root = tmp_path / "lib"
    (root / "lib").mkdir(parents=True)
    (root / "lib" / "value.h").write_text("#pragma once\n#define LIB_VALUE 5\n")
    (root / "lib" / "bad.h").write_text("#pragma once\nint lib_bad = ;\n")
    (root / "lib" / "inner.h").symlink_to(root / "lib" / "value.h")
    (root / "lib" / "escape.h").symlink_to(outside / "secret.h")
    return root


@pytest.fixture()
def engine(tmp_path: Path, library: Path) -> Engine:
    return open_local_engine(tmp_path / "data", include_sets={"lib": library})


def _recipe(source: str, **fields: object) -> Recipe:
    fields.setdefault("target", "sm_90")
    return Recipe(source=source, **fields)  # type: ignore[arg-type]


def _nothing_stored(engine: Engine, recipe: Recipe) -> None:
    resolved = engine.prepare(recipe)
    assert engine.index.lookup(resolved.key()) is None  # no artifact, no negative entry
    assert list(engine.store.digests()) == []


def _refusal(engine: Engine, recipe: Recipe) -> str:
    with pytest.raises(UnlistedIncludeError) as info:
        engine.resolve(recipe)
    _nothing_stored(engine, recipe)
    return str(info.value)


PASSWD_LINE = next(iter(Path("/etc/passwd").read_text().splitlines()), "root:x:0:0")

PROBES = {
    "absolute": ('#include "/etc/passwd"\n', "/etc/passwd"),
    "proc environ": ('#include "/proc/self/environ"\n', "/proc/self/environ"),
    "angled escape": (
        "#include <../../../../../../../../etc/passwd>\n",
        "../../../../../../../../etc/passwd",
    ),
    "quoted escape": (
        '#include "../../../../../../../../etc/passwd"\n',
        "../../../../../../../../etc/passwd",
    ),
    "computed": ("#define P(x) #x\n#include P(/etc/passwd)\n", "/etc/passwd"),
    "has_include absolute": (
        '#if __has_include("/etc/shadow")\n#define X 1\n#endif\n',
        "/etc/shadow",
    ),
    "has_include escape": ("#if __has_include(<../../etc/shadow>)\n#endif\n", "../../etc/shadow"),
}


@pytest.mark.parametrize("name", list(PROBES))
def test_host_file_probes_are_refused_without_their_content(engine: Engine, name: str) -> None:
    prefix, written = PROBES[name]
    text = _refusal(engine, _recipe(prefix + KERNEL))
    assert text == str(UnlistedIncludeError(written))  # the include as written, and nothing else
    assert PASSWD_LINE not in text and "root:" not in text


@pytest.mark.parametrize(
    "source",
    [
        '#define Q "/etc/shadow"\n#if __has_include(Q)\n#endif\n',  # computed operand
        "#define S(x) #x\n#if __has_include(S(/etc/shadow))\n#endif\n",
        "#define HAS __has_include\n#if HAS(<x.h>)\n#endif\n",  # an alias of the operator
    ],
)
def test_has_include_with_a_computed_operand_is_refused_before_compiling(
    engine: Engine, source: str
) -> None:
    with pytest.raises(RecipeError, match=r"needs a string or <\.\.\.> literal") as info:
        engine.resolve(_recipe(source + KERNEL))
    assert info.value.field == "source"
    _nothing_stored(engine, _recipe(source + KERNEL))


def test_has_include_of_inputs_still_works(engine: Engine) -> None:
    source = (
        "#if defined(__has_include)\n"
        '#if __has_include("a.cuh") && __has_include(<lib/value.h>) && !__has_include("absent.cuh")\n'
        "#define PICKED 3\n#endif\n#endif\n"
        'extern "C" __global__ void k(int* o) { o[0] = PICKED; }\n'
    )
    headers = {"a.cuh": "// present\n"}
    assert (
        engine.resolve(_recipe(source, headers=headers, include_sets=["lib"])).status == "compiled"
    )
    with pytest.raises(UnlistedIncludeError) as info:  # the operand's field is named
        engine.resolve(
            _recipe(KERNEL, headers={"h.cuh": '#if __has_include("/etc/hosts")\n#endif\n'})
        )
    assert info.value.field == 'headers["h.cuh"]'


@pytest.mark.parametrize("content", ["#define OUTSIDE_VALUE 7\n", "not C++ at all: marker\n"])
def test_an_outside_file_is_refused_the_same_whether_it_exists_or_not(
    engine: Engine, outside: Path, content: str
) -> None:
    """Readable valid C++ (the trace names it), unreadable garbage (the log names it), absent: one answer."""
    marker = f"KC_MARKER_{uuid.uuid4().hex}"
    path = outside / "secret.h"
    source = f'#include "{path}"\n' + KERNEL
    path.write_text(content + f"// {marker}\n")
    present = _refusal(engine, _recipe(source))
    path.unlink()
    absent = _refusal(engine, _recipe(source))
    assert present == absent == str(UnlistedIncludeError(str(path)))
    assert marker not in present


def test_a_symlink_out_of_an_include_set_is_refused(engine: Engine, outside: Path) -> None:
    marker = f"KC_MARKER_{uuid.uuid4().hex}"
    (outside / "secret.h").write_text(f"#define ESCAPED 1 // {marker}\n")
    text = _refusal(engine, _recipe("#include <lib/escape.h>\n" + KERNEL, include_sets=["lib"]))
    assert "lib/escape.h" in text and marker not in text
    # A link that stays inside the root is the file it points to.
    inner = engine.resolve(
        _recipe(
            '#include <lib/inner.h>\nextern "C" __global__ void k(int* o) { o[0] = LIB_VALUE; }',
            include_sets=["lib"],
        )
    )
    read = [d.name for d in inner.artifact.dependencies if PROBE not in d.name]
    assert read == ["lib:lib/value.h"]  # (beside the include probes: where it looked)


def test_a_set_that_the_recipe_does_not_name_is_no_input(engine: Engine, library: Path) -> None:
    text = _refusal(engine, _recipe(f'#include "{library}/lib/value.h"\n' + KERNEL))
    assert str(library) in text  # the include as written (an absolute path), not the file


def test_working_directory_header_is_never_read(
    engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stale hit of issue 10: a header next to the compiling process changes, the key does not."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    header = cwd / "memsys.cuh"
    source = '#include "memsys.cuh"\nextern "C" __global__ void k(int* o) { o[0] = MEMSYS; }\n'
    for value in (1, 2):
        header.write_text(f"#define MEMSYS {value}\n")
        assert _refusal(engine, _recipe(source)) == str(UnlistedIncludeError("memsys.cuh"))
    first = engine.resolve(_recipe(source, headers={"memsys.cuh": "#define MEMSYS 1\n"}))
    second = engine.resolve(_recipe(source, headers={"memsys.cuh": "#define MEMSYS 2\n"}))
    assert (first.status, second.status) == ("compiled", "compiled")
    assert first.artifact.digest != second.artifact.digest


def test_logs_keep_only_the_recipes_own_messages(
    engine: Engine, library: Path, toolchain: Toolchain
) -> None:
    source = '#include "h.cuh"\n#include <lib/bad.h>\n' + KERNEL
    recipe = _recipe(source, headers={"h.cuh": "int h_bad = ;\n"}, include_sets=["lib"])
    with pytest.raises(CompileError) as info:
        engine.resolve(recipe)
    log = info.value.log
    assert "h.cuh(1): error" in log and "lib:lib/bad.h(2): error" in log
    assert str(library) not in log and str(toolchain.include_dir) not in log
    failure = engine.index.lookup(
        engine.prepare(recipe).key()
    )  # the negative entry keeps the same log
    assert failure is not None and getattr(failure, "log", None) == log


def test_recipe_log_drops_other_files_and_counts_them(toolchain: Toolchain) -> None:
    inputs = CompileInputs("kernel.cu", {"h.cuh": ""}, [], IncludeSets(), toolchain.include_dir)
    bundled = toolchain.include_dir / "cuda_fp16.hpp"
    raw = "\n".join(
        [
            'kernel.cu(3): error: identifier "x" is undefined',
            "  int y = x;\x0croot:x:0:0 fake top-level line after a form feed",
            "          ^",
            f"{bundled}(12): warning: something in a bundled header",
            "unexpected line of no known form: SECRET",
            "  SECRET continuation",
            '2 errors detected in the compilation of "kernel.cu".',
        ]
    )
    log, unlisted = recipe_log(raw, inputs)
    assert unlisted == []
    assert "<nvrtc>/cuda_fp16.hpp(12): warning" in log and str(toolchain.include_dir) not in log
    assert "SECRET" not in log and "1 compiler message about files outside" in log
    assert log.count("\n") == 5  # the form feed stayed inside its source line
    log, unlisted = recipe_log("/etc/passwd(1): error: x\n  root:x:0:0:root\n", inputs)
    assert unlisted == ["/etc/passwd"] and "root" not in log


def test_an_artifact_recorded_with_inexact_dependencies_is_never_served(engine: Engine) -> None:
    recipe = engine.prepare(_recipe(KERNEL))
    digest = engine.store.put(b"\x7fELF stale bytes from an inexact compile")
    stale = ArtifactMeta(
        digest, 40, "cubin", "sm_90", recipe.toolchain or "", dependencies_exact=False
    )
    engine.index.record_artifact(recipe.key(), recipe.base_key(), stale)
    resolved = engine.resolve(recipe)
    assert resolved.status == "compiled" and resolved.artifact.digest != digest
    assert resolved.artifact.dependencies_exact


def test_every_recipe_kind_compiles_and_hits(engine: Engine) -> None:
    """In-memory headers and include sets are covered by test_dependencies; here the others."""
    fp16 = _recipe(
        '#include <cuda_fp16.h>\nextern "C" __global__ void k(__half* x) { x[0] = __hmul(x[0], x[0]); }'
    )
    named = _recipe(
        "template <typename T, int N> __global__ void fill(T* o) { o[threadIdx.x] = T(N); }",
        name_expressions=["fill<float, 256>"],
    )
    helper = _recipe("__device__ float triple(float x) { return 3.0f * x; }", output="ltoir")
    linked = _recipe(
        'extern __device__ float triple(float); extern "C" __global__ void k(float* o) { o[0] = triple(o[0]); }',
        flags=["-rdc=true"],
        lto=True,
        link=[LinkInput(recipe=helper)],
    )
    for recipe in (fp16, named, linked):
        assert engine.resolve(recipe).status == "compiled"
        again = engine.resolve(recipe)
        assert again.status == "hit" and again.artifact.dependencies_exact
    assert engine.resolve(named).artifact.lowered_names == {
        "fill<float, 256>": "_Z4fillIfLi256EEvPT_"
    }


def test_compile_recipe_never_reads_the_working_directory(
    toolchain: Toolchain, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """compile_recipe itself (no engine) never finds a quoted include in the working directory."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "kernel.cuh").write_text("#define FROM_CWD 1\n")
    recipe = Recipe(
        source='#include "kernel.cuh"\n' + KERNEL, target="sm_90", toolchain=toolchain.id
    )
    with pytest.raises(UnlistedIncludeError, match=r"kernel\.cuh"):
        compile_recipe(recipe, toolchain, IncludeSets())
    assert os.listdir(tmp_path) == ["kernel.cuh"]  # and it wrote nothing there
