"""Every option of CuPy and cuda.core 1.2 through the adapters: a recipe, a bypass, or a refusal.

The tables below are the contract ``docs/adapters.md`` states: each NVRTC option CuPy
passes and each ``ProgramOptions`` field of cuda.core either becomes a recipe (its
canonical flags are accepted by the real NVRTC here), is handed to the library itself
(a bypass, with the reason the audit records), or is refused with a reason. Bypasses
warn once per reason, raise under ``KCACHE_BYPASS=error``, and reach a real server as
``bypass`` events. Launches against the real libraries are ``tests/gpu/adapters_library_check.py``.
"""

from __future__ import annotations

import dataclasses
import pickle
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from client_harness import KcacheServer, Proxy
from kcache_client import ClientSettings, KernelCache, _adapters, _bypass
from kcache_client._adapter_plans import (
    cuda_core_plan,
    cupy_plan,
    translate_cucomplex,
    uses_cupy_headers,
)
from kcache_client._bypass import Bypass, BypassWarning
from kcache_client._cupy_headers import include_set_name
from kcache_client.errors import BypassRefusedError
from kcache_server.auditing.events import ClientEvent

from kcache import Recipe
from kcache.errors import CompileError, RecipeError

PLAIN = 'extern "C" __global__ void inc(float* x) { x[threadIdx.x] += 1.0f; }\n'


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[KernelCache]:
    """A local cache (real NVRTC), also the process's default one for unpickled modules."""
    monkeypatch.delenv("KCACHE_URL", raising=False)
    monkeypatch.delenv("KCACHE_BYPASS", raising=False)
    kc = KernelCache(cache_dir=tmp_path / "tier")
    monkeypatch.setattr(_adapters, "_default", kc)
    yield kc
    kc.close()


def _nvrtc_accepts(flags: list[str]) -> tuple[bool, str]:
    """Compile PLAIN with the real NVRTC and these flags: (accepted, log)."""
    from cuda.bindings import nvrtc

    _, program = nvrtc.nvrtcCreateProgram(PLAIN.encode(), b"k.cu", 0, [], [])
    options = [b"-arch=sm_90", *(f.encode() for f in flags)]
    (result,) = nvrtc.nvrtcCompileProgram(program, len(options), options)[:1]
    _, size = nvrtc.nvrtcGetProgramLogSize(program)
    # A bytearray: NVRTC writes into the buffer, and ``b" " * 1`` is the interpreter's one
    # shared b" " (an empty log is one NUL byte): writing it made every b" " in the process
    # a NUL, and far-away tests failed to split HTTP status lines.
    log = bytearray(size)
    nvrtc.nvrtcGetProgramLog(program, log)
    nvrtc.nvrtcDestroyProgram(program)
    return result == nvrtc.nvrtcResult.NVRTC_SUCCESS, bytes(log).decode(errors="replace")


