"""Exact dependencies in every process state: NVRTC's trace is checked, never taken on trust.

A traced compile that stops on a fatal error inside a header leaves NVRTC's traces of
that process short from then on (the builtin header and all but the last of the
source's own includes are missing). These tests run such failures in this very
process (pytest's), then check what good compiles record against the truth a model
of each program gives (tests/deps_workload.py), and that every edit of a header a
compile read is a miss.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kcache.deps import (
    BUILTIN_HEADER,
    CompileInputs,
    ReadMarkers,
    dependencies_from_trace,
    files_read,
)
from kcache.engine import Engine
from kcache.errors import CompileError, DependencyTraceError, RecipeError, UnlistedIncludeError
from kcache.include_sets import IncludeSets
from kcache.local_engine import open_local_engine
from kcache.nvrtc import compile_in_this_process, compile_recipe, compile_seed, nvrtc_untrusted
from kcache.recipe import Recipe
from kcache.toolchain import Toolchain
from tests.deps_workload import SET_NAME, run_sequence, sequence_seeds

#: Random sequences in a --slow run (tests.deps_workload.SAMPLE_SEEDS otherwise);
#: bench/bdeps_exact_dependencies.py runs thousands.
SEQUENCES = 6

ADD = "__device__ float add(float a, float b) { return a + b; }\n"
MUL = "__device__ float mul(float a, float b) { return a * b; }\n"
TWO_HEADERS = (
    "#include <add.cuh>\n#include <mul.cuh>\n"
    'extern "C" __global__ void k(float* o) { o[0] = mul(add(o[0], 1.0f), 2.0f); }\n'
)
HEADER_ERROR = {"source": "#include <bad.cuh>\n", "headers": {"bad.cuh": "#error typo\n"}}


def _recipe(toolchain: Toolchain, **fields: Any) -> Recipe:
    fields.setdefault("target", "sm_90")
    return Recipe(toolchain=toolchain.id, **fields)


def _spoil(toolchain: Toolchain) -> None:
    """The failure that spoils NVRTC's traces: a fatal error inside a header, here."""
    with pytest.raises(CompileError, match="typo"):
        compile_in_this_process(_recipe(toolchain, **HEADER_ERROR), toolchain, IncludeSets())
    assert nvrtc_untrusted() is not None


@pytest.fixture()
def set_root(tmp_path: Path) -> Path:
    root = tmp_path / "set"
    root.mkdir()
    return root


def _engine_resolver(engine: Engine) -> Callable[[dict[str, Any]], tuple[str, list[str]]]:
    def resolve(recipe: dict[str, Any]) -> tuple[str, list[str]]:
        try:
            found = engine.resolve(Recipe.from_dict(recipe))
        except (CompileError, RecipeError):
            return "error", []
        return found.status, [d.name for d in files_read(found.artifact.dependencies)]

    return resolve


def test_a_spoiled_nvrtc_trace_is_refused_not_recorded(toolchain: Toolchain) -> None:
    """The finding itself, in this process: after the failure the trace lacks headers."""
    _spoil(toolchain)
    recipe = _recipe(toolchain, source=TWO_HEADERS, headers={"add.cuh": ADD, "mul.cuh": MUL})
    with pytest.raises(DependencyTraceError, match="builtin header"):
        compile_in_this_process(recipe, toolchain, IncludeSets())
    # The entry point every in-process compile takes runs it in a fresh process instead.
    output = compile_recipe(recipe, toolchain, IncludeSets())
    assert [d.name for d in output.dependencies] == ["add.cuh", "mul.cuh"]


