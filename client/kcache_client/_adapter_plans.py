"""What a CuPy or cuda.core compile becomes through kcache: a recipe, or a bypass with its reason.

Every argument and option of ``cupy.RawModule``/``RawKernel`` and of cuda.core's
``Program``/``ProgramOptions`` lands in one of three places:

- **a recipe**: the option's NVRTC meaning is known and kcache keys it
  (:mod:`kcache.options` maps each spelling to one canonical flag); options that
  change no output byte (``--no-cache``, ``--use-bundled-headers``) are dropped;
  CuPy's own source transformations (``translate_cucomplex``) are applied first, as
  CuPy applies them, and ``#include <cupy/...>`` is served by CuPy's include
  directory as an include set (:mod:`kcache_client._cupy_headers`);
- **a bypass** (:class:`~kcache_client._bypass.Bypass`): kcache cannot key it safely
  (another compiler, a rewrite from files on this machine, a PCH or trace file, PTX
  input, an option the recipe does not carry), so the library compiles it, uncached;
- **a refusal**: kcache's own arguments (``headers``, ``include_sets``, a fixed
  ``target``) given with a compile that must bypass: the library cannot honour them.

``docs/adapters.md`` lists each one with its reason.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

from kcache.errors import RecipeError
from kcache.recipe import Recipe
from kcache_client._bypass import Bypass

__all__ = [
    "CUPY_PREPENDED_HEADERS",
    "cuda_core_plan",
    "cupy_plan",
    "refuse_extras",
    "translate_cucomplex",
    "uses_cupy_headers",
]

#: What CuPy prepends (``#include`` each) to a source compiled with ``translate_cucomplex``
#: (CuPy's ``cupy_header_list``; read from CuPy itself where it is importable).
CUPY_PREPENDED_HEADERS = (
    "cupy/complex.cuh",
    "cupy/carray.cuh",
    "cupy/atomics.cuh",
    "cupy/math_constants.h",
)
# CuPy's own pattern (cupy/_core/core.pyx): "#include <cuComplex.h>" with any spacing.
#: A whole source line (its end of line included) that includes cuComplex.h.
_CUCOMPLEX_INCLUDE = re.compile(r"\s*#\s*include\s*<\s*cuComplex\.h\s*>[^\n]*\n?")
_CUPY_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*[<"]cupy/', re.MULTILINE)
_OPTION_AT = re.compile(r"options\[(\d+)\]")
_FIELD_IN = re.compile(r"\(ProgramOptions\.(\w+)\)")


def translate_cucomplex(source: str, prepended: Sequence[str] = CUPY_PREPENDED_HEADERS) -> str:
    """``source`` as CuPy compiles it with ``translate_cucomplex=True``, byte for byte.

    CuPy replaces each ``#include <cuComplex.h>`` line with its bridge header and
    prepends its own headers (``prepend_cupy_headers``), so the recipe keys what NVRTC sees.
    """
    lines = []
    for line in source.splitlines(keepends=True):
        if _CUCOMPLEX_INCLUDE.fullmatch(line):
            lines.append("#include <cupy/cuComplex_bridge.h>  // translate_cucomplex\n")
        else:
            lines.append(line)
    return "".join(f"#include <{h}>\n" for h in prepended) + "".join(lines)


def uses_cupy_headers(source: str) -> bool:
    """Whether ``source`` includes a CuPy header (``#include <cupy/...>``) itself."""
    return _CUPY_INCLUDE.search(source) is not None


def _reason(library: str, exc: RecipeError, options: Sequence[str]) -> Bypass:
    """The bypass of a recipe kcache refused: named by the option (or field) it refused."""
    field = _FIELD_IN.search(exc.detail)
    at = _OPTION_AT.fullmatch(exc.field)
    if field is not None:
        reason = f"ProgramOptions.{field.group(1)}"
    elif exc.field.startswith("options."):
        reason = "ProgramOptions." + exc.field.removeprefix("options.")
    elif at is not None and int(at.group(1)) < len(options):
        option = str(options[int(at.group(1))])
        reason = "option=" + (option.partition("=")[0] if option.startswith("-") else option)
    else:
        reason = f"recipe.{exc.field}"
    return Bypass(library, reason, exc.detail)


def refuse_extras(
    bypass: Bypass,
    *,
    headers: Mapping[str, str] | None,
    include_sets: Sequence[str],
    target: str = "auto",
) -> None:
    """Refuse kcache's own arguments on a compile that goes to the library: it takes none of them."""
    given = [
        name
        for name, value in (
            ("headers", headers),
            ("include_sets", include_sets),
            ("target", None if target == "auto" else target),
        )
        if value
    ]
    if given:
        raise RecipeError(
            given[0],
            f"is kcache's argument, but {bypass.library} compiles this itself ({bypass.reason}: "
            f"{bypass.detail}), and {bypass.library} takes no {', '.join(given)}; drop "
            f"{'it' if len(given) == 1 else 'them'}, or change what makes it bypass",
        )


def cupy_plan(
    code: str,
    options: Sequence[str],
    name_expressions: Sequence[str] | None,
    *,
    backend: str = "nvrtc",
    translate_cucomplex_: bool = False,
    enable_cooperative_groups: bool = False,
    jitify: bool | None = False,
    target: str = "auto",
    headers: Mapping[str, str] | None = None,
    include_sets: Sequence[str] = (),
    registered_include_sets: Mapping[str, str | os.PathLike[str]] | None = None,
    cupy_include_set: str | None = None,
    prepended: Sequence[str] = CUPY_PREPENDED_HEADERS,
) -> Recipe | Bypass:
    """The recipe of a ``cupy.RawModule(code=...)`` compile, or why CuPy compiles it itself.

    ``cupy_include_set`` is the name CuPy's include directory is registered under in
    the cache (None: not registered; a source that includes CuPy headers then bypasses).
    """
    registered = dict(registered_include_sets or {})
    bypass: Bypass | None = None
    if backend != "nvrtc":
        bypass = Bypass(
            "cupy",
            f"backend={backend}",
            "kcache compiles with NVRTC only, and nvcc reads and writes files on this machine",
        )
    elif jitify:
        bypass = Bypass(
            "cupy", "jitify", "jitify rewrites the source with headers it finds on this machine"
        )
    elif enable_cooperative_groups:
        bypass = Bypass(
            "cupy",
            "enable_cooperative_groups",
            "CuPy links the kernel with the toolkit's libcudadevrt, which recipes do not carry",
        )
    elif isinstance(options, str):
        bypass = Bypass("cupy", "options", "options is one string, not a tuple of strings")
    elif any(str(o).startswith("-DCUPY_USE_JITIFY") for o in options):
        bypass = Bypass("cupy", "jitify", "-DCUPY_USE_JITIFY turns on jitify")
    if bypass is not None:
        refuse_extras(bypass, headers=headers, include_sets=include_sets, target=target)
        return bypass
    source = translate_cucomplex(code, prepended) if translate_cucomplex_ else code
    sets = list(include_sets)
    if uses_cupy_headers(source):
        if cupy_include_set is None or cupy_include_set not in registered:
            bypass = Bypass(
                "cupy",
                "cupy-headers",
                "the source includes CuPy's headers and this KernelCache has no include set for "
                "CuPy's include directory (kcache_client.cupy.cupy_include_set())",
            )
            refuse_extras(bypass, headers=headers, include_sets=include_sets, target=target)
            return bypass
        sets.append(cupy_include_set)
    try:
        return Recipe.from_cupy(
            source,
            tuple(options),
            name_expressions,
            target=target,
            headers=headers,
            include_sets=tuple(dict.fromkeys(sets)),
            registered_include_sets=registered,
        )
    except RecipeError as exc:
        bypass = _reason("cupy", exc, tuple(options))
        refuse_extras(bypass, headers=headers, include_sets=include_sets, target=target)
        return bypass


def cuda_core_plan(
    code: str,
    options: Any,
    target_type: str,
    name_expressions: Sequence[str],
    *,
    headers: Mapping[str, str] | None = None,
    include_sets: Sequence[str] = (),
    registered_include_sets: Mapping[str, str | os.PathLike[str]] | None = None,
) -> Recipe | Bypass:
    """The recipe of ``Program(code, "c++", options).compile(target_type, ...)``, or its bypass.

    ``options`` is a ``ProgramOptions``, a list of NVRTC options or None. Whatever
    kcache refuses (a PCH or trace option, ``target_type`` it does not make, an
    option the recipe does not carry) is cuda.core's, which raises its own errors.
    """
    strings: Sequence[str] = ()
    if isinstance(options, Sequence) and not isinstance(options, str):
        strings = tuple(str(o) for o in options)
    else:
        try:
            from kcache.options import cuda_core_option_strings

            strings = tuple(cuda_core_option_strings(options)[2]) if options is not None else ()
        except RecipeError:
            pass  # Recipe.from_cuda_core below says it again, with its reason
    try:
        return Recipe.from_cuda_core(
            code,
            options,
            target_type,
            tuple(name_expressions),
            headers=headers,
            include_sets=include_sets,
            registered_include_sets=registered_include_sets,
        )
    except RecipeError as exc:
        bypass = _reason("cuda.core", exc, strings)
        refuse_extras(bypass, headers=headers, include_sets=include_sets)
        return bypass