# ----------------------------------------------------------------------------- cuda.core
# Every ProgramOptions field of cuda.core 1.2: (value, "recipe" | "bypass"). A bypass's
# reason is "ProgramOptions.<field>"; the reasons themselves are kcache.options' sentences.
CUDA_CORE_FIELDS: dict[str, tuple[Any, str]] = {
    "name": ("prog", "recipe"),
    "arch": ("sm_90", "recipe"),
    "relocatable_device_code": (True, "recipe"),
    "extensible_whole_program": (True, "recipe"),
    "debug": (True, "recipe"),
    "lineinfo": (True, "recipe"),
    "device_code_optimize": (True, "recipe"),
    "ptxas_options": ("-v", "bypass"),  # ptxas options are not in the recipe's allow-list
    "max_register_count": (32, "recipe"),
    "ftz": (True, "recipe"),
    "prec_sqrt": (False, "recipe"),
    "prec_div": (False, "recipe"),
    "fma": (False, "recipe"),
    "use_fast_math": (True, "recipe"),
    "extra_device_vectorization": (True, "recipe"),
    "link_time_optimization": (True, "recipe"),  # with target_type="ltoir"
    "gen_opt_lto": (True, "bypass"),  # kcache's LTO runs nvJitLink itself
    "define_macro": ([("N", "4"), "FLAG"], "recipe"),
    "undefine_macro": ("X", "recipe"),
    "include_path": ("<dir>", "recipe"),  # a small directory: its headers go in the recipe
    "use_bundled_headers": (True, "recipe"),  # dropped: kcache always uses them
    "pre_include": ("a.h", "bypass"),
    "no_source_include": (True, "recipe"),
    "std": ("c++17", "recipe"),
    "builtin_move_forward": (False, "recipe"),
    "builtin_initializer_list": (False, "recipe"),
    "disable_warnings": (True, "recipe"),
    "restrict": (True, "recipe"),
    "device_as_default_execution_space": (True, "recipe"),
    "device_int128": (True, "recipe"),
    "optimization_info": ("inline", "bypass"),  # not in the allow-list (yet)
    "no_display_error_number": (True, "recipe"),
    "diag_error": (20, "recipe"),
    "diag_suppress": ([177, 550], "recipe"),
    "diag_warn": (177, "recipe"),
    "brief_diagnostics": (True, "bypass"),  # not in the allow-list (yet)
    "time": ("t.csv", "bypass"),  # writes a file
    "split_compile": (4, "recipe"),
    "fdevice_syntax_only": (True, "recipe"),
    "minimal": (True, "recipe"),
    "no_cache": (True, "recipe"),  # dropped: changes no output byte (tested below)
    "fdevice_time_trace": ("t.json", "bypass"),  # writes a file
    "device_float128": (True, "bypass"),  # not in the allow-list (yet)
    "frandom_seed": ("3", "bypass"),  # not in the allow-list (yet)
    "ofast_compile": ("min", "recipe"),
    "pch": (True, "bypass"),
    "create_pch": ("a.pch", "bypass"),
    "use_pch": ("a.pch", "bypass"),
    "pch_dir": ("/tmp", "bypass"),
    "pch_verbose": (True, "bypass"),
    "pch_messages": (True, "bypass"),
    "instantiate_templates_in_pch": (True, "bypass"),
    "extra_sources": ([("a", "b")], "bypass"),  # NVVM only
    "use_libdevice": (True, "bypass"),  # NVVM only
    "numba_debug": (True, "bypass"),  # not in the allow-list (yet)
}


def _program_options() -> Any:
    core = pytest.importorskip("cuda.core")
    return core.ProgramOptions


def test_the_table_covers_every_program_options_field_of_this_cuda_core() -> None:
    fields = {f.name for f in dataclasses.fields(_program_options())}
    assert fields == set(CUDA_CORE_FIELDS), sorted(fields ^ set(CUDA_CORE_FIELDS))


@pytest.mark.parametrize("field", sorted(CUDA_CORE_FIELDS))
def test_every_program_options_field_is_a_recipe_or_a_named_bypass(
    field: str, tmp_path: Path
) -> None:
    value, expected = CUDA_CORE_FIELDS[field]
    (tmp_path / "tile.h").write_text("#pragma once\n")
    value = str(tmp_path) if value == "<dir>" else value
    options = _program_options()(**{"arch": "sm_90", field: value})
    target_type = "ltoir" if field == "link_time_optimization" else "cubin"
    plan = cuda_core_plan(PLAIN, options, target_type, ())
    if expected == "bypass":
        assert isinstance(plan, Bypass), (field, plan)
        assert plan.library == "cuda.core" and plan.reason == f"ProgramOptions.{field}"
        assert len(plan.detail) > 20  # a sentence, not a code
        return
    assert isinstance(plan, Recipe), (field, plan)
    if plan.output != "ltoir":
        ok, log = _nvrtc_accepts(list(plan.flags))  # what the recipe says, NVRTC takes
        assert ok, (field, plan.flags, log)


def test_ofast_compile_is_spelled_as_cuda_core_spells_it_and_nvrtc_takes_it() -> None:
    options = _program_options()(arch="sm_90", ofast_compile="min")
    plan = cuda_core_plan(PLAIN, options, "cubin", ())
    assert isinstance(plan, Recipe) and "--Ofast-compile=min" in plan.flags
    assert options.as_bytes("nvrtc")[-1] == b"--Ofast-compile=min"  # cuda.core's own spelling
    assert _nvrtc_accepts(["--Ofast-compile=min"])[0]
    assert not _nvrtc_accepts(["-Ofast-compile=min"])[0]  # the spelling kcache used to send
    # Every spelling a CuPy user may write ends in the one NVRTC takes.
    for spelling in ("-Ofast-compile=min", "--Ofast-compile=min"):
        recipe = cupy_plan(PLAIN, (spelling,), None)
        assert isinstance(recipe, Recipe) and "--Ofast-compile=min" in recipe.flags