def test_the_issue_case_locally_a_header_edit_after_a_typo_is_a_miss(
    toolchain: Toolchain, tmp_path: Path
) -> None:
    engine = open_local_engine(tmp_path / "data")
    with pytest.raises(CompileError, match="typo"):
        engine.resolve(Recipe(target="sm_90", **HEADER_ERROR))  # type: ignore[arg-type]
    headers = {"add.cuh": ADD, "mul.cuh": MUL}
    first = engine.resolve(Recipe(source=TWO_HEADERS, headers=headers, target="sm_90"))
    assert first.status == "compiled"
    assert [d.name for d in first.artifact.dependencies] == ["add.cuh", "mul.cuh"]
    edit = {**headers, "add.cuh": ADD.replace("a + b", "a - b")}
    second = engine.resolve(Recipe(source=TWO_HEADERS, headers=edit, target="sm_90"))
    assert second.status == "compiled"
    assert second.artifact.digest != first.artifact.digest


def test_random_sequences_in_one_process_record_exactly_what_was_read(
    tmp_path: Path, set_root: Path
) -> None:
    engine = open_local_engine(tmp_path / "data", include_sets={SET_NAME: set_root})
    seeds = sequence_seeds(SEQUENCES)
    print(f"exact-dependency sequences: seeds {seeds}")
    mismatches = [
        m for seed in seeds for m in run_sequence(seed, set_root, _engine_resolver(engine))
    ]
    assert not mismatches, mismatches


def test_a_model_program_reads_in_a_fresh_process_what_the_model_says(
    toolchain: Toolchain, set_root: Path
) -> None:
    """The model is the truth the property tests use: a fresh NVRTC agrees with it."""
    from kcache.fresh_compile import compile_in_fresh_process
    from tests.deps_workload import Workload

    work = Workload(random.Random(7), set_root)
    sets = IncludeSets({SET_NAME: set_root})
    for _ in range(4):
        program = work.program()
        recipe = Recipe.from_dict({**program.recipe, "toolchain": toolchain.id})
        output = compile_in_fresh_process(recipe, toolchain, sets)
        assert {d.name for d in files_read(output.dependencies)} == program.reads


def test_threads_compiling_while_another_fails_record_complete_lists(
    toolchain: Toolchain,
) -> None:
    """A compile that overlapped another thread's failure is not trusted to this process."""
    from concurrent.futures import ThreadPoolExecutor

    headers = {f"h{i}.cuh": f"#pragma once\n#define H{i} {i}\n" for i in range(6)}
    source = "".join(f"#include <h{i}.cuh>\n" for i in range(6))
    source += 'extern "C" __global__ void k(int* o) { o[0] = H0 + H5; }\n'

    def good(i: int) -> list[str]:
        recipe = _recipe(toolchain, source=source + f"// {i}\n", headers=headers)
        return [d.name for d in compile_recipe(recipe, toolchain, IncludeSets()).dependencies]

    def bad(i: int) -> None:
        recipe = _recipe(
            toolchain, source=f"// {i}\n" + HEADER_ERROR["source"], headers=HEADER_ERROR["headers"]
        )  # type: ignore[arg-type]
        with pytest.raises(CompileError):
            compile_recipe(recipe, toolchain, IncludeSets())

    with ThreadPoolExecutor(4) as pool:
        goods = [pool.submit(good, i) for i in range(6)]
        bads = [pool.submit(bad, i) for i in range(3)]
        for future in bads:
            future.result()
        for future in goods:
            assert future.result() == sorted(headers)


