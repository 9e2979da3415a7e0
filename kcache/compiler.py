"""Compiling a recipe with NVRTC, and linking with nvJitLink.

This is the only module that talks to NVRTC and nvJitLink. Vendor errors are
translated here into :class:`CompileError` carrying the full log.
"""

from __future__ import annotations

import re
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from kcache.artifact import CompileOutput
from kcache.deps import dependencies_from_trace
from kcache.elf import validate_cubin
from kcache.errors import CompileError, RecipeError, ToolchainError
from kcache.include_sets import IncludeSets
from kcache.recipe import Recipe
from kcache.toolchain import Toolchain

__all__ = ["compile_recipe", "kernel_name"]

_GLOBAL_RE = re.compile(r"__global__\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?void\s+(\w+)")


def kernel_name(recipe: Recipe) -> str:
    """A human name for audit tables: the first name expression, else the first __global__."""
    if recipe.name_expressions:
        return recipe.name_expressions[0]
    match = _GLOBAL_RE.search(recipe.source)
    return match.group(1) if match else recipe.name


def _ok(result: tuple[object, ...]) -> bool:
    from cuda.bindings import nvrtc

    return bool(result[0] == nvrtc.nvrtcResult.NVRTC_SUCCESS)


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
    """
    from cuda.bindings import nvrtc

    if recipe.toolchain != toolchain.id:
        raise RecipeError(
            "toolchain",
            f"{recipe.toolchain!r} is not available here; this side has {toolchain.id!r}",
        )
    target = recipe.parsed_target
    if not toolchain.supports(target.sm):
        supported = ", ".join(f"sm_{sm}" for sm in toolchain.supported_sms)
        raise RecipeError(
            "target",
            f"{target.text} is not supported by NVRTC {toolchain.nvrtc_version} ({supported})",
        )
    set_dirs = [
        include_sets.get(name, f"include_sets[{i}]") for i, name in enumerate(recipe.include_sets)
    ]
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
            # NVRTC appends ".json". Never a PCH option: automatic PCH ignores header edits.
            f"--fdevice-time-trace={trace_base}",
        ]
        names = list(recipe.headers)
        err, prog = nvrtc.nvrtcCreateProgram(
            recipe.source.encode(),
            recipe.name.encode(),
            len(names),
            [recipe.headers[n].encode() for n in names],
            [n.encode() for n in names],
        )
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise ToolchainError(f"nvrtcCreateProgram failed: {err!r}")
        try:
            for expr in recipe.name_expressions:
                if not _ok(nvrtc.nvrtcAddNameExpression(prog, expr.encode())):
                    raise RecipeError(
                        "name_expressions", f"NVRTC refused the name expression {expr!r}"
                    )
            result = nvrtc.nvrtcCompileProgram(prog, len(options), [o.encode() for o in options])
            log = _program_log(prog)
            if not _ok(result):
                raise CompileError(None, log or f"NVRTC failed with {result[0]!r} and no log")
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
        deps, exact = dependencies_from_trace(
            trace_base.with_suffix(".json"),
            dict(recipe.headers),
            recipe.include_sets,
            include_sets,
            toolchain.include_dir,
        )
    if recipe.lto:
        data, link_log = _link(recipe, data, link_inputs)
        log = "\n".join(part for part in (log, link_log) if part.strip())
    kind = recipe.produces
    if kind == "cubin":
        validate_cubin(data, target)
    return CompileOutput(
        data=data,
        kind=kind,
        target=target.text,
        toolchain=toolchain.id,
        log=log,
        lowered_names=lowered,
        dependencies=deps,
        dependencies_exact=exact,
        compile_seconds=time.perf_counter() - started,
    )