def test_no_cache_is_dropped_because_it_changes_no_output_byte() -> None:
    from cuda.bindings import nvrtc

    def cubin(flags: list[bytes]) -> bytes:
        _, program = nvrtc.nvrtcCreateProgram(PLAIN.encode(), b"k.cu", 0, [], [])
        nvrtc.nvrtcCompileProgram(program, len(flags), flags)
        _, size = nvrtc.nvrtcGetCUBINSize(program)
        out = bytearray(size)  # written in place: never a shared bytes object (see above)
        nvrtc.nvrtcGetCUBIN(program, out)
        nvrtc.nvrtcDestroyProgram(program)
        return bytes(out)

    assert cubin([b"-arch=sm_90", b"--no-cache"]) == cubin([b"-arch=sm_90"])
    with_it = cuda_core_plan(PLAIN, _program_options()(arch="sm_90", no_cache=True), "cubin", ())
    without = cuda_core_plan(PLAIN, _program_options()(arch="sm_90"), "cubin", ())
    assert isinstance(with_it, Recipe) and isinstance(without, Recipe)
    assert with_it.flags == without.flags


def test_a_target_type_kcache_does_not_make_is_cuda_core_s_to_refuse() -> None:
    plan = cuda_core_plan(PLAIN, _program_options()(arch="sm_90"), "fatbin", ())
    assert isinstance(plan, Bypass) and plan.reason == "recipe.target_type"


# ----------------------------------------------------------------------------- CuPy
# NVRTC option strings as CuPy users write them: (options, "recipe" | bypass reason).
CUPY_OPTIONS: list[tuple[tuple[str, ...], str]] = [
    (("-std=c++17",), "recipe"),
    (("--std=c++14",), "recipe"),
    (("-D", "N=4"), "recipe"),
    (("-DFLAG",), "recipe"),
    (("-UX",), "recipe"),
    (("-rdc=true",), "recipe"),
    (("-G",), "recipe"),
    (("-lineinfo",), "recipe"),
    (("-dopt=on",), "recipe"),
    (("-maxrregcount=32",), "recipe"),
    (("-ftz=false",), "recipe"),
    (("-prec-div=false", "-prec-sqrt=false", "-fmad=false"), "recipe"),
    (("--use_fast_math",), "recipe"),
    (("-extra-device-vectorization",), "recipe"),
    (("-restrict",), "recipe"),
    (("-device-int128",), "recipe"),
    (("-w",), "recipe"),
    (("-Werror=all-warnings",), "recipe"),
    (("-diag-suppress=177,550",), "recipe"),
    (("--split-compile=2",), "recipe"),
    (("-minimal",), "recipe"),
    (("--Ofast-compile=mid",), "recipe"),
    (("--no-cache",), "recipe"),
    (("-arch=sm_80",), "recipe"),
    (("--use-bundled-headers=/x",), "recipe"),
    (("-Xptxas", "-v"), "option=-Xptxas"),
    (("--time=t.csv",), "option=--time"),
    (("--fdevice-time-trace=t.json",), "option=--fdevice-time-trace"),
    (("-pch",), "option=-pch"),
    (("--create-pch=a.pch",), "option=--create-pch"),
    (("-include", "a.h"), "option=-include"),
    (("--brief-diagnostics=true",), "option=--brief-diagnostics"),
    (("--frandom-seed=3",), "option=--frandom-seed"),
    (("-opt-info=inline",), "option=-opt-info"),
    (("--device-float128",), "option=--device-float128"),
    (("-dlto",), "recipe.options"),  # LTO-IR, which a RawModule cannot load
    (("-O3",), "option=-O3"),  # not NVRTC's: CuPy's compile fails, with CuPy's error
    (("--no-such-option",), "option=--no-such-option"),
]


@pytest.mark.parametrize(
    ("options", "expected"), CUPY_OPTIONS, ids=[" ".join(o) for o, _ in CUPY_OPTIONS]
)
def test_every_cupy_option_is_a_recipe_or_a_named_bypass(
    options: tuple[str, ...], expected: str
) -> None:
    plan = cupy_plan(PLAIN, options, None)
    if expected == "recipe":
        assert isinstance(plan, Recipe), (options, plan)
        assert _nvrtc_accepts([f for f in plan.flags])[0], plan.flags
    else:
        assert isinstance(plan, Bypass), (options, plan)
        assert (plan.library, plan.reason) == ("cupy", expected)


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"backend": "nvcc"}, "backend=nvcc"),
        ({"jitify": True}, "jitify"),
        ({"enable_cooperative_groups": True}, "enable_cooperative_groups"),
    ],
)
def test_cupy_arguments_kcache_cannot_key_bypass(kwargs: dict[str, Any], reason: str) -> None:
    plan = cupy_plan(PLAIN, (), None, **kwargs)
    assert isinstance(plan, Bypass) and plan.reason == reason
    assert cupy_plan(PLAIN, ("-DCUPY_USE_JITIFY",), None) == Bypass(
        "cupy", "jitify", "-DCUPY_USE_JITIFY turns on jitify"
    )