def test_the_read_markers_change_no_byte_of_the_output(
    toolchain: Toolchain, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Markers are appended to each in-memory header: plain NVRTC, same bytes (-G, -lineinfo).

    Both seeded alike, and both in a removed working directory, which -G and -lineinfo
    output would record otherwise (kcache compiles such a recipe in one).
    """
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    headers = {
        "a.cuh": "#ifndef A\n#define A\n__device__ int fa(int x) { return x + 1; }\n#endif",
        "vals.inc": "1, 2, 3,",  # included inside an initializer: a pragma there is fine
    }
    source = (
        "#include <a.cuh>\n#include <a.cuh>\n__device__ int tab[] = {\n#include <vals.inc>\n};\n"
        'extern "C" __global__ void k(int* o) { o[0] = fa(tab[o[1]]); }\n'
    )
    for flags in ((), ("-G",), ("-lineinfo",)):
        recipe = _recipe(toolchain, source=source, headers=headers, flags=flags)
        ours = compile_recipe(recipe, toolchain, IncludeSets())
        assert [d.name for d in ours.dependencies] == ["a.cuh", "vals.inc"]
        assert "kcache-read" not in ours.log
        # Traced as kcache traces (under -G the trace option itself moves bytes, markers do not).
        traced = (
            *flags,
            f"-frandom-seed={compile_seed(recipe)}",
            f"--fdevice-time-trace={tmp_path / 'trace'}",
        )
        assert ours.data == _plain_nvrtc(toolchain, source, headers, traced)


def test_markers_survive_a_recipe_that_suppresses_messages(toolchain: Toolchain) -> None:
    headers = {
        "quiet.cuh": "#pragma nv_diag_suppress 20200\n",
        "b.cuh": "#define B 2\n",
    }
    source = '#include <quiet.cuh>\n#include <b.cuh>\nextern "C" __global__ void k(int* o) { o[0] = B; }\n'
    for flags in ((), ("-w",), ("--diag-suppress=20200",), ("--diag-error=20200",)):
        recipe = _recipe(toolchain, source=source, headers=headers, flags=flags)
        deps = compile_recipe(recipe, toolchain, IncludeSets()).dependencies
        assert [d.name for d in deps] == ["b.cuh", "quiet.cuh"], flags


def test_a_trace_that_disagrees_with_the_markers_is_refused(tmp_path: Path) -> None:
    """The checks themselves, on traces NVRTC could write: short, from disk, forged."""
    import json

    inputs = CompileInputs("k.cu", {"a.cuh": "", "b.cuh": ""}, (), IncludeSets(), tmp_path)

    def check(trace: list[str], marked: list[str]) -> None:
        events = [{"name": "Processing Header File", "args": {"detail": p}} for p in trace]
        path = tmp_path / "trace.json"
        path.write_text(json.dumps({"traceEvents": events}))
        dependencies_from_trace(path, inputs, marked)

    check([BUILTIN_HEADER, "a.cuh", "b.cuh"], ["a.cuh", "b.cuh"])  # complete: accepted
    for trace, marked in (
        (["b.cuh"], ["a.cuh", "b.cuh"]),  # what a spoiled NVRTC writes
        ([BUILTIN_HEADER, "b.cuh"], ["a.cuh", "b.cuh"]),  # a header missing
        ([BUILTIN_HEADER, "a.cuh", "b.cuh"], ["b.cuh"]),  # traced but never reached: from disk
        (
            [BUILTIN_HEADER, "a.cuh", "b.cuh", "b.cuh"],
            ["a.cuh", "b.cuh"],
        ),  # read twice, once from disk
    ):
        with pytest.raises(DependencyTraceError):
            check(trace, marked)
    markers = ReadMarkers(["a.cuh"])
    forged = 'a.cuh(3): remark #20200-D: #pragma message: "kcache-read-0000000000000000-0"'
    assert markers.split_log(forged) == (forged, [])  # another nonce is just a message


def test_a_working_directory_file_named_like_a_header_never_answers_for_it(
    toolchain: Toolchain, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`#include "x.cuh"` from program `sub/k.cu` reads ./sub/x.cuh, which NVRTC traces under the
    name of the in-memory header `sub/x.cuh`: it printed no marker, so the recipe is refused."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "x.cuh").write_text("#define X 7\n")
    monkeypatch.chdir(tmp_path)
    recipe = _recipe(
        toolchain,
        name="sub/k.cu",
        source='#include "x.cuh"\nextern "C" __global__ void k(int* o) { o[0] = X; }\n',
        headers={"sub/x.cuh": "#define X 1\n"},
    )
    # In this process NVRTC reads ./sub/x.cuh and says so; once this process's NVRTC is
    # untrusted (an earlier test's failed compile), a fresh compile process does it, in a
    # removed directory as a server's worker, where ./sub/x.cuh is never found: refused too.
    refused = "from the working directory instead of the in-memory|'x.cuh' is not one of the"
    with pytest.raises(RecipeError, match=refused):
        compile_recipe(recipe, toolchain, IncludeSets())
    # Without the file nothing answers: in-memory headers are found by the name as written.
    (tmp_path / "sub" / "x.cuh").unlink()
    with pytest.raises(UnlistedIncludeError, match=r"x\.cuh"):
        compile_recipe(recipe, toolchain, IncludeSets())


# The bundled headers, as their users include them: plain NVRTC and kcache agree.
BUNDLED = {
    "cooperative_groups": (
        "#include <cooperative_groups.h>\nnamespace cg = cooperative_groups;\n"
        'extern "C" __global__ void k(int* o) { cg::thread_block b = cg::this_thread_block(); '
        "b.sync(); o[b.thread_rank()] = 1; }\n"
    ),
    "cluster": (
        "#include <cooperative_groups.h>\nnamespace cg = cooperative_groups;\n"
        'extern "C" __global__ void __cluster_dims__(2, 1, 1) k(int* o) { '
        "cg::cluster_group c = cg::this_cluster(); c.sync(); o[c.block_rank()] = 1; }\n"
    ),
    "cuda_barrier": (
        "#include <cuda/barrier>\n"
        'extern "C" __global__ void k(int* o) { __shared__ cuda::barrier<cuda::thread_scope_block> '
        "bar; if (threadIdx.x == 0) init(&bar, blockDim.x); __syncthreads(); bar.arrive_and_wait(); "
        "o[threadIdx.x] = 1; }\n"
    ),
    "cuda_std": (
        "#include <cuda/std/array>\n#include <cuda/std/limits>\n#include <cuda/std/utility>\n"
        'extern "C" __global__ void k(int* o) { cuda::std::array<int, 2> a{1, 2}; '
        "o[0] = a[1] + cuda::std::numeric_limits<int>::max(); }\n"
    ),
    "cub": (
        "#include <cub/block/block_reduce.cuh>\n"
        'extern "C" __global__ void k(const float* x, float* o) { using R = cub::BlockReduce<float, 128>; '
        "__shared__ typename R::TempStorage t; float s = R(t).Sum(x[threadIdx.x]); "
        "if (threadIdx.x == 0) o[0] = s; }\n"
    ),
    "thrust": (
        "#include <thrust/complex.h>\n"
        'extern "C" __global__ void k(float* o) { thrust::complex<float> z(o[0], o[1]); '
        "o[0] = thrust::abs(z * z); }\n"
    ),
}


#: CCCL's headers each cost seconds to compile: by default cub stands for them, and a
#: --slow run compiles the others too.
CCCL_MORE = {"cuda_barrier", "cuda_std", "thrust"}


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.slow) if n in CCCL_MORE else n for n in sorted(BUNDLED)],
)
def test_bundled_header_kernels_compile_as_plain_nvrtc_compiles_them(
    toolchain: Toolchain, tmp_path: Path, name: str
) -> None:
    source = BUNDLED[name]
    plain = _plain_nvrtc(toolchain, source, {}, (), allow_failure=True)
    engine = open_local_engine(tmp_path / "data")
    recipe = Recipe(source=source, target="sm_90")
    try:
        first = engine.resolve(recipe)
    except CompileError as exc:
        assert plain is None, f"plain NVRTC compiles {name}, kcache says: {exc}"
        return
    assert plain is not None, f"kcache compiles {name}, plain NVRTC does not"
    assert first.status == "compiled"
    assert first.artifact.dependencies == ()  # bundled headers are the toolchain's
    assert engine.resolve(recipe).status == "hit"


def test_a_name_expression_typo_is_nvrtcs_compile_error(toolchain: Toolchain) -> None:
    recipe = _recipe(
        toolchain,
        source="template <typename T> __global__ void scale(T* x) { x[0] *= T(2); }\n",
        name_expressions=("scale<flaot>",),
    )
    with pytest.raises(CompileError) as info:
        compile_recipe(recipe, toolchain, IncludeSets())
    assert 'identifier "flaot" is undefined' in info.value.log
    assert "__nv_name_map" in info.value.log


_PLAIN = """
import sys, json
from cuda.bindings import nvrtc
source, headers, options = json.loads(sys.stdin.read())
names = list(headers)
_, prog = nvrtc.nvrtcCreateProgram(source.encode(), b"kernel.cu", len(names),
    [headers[n].encode() for n in names], [n.encode() for n in names])
(result,) = nvrtc.nvrtcCompileProgram(prog, len(options), [o.encode() for o in options])
if result != nvrtc.nvrtcResult.NVRTC_SUCCESS:
    sys.exit(3)
_, size = nvrtc.nvrtcGetCUBINSize(prog)
buf = bytearray(size)
nvrtc.nvrtcGetCUBIN(prog, buf)
sys.stdout.buffer.write(bytes(buf))
"""


def _plain_nvrtc(
    toolchain: Toolchain,
    source: str,
    headers: dict[str, str],
    flags: tuple[str, ...],
    *,
    allow_failure: bool = False,
) -> bytes | None:
    """NVRTC as anyone calls it (bundled headers on the path, nothing else), in a fresh process."""
    import json

    options = ["-arch=sm_90", *toolchain.include_flags, *flags]
    done = subprocess.run(
        [sys.executable, "-c", _PLAIN],
        input=json.dumps([source, headers, options]).encode(),
        capture_output=True,
        check=False,
    )
    if done.returncode == 3 and allow_failure:
        return None
    assert done.returncode == 0, done.stderr.decode()
    return done.stdout


_FAIL_THEN_PLAIN = r"""
import os, sys
from cuda.bindings import nvrtc
from kcache.errors import CompileError
from kcache.include_sets import IncludeSets
from kcache.nvrtc import compile_in_this_process
from kcache.recipe import Recipe
from kcache.toolchain import load_toolchain

toolchain = load_toolchain()
broken = Recipe(toolchain=toolchain.id, target="sm_90", source="#include <bad.cuh>\n",
                headers={"bad.cuh": "#error typo\n"})
try:
    compile_in_this_process(broken, toolchain, IncludeSets())
except CompileError:
    pass
else:
    sys.exit("the broken recipe compiled")
# What the process's other NVRTC users (CuPy, cuda.core) do next: a compile of their own.
for _ in range(2):
    _, prog = nvrtc.nvrtcCreateProgram(b'extern "C" __global__ void k(int* a) { *a = 1; }',
                                       b"user.cu", 0, [], [])
    result = nvrtc.nvrtcCompileProgram(prog, 1, [b"-arch=sm_90"])
    assert result[0] == nvrtc.nvrtcResult.NVRTC_SUCCESS, result
    nvrtc.nvrtcDestroyProgram(prog)
print(sorted(os.listdir(".")))
"""


def test_a_failed_compile_leaves_no_trace_in_the_working_directory_of_the_process(
    toolchain: Toolchain, tmp_path: Path
) -> None:
    """NVRTC keeps tracing after a traced compile fails: every later compile of the process,
    the user's own included, wrote ``.json`` into its working directory until kcache ended
    the tracing after a failure (``kcache.nvrtc._end_tracing``). A fresh process, so its
    NVRTC starts clean; the working directory is the user's, empty before."""
    work = tmp_path / "work"
    work.mkdir()
    done = subprocess.run(
        [sys.executable, "-c", _FAIL_THEN_PLAIN], cwd=work, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_lists_recorded_before_the_proof_never_serve_a_manifest_match(tmp_path: Path) -> None:
    """An earlier release's short list (`mul.cuh` only, as a spoiled trace wrote) under the
    same base key: never matched, and the next compile of those bytes replaces its record."""
    from kcache.deps import DEPENDENCY_CHECK

    engine = open_local_engine(tmp_path / "data")
    headers = {"add.cuh": ADD, "mul.cuh": MUL}
    first = engine.resolve(Recipe(source=TWO_HEADERS, headers=headers, target="sm_90"))
    index = engine.index
    short = [e for e in first.artifact.to_dict()["dependencies"] if e["name"] == "mul.cuh"]
    legacy = {**first.artifact.to_dict(), "dependencies": short}
    del legacy["dependency_check"]  # what an earlier release wrote
    manifest = {"digest": first.artifact.digest, "dependencies": short, "created_at": 1.0}
    index._write("artifacts", first.artifact.digest, legacy)  # type: ignore[attr-defined]
    index._write("manifests", first.base_key, [manifest])  # type: ignore[attr-defined]
    assert index.artifact(first.artifact.digest).dependency_check == 0  # type: ignore[union-attr]

    # add.cuh edited in a way that leaves the output alone: same bytes, other key.
    edit = {**headers, "add.cuh": ADD + "// an edit the old list does not see\n"}
    again = engine.resolve(Recipe(source=TWO_HEADERS, headers=edit, target="sm_90"))
    assert again.status == "compiled"  # the legacy entry would have said "hit"
    assert again.artifact.digest == first.artifact.digest
    record = index.artifact(first.artifact.digest)
    assert record is not None and record.dependency_check == DEPENDENCY_CHECK
    assert [d.name for d in record.dependencies] == ["add.cuh", "mul.cuh"]
    assert index.manifest(first.base_key)[0].dependency_check == DEPENDENCY_CHECK


def test_kernel_cache_compiling_locally_answers_an_edit_after_a_typo(tmp_path: Path) -> None:
    from kcache_client import ClientSettings, KernelCache

    settings = ClientSettings.from_env(url="", local_compile=True)
    with KernelCache(cache_dir=tmp_path / "tier", settings=settings) as cache:
        with pytest.raises(CompileError):
            cache.get(Recipe(target="sm_90", **HEADER_ERROR))  # type: ignore[arg-type]
        headers = {"add.cuh": ADD, "mul.cuh": MUL}
        first = cache.get(Recipe(source=TWO_HEADERS, headers=headers, target="sm_90"))
        assert [d.name for d in first.metadata.dependencies] == ["add.cuh", "mul.cuh"]
        edit = {**headers, "add.cuh": ADD.replace("a + b", "a - b")}
        second = cache.get(Recipe(source=TWO_HEADERS, headers=edit, target="sm_90"))
        assert second.digest != first.digest


def test_the_cli_answers_an_edit_after_a_typo(tmp_path: Path) -> None:
    from tests.support import KCACHE

    (tmp_path / "bad.cu").write_text(HEADER_ERROR["source"])  # type: ignore[arg-type]
    (tmp_path / "bad.cuh").write_text("#error typo\n")
    (tmp_path / "k.cu").write_text(TWO_HEADERS)
    (tmp_path / "add.cuh").write_text(ADD)
    (tmp_path / "mul.cuh").write_text(MUL)
    env = {**os.environ, "KCACHE_URL": "", "KCACHE_CACHE_DIR": str(tmp_path / "cache")}

    def compile(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [KCACHE, "compile", *args, "--target", "sm_90"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )

    assert compile("bad.cu", "--header", "bad.cuh=bad.cuh").returncode != 0
    headers = ("--header", "add.cuh=add.cuh", "--header", "mul.cuh=mul.cuh")
    first = compile("k.cu", *headers)
    assert '"compiled"' in first.stdout, first.stderr
    (tmp_path / "add.cuh").write_text(ADD.replace("a + b", "a - b"))
    second = compile("k.cu", *headers)
    assert '"compiled"' in second.stdout, second.stdout + second.stderr