def test_kcache_s_own_arguments_are_refused_on_a_bypass_the_library_cannot_honour() -> None:
    with pytest.raises(RecipeError, match=r"headers: .*cupy compiles this itself \(backend=nvcc"):
        cupy_plan(PLAIN, (), None, backend="nvcc", headers={"a.h": ""})
    with pytest.raises(RecipeError, match="target"):
        cupy_plan(PLAIN, ("--time=t",), None, target="sm_90")
    with pytest.raises(RecipeError, match="include_sets"):
        cuda_core_plan(
            PLAIN, _program_options()(arch="sm_90", pch=True), "cubin", (), include_sets=["x"]
        )


def test_translate_cucomplex_is_cupy_s_rewrite_and_keys_what_nvrtc_sees() -> None:
    source = "#include <cuComplex.h>\n  #  include < cuComplex.h >\n__global__ void k() {}\n"
    rewritten = translate_cucomplex(source, ("cupy/complex.cuh", "cupy/carray.cuh"))
    bridge = "#include <cupy/cuComplex_bridge.h>  // translate_cucomplex\n"
    assert rewritten == (
        "#include <cupy/complex.cuh>\n#include <cupy/carray.cuh>\n"
        + bridge
        + bridge
        + "__global__ void k() {}\n"
    )
    assert uses_cupy_headers(rewritten) and not uses_cupy_headers(PLAIN)
    # Without CuPy's include set registered, such a source is CuPy's own to compile ...
    plan = cupy_plan(source, (), None, translate_cucomplex_=True)
    assert isinstance(plan, Bypass) and plan.reason == "cupy-headers"


def test_cupy_s_include_directory_is_an_include_set_named_by_version_and_content(
    tmp_path: Path,
) -> None:
    include = tmp_path / "include"
    (include / "cupy" / "_cccl").mkdir(parents=True)
    (include / "cupy" / "complex.cuh").write_text("#pragma once\n#define CUPY_COMPLEX 1\n")
    (include / "cupy" / "_cccl" / "big.h").write_text("x")
    name = include_set_name(include, "14.2.0")
    assert name.startswith("cupy-14_2_0-") and len(name) == len("cupy-14_2_0-") + 12
    assert include_set_name(include, "14.2.1") != name  # another release, another set
    (include / "cupy" / "_cccl" / "big.h").write_text("y")  # the bundled trees are the release's
    assert include_set_name(include, "14.2.0") == name
    (include / "cupy" / "complex.cuh").write_text("#pragma once\n#define CUPY_COMPLEX 2\n")
    assert include_set_name(include, "14.2.0") != name  # CuPy's own headers are its content
    # ... and with it registered, <cupy/...> compiles through kcache, with the real NVRTC.
    name = include_set_name(include, "14.2.0")
    source = (
        "#include <cupy/complex.cuh>\n"
        + 'extern "C" __global__ void k(int* x) { *x = CUPY_COMPLEX; }\n'
    )
    plan = cupy_plan(
        source, (), None, registered_include_sets={name: include}, cupy_include_set=name
    )
    assert isinstance(plan, Recipe) and plan.include_sets == (name,)
    with KernelCache(
        settings=ClientSettings.from_env(cache_dir=tmp_path / "tier", include_sets={name: include})
    ) as kc:
        assert kc.get(plan.with_defaults(target="sm_90")).kind == "cubin"


# ----------------------------------------------------------------------------- bypass
def test_a_bypass_warns_once_per_reason_and_is_an_error_when_asked(
    cache: KernelCache, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_bypass, "_warned", set())
    first = Bypass("cupy", "backend=nvcc", "kcache compiles with NVRTC only")
    with pytest.warns(BypassWarning, match=r"cupy compiles this itself, uncached \(backend=nvcc\)"):
        _bypass.check(first, cache)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _bypass.check(first, cache)  # the same reason again: silent
    with pytest.warns(BypassWarning, match="jitify"):
        _bypass.check(Bypass("cupy", "jitify", "rewrites"), cache)
    monkeypatch.setenv("KCACHE_BYPASS", "error")
    with KernelCache(cache_dir=tmp_path / "strict") as strict:
        assert strict.settings.bypass == "error"
        with pytest.raises(BypassRefusedError) as refused:
            _bypass.check(first, strict)
    assert isinstance(refused.value, RecipeError)  # handlers of refused recipes catch it
    assert (refused.value.library, refused.value.reason) == ("cupy", "backend=nvcc")
    monkeypatch.setenv("KCACHE_BYPASS", "sometimes")
    with pytest.raises(Exception, match="give allow"):
        ClientSettings.from_env()


def test_a_bypassed_compile_reaches_the_server_as_a_bypass_event(
    proxy: Proxy, kserver: KcacheServer, tmp_path: Path
) -> None:
    from kcache_client.cuda_core import Program

    job = "job-bypass-event"
    settings = ClientSettings.from_env(job_id=job, auto_target="sm_90")
    options = _program_options()(arch="sm_90", frandom_seed="3")
    with KernelCache(proxy.url, cache_dir=tmp_path, settings=settings) as kc:
        with pytest.warns(BypassWarning):
            program = Program(PLAIN, "c++", options, cache=kc)
            compiled = program.compile("cubin")  # cuda.core's own NVRTC compile
        assert type(compiled).__name__ == "ObjectCode"
    posted = [e for s in proxy.seen if s.path == "/v1/events" for e in s.json()["events"]]
    (event,) = [e for e in posted if e["outcome"] == "bypass"]
    assert event["tier"] == "library" and event["reason"] == "ProgramOptions.frandom_seed"
    assert event["toolchain"] == "cuda.core" and event["job_id"] == job
    ClientEvent.model_validate(event)  # the server's schema takes it as it is
    stats = httpx.get(f"{kserver.url}/v1/stats", params={"job_id": job}, timeout=30).json()
    assert stats["reported"]["bypass"] == 1 and stats["by_tier"]["library"]["bypass"] == 1


# ----------------------------------------------------------------------------- library API
def test_cuda_core_program_speaks_cuda_core(cache: KernelCache) -> None:
    core = pytest.importorskip("cuda.core")
    from kcache_client.cuda_core import Program

    program = Program(PLAIN, "c++", {"name": "inc.cu", "arch": "sm_90"}, cache=cache)
    assert isinstance(program.options, core.ProgramOptions) and program.options.name == "inc.cu"
    assert program.pch_status is None and program.backend == "NVRTC"
    assert int(program.handle) != 0  # an NVRTC program of the same code and options
    bad = Program("__global__ void k() { nope }", "c++", {"arch": "sm_90"}, cache=cache)
    from cuda.core._utils.cuda_utils import NVRTCError

    with pytest.raises(NVRTCError, match="NVRTC_ERROR_COMPILATION") as caught:
        bad.compile("cubin")
    assert isinstance(caught.value.__cause__, CompileError)
    assert "nope" in str(caught.value)
    program.close()
    assert program.is_closed


def test_ptx_input_is_cuda_core_s_and_refused_under_kcache_bypass_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kcache_client.cuda_core import Program

    monkeypatch.setenv("KCACHE_BYPASS", "error")
    with KernelCache(cache_dir=tmp_path) as kc:
        with pytest.raises(BypassRefusedError, match=r"code_type=ptx"):
            Program(".version 8.0\n.target sm_90\n", "ptx", cache=kc)
        with pytest.raises(BypassRefusedError, match=r"ProgramOptions.pch"):
            Program(PLAIN, "c++", _program_options()(arch="sm_90", pch=True), cache=kc).compile(
                "cubin"
            )


def test_a_raw_module_pickles_by_its_recipe_and_reloads_from_the_cache(
    cache: KernelCache,
) -> None:
    from kcache_client.cupy import RawKernel, RawModule

    module = RawModule(code=PLAIN, options=("-std=c++17",), name_expressions=("inc",), cache=cache)
    again = pickle.loads(pickle.dumps(module))
    assert again.recipe == module.recipe and again.bypass is None
    assert again.options == ("-std=c++17",) and again.name_expressions == ("inc",)
    kernel = pickle.loads(pickle.dumps(RawKernel(PLAIN, "inc", cache=cache)))
    assert kernel.recipe is not None and kernel.name == "inc"
    assert kernel.recipe == RawKernel(PLAIN, "inc").recipe
    # The other side finds what this side compiled: one compile, then a hit.
    assert module.recipe is not None and again.recipe is not None
    compiled = cache.get(module.recipe.with_defaults(target="sm_90"))
    found = cache.get(again.recipe.with_defaults(target="sm_90"))
    assert found.digest == compiled.digest and found.origin == "memory"
