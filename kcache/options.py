"""Recipes from the options CuPy and cuda.core take: NVRTC option lists and ``ProgramOptions``.

People JIT-compile through ``cupy.RawModule(code=..., options=(...))`` and
``cuda.core.Program(code, "c++", ProgramOptions(...))``. Both end in an NVRTC option
list, so one translator reads every NVRTC option, in every spelling NVRTC accepts
(``-std=c++17`` and ``--std=c++17``, ``-DN=4``, ``-D N=4`` and ``--define-macro=N=4``,
``-arch=sm_90``, ``-arch sm_90`` and ``--gpu-architecture=sm_90``, ...), and gives
each one a recipe field with the same meaning, or refuses it with a sentence naming
the option and why:

* ``-arch`` / ``--gpu-architecture`` -> ``target`` (``compute_XX`` gives PTX);
* ``-dlto`` / ``--dlink-time-opt`` -> ``output="ltoir"`` (only where LTO-IR is asked for);
* ``-I`` / ``--include-path`` -> a registered include set whose root is that
  directory, else the directory's headers as in-memory ``headers`` (a small
  directory only: :data:`INCLUDE_DIR_MAX_FILES` files, :data:`INCLUDE_DIR_MAX_BYTES`
  bytes; past that the error says to register an include set);
* ``--use-bundled-headers`` is dropped: kcache compiles always use the bundled headers;
* every other accepted option becomes a flag in one canonical spelling.

Canonical flags make equivalent spellings one recipe key: macros (``-D``/``-U``) keep
their order, which decides their meaning; every other option is a setting where the
last one given wins (as in NVRTC, which warns "X followed by Y"), and settings are
written once each in a fixed order. An explicit ``-ftz``, ``-prec-div``, ``-prec-sqrt``
or ``-fmad`` overrides ``--use_fast_math`` wherever it stands (NVRTC's rule, checked
byte for byte), so that order is no meaning either. ``-diag-suppress=1,2`` becomes
one flag per number.

CuPy adds options of its own to every ``RawModule``/``RawKernel`` compile:
``-ftz=true`` and ``--device-as-default-execution-space`` after the user's (so a
user's ``-ftz=false`` loses), plus ``-arch`` for the current device, which
:func:`cupy_recipe_fields` leaves to ``target``. cuda.core adds none.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from kcache.errors import RecipeError
from kcache.targets import parse_target

__all__ = [
    "ALLOWED_FLAGS",
    "CONTROL_CHARACTERS",
    "CUPY_IMPLICIT_FLAGS",
    "INCLUDE_DIR_MAX_BYTES",
    "INCLUDE_DIR_MAX_FILES",
    "INCLUDE_NAME_REGEX",
    "TranslatedOptions",
    "cuda_core_option_strings",
    "cuda_core_recipe_fields",
    "cupy_recipe_fields",
    "recipe_flag_refusal",
    "translate_nvrtc_options",
]

#: What CuPy appends to every RawModule/RawKernel compile's options (besides ``-arch``).
CUPY_IMPLICIT_FLAGS = ("-ftz=true", "--device-as-default-execution-space")
#: An ``-I`` directory read into in-memory headers holds at most this many header files ...
INCLUDE_DIR_MAX_FILES = 128
#: ... of at most this many bytes together (over all ``-I`` directories of one recipe).
INCLUDE_DIR_MAX_BYTES = 2 << 20
#: Files an ``-I`` directory contributes: header suffixes, or none (``<cuda/std/atomic>`` style).
_HEADER_SUFFIXES = frozenset(
    {"", ".h", ".hh", ".hpp", ".hxx", ".h++", ".cuh", ".inl", ".inc", ".ipp", ".tcc", ".tpp"}
)

# Refusal reasons, each a sentence that says why and what to do instead.
_WRITES_FILES = (
    "it writes a file on the compiling machine; a kcache compile reads its inputs and writes "
    "nothing else (remove it)"
)
_PCH = (
    "precompiled headers are files on the compiling machine, and NVRTC's automatic PCH does not "
    "notice header edits (it could serve a stale kernel); kcache never compiles with PCH "
    "(remove it)"
)
_NOT_CARRIED = (
    "kcache recipes do not carry this option (it is not in the recipe's allow-list of NVRTC "
    "options); remove it, or compile this kernel without kcache"
)

#: What a single line of recipe text (a flag, a name expression) never holds: the C0
#: and C1 control characters, as the inside of a regex class that Python's ``re`` and
#: ECMA-262 read alike (:mod:`kcache.recipe` checks lines with it, the server's
#: published patterns use it too).
CONTROL_CHARACTERS = "\\x00-\\x1f\\x7f-\\x9f"
# A character of a flag in a recipe, and one that is not a space either (Python's ASCII
# "\S" and "." within a line, written so that ECMA-262 reads them alike).
_CHAR = f"[^{CONTROL_CHARACTERS}]"
_NON_SPACE = f"[^{CONTROL_CHARACTERS} ]"
# A macro as -D defines it (NAME, NAME=value, NAME(args)=value) and as -U names it: what
# NVRTC takes, so "-D=3" or "-D1X" is refused by name rather than failing the compile.
_MACRO_NAME = "[A-Za-z_][A-Za-z0-9_]*"
_MACRO = rf"{_MACRO_NAME}(?:\([A-Za-z0-9_, .]*\))?(?:={_CHAR}*)?"
# An include name's characters: its first is not "." (nor "/"); a later part's may be.
_NAME_FIRST = "[A-Za-z0-9_+\\-]"
_NAME_CHAR = "[A-Za-z0-9_.+\\-]"
# A later part: never empty, "." or "..".
_NAME_PART = f"(?:{_NAME_FIRST}{_NAME_CHAR}*|\\.{_NAME_FIRST}{_NAME_CHAR}*|\\.\\.{_NAME_CHAR}+)"
#: An include name (and a program ``name``), every rule of
#: :func:`kcache.recipe.check_include_name` but its length: relative, safe characters,
#: no empty, ``.`` or ``..`` part. In the regex syntax Python's ``re`` and ECMA-262 read
#: alike, unanchored (the server publishes it as a JSON Schema pattern, ``^(?:...)$``).
#: Here, beside the flags, as ``-I`` directories are read by it (kcache.recipe imports it).
INCLUDE_NAME_REGEX = f"{_NAME_FIRST}{_NAME_CHAR}*(?:/{_NAME_PART})*"
_INCLUDE_NAME_RE = re.compile(INCLUDE_NAME_REGEX)

_Kind = Literal["setting", "bool", "macro", "undef", "include", "arch", "lto", "drop", "refuse"]


@dataclass(frozen=True)
class _Spec:
    """One NVRTC option: its spellings, whether it takes a value, and what kcache makes of it."""

    long: str  # "--ftz": also the key of the setting it sets
    short: str | None  # "-ftz"
    kind: _Kind
    value: str | None = None  # a full-match pattern of the accepted values; None: takes no value
    canonical: str | None = None  # how the recipe spells it: "-ftz" (+ "=value")
    field: str | None = None  # the cuda.core ProgramOptions field that emits it
    reason: str = ""  # for "refuse" and "drop"
    setting: str | None = None  # the setting it writes when it shares one (-dc, -dw -> rdc)
    fixed: str | None = None  # the value a valueless alias sets (-dc -> "true")
    # How a recipe's flags may write it, full-match patterns (see _recipe_forms); None:
    # its spellings with its value, where it is a setting of its own.
    recipe: tuple[str, ...] | None = None


_BOOL = r"true|false"
_SPECS: tuple[_Spec, ...] = (
    _Spec("--gpu-architecture", "-arch", "arch", r"\S+", field="arch"),
    _Spec("--std", "-std", "setting", r"c\+\+(?:03|11|14|17|20)", "-std", "std"),
    _Spec(
        "--define-macro",
        "-D",
        "macro",
        r".+",
        field="define_macro",
        recipe=(f"-D{_MACRO}", f"--define-macro={_MACRO}"),
    ),
    _Spec(
        "--undefine-macro",
        "-U",
        "undef",
        r".+",
        field="undefine_macro",
        recipe=(f"-U{_MACRO_NAME}", f"--undefine-macro={_MACRO_NAME}"),
    ),
    _Spec("--include-path", "-I", "include", r".+", field="include_path"),
    _Spec("--relocatable-device-code", "-rdc", "setting", _BOOL, "-rdc", "relocatable_device_code"),
    _Spec("--device-c", "-dc", "setting", None, setting="--relocatable-device-code", fixed="true"),
    _Spec("--device-w", "-dw", "setting", None, setting="--relocatable-device-code", fixed="false"),
    _Spec("--extensible-whole-program", "-ewp", "bool", None, "-ewp", "extensible_whole_program"),
    _Spec("--device-debug", "-G", "bool", None, "-G", "debug"),
    _Spec("--generate-line-info", "-lineinfo", "bool", None, "-lineinfo", "lineinfo"),
    _Spec("--dopt", "-dopt", "setting", r"on|off", "-dopt", "device_code_optimize"),
    _Spec("--maxrregcount", "-maxrregcount", "setting", r"[0-9]{1,3}", "-maxrregcount"),
    _Spec("--ftz", "-ftz", "setting", _BOOL, "-ftz", "ftz"),
    _Spec("--prec-sqrt", "-prec-sqrt", "setting", _BOOL, "-prec-sqrt", "prec_sqrt"),
    _Spec("--prec-div", "-prec-div", "setting", _BOOL, "-prec-div", "prec_div"),
    _Spec("--fmad", "-fmad", "setting", _BOOL, "-fmad", "fma"),
    _Spec("--use_fast_math", "-use_fast_math", "bool", None, "--use_fast_math", "use_fast_math"),
    _Spec(
        "--extra-device-vectorization",
        "-extra-device-vectorization",
        "bool",
        None,
        "-extra-device-vectorization",
        "extra_device_vectorization",
    ),
    _Spec(
        "--device-as-default-execution-space",
        "-default-device",
        "bool",
        None,
        "-default-device",
        "device_as_default_execution_space",
    ),
    _Spec("--restrict", "-restrict", "bool", None, "-restrict", "restrict"),
    _Spec("--device-int128", "-device-int128", "bool", None, "-device-int128", "device_int128"),
    _Spec(
        "--builtin-move-forward",
        "-builtin-move-forward",
        "setting",
        _BOOL,
        "-builtin-move-forward",
        "builtin_move_forward",
    ),
    _Spec(
        "--builtin-initializer-list",
        "-builtin-initializer-list",
        "setting",
        _BOOL,
        "-builtin-initializer-list",
        "builtin_initializer_list",
    ),
    _Spec("--disable-warnings", "-w", "bool", None, "-w", "disable_warnings"),
    _Spec("-Werror", None, "setting", r"all-warnings", "-Werror"),
    _Spec(
        "--display-error-number",
        "-err-no",
        "setting",
        None,
        setting="--display-error-number",
        fixed="yes",
        recipe=("--display-error-number", "-display-error-number"),
    ),
    _Spec(
        "--no-display-error-number",
        "-no-err-no",
        "setting",
        None,
        setting="--display-error-number",
        fixed="no",
        field="no_display_error_number",
        recipe=("--no-display-error-number", "-no-display-error-number"),
    ),
    *(
        _Spec(
            f"--diag-{kind}",
            f"-diag-{kind}",
            "setting",
            r"[0-9]+(?:,[0-9]+)*",
            field=f"diag_{kind}",
            recipe=(f"--diag-{kind}=[0-9,]+", f"-diag-{kind}=[0-9,]+"),  # and "1,,2", as ever
        )
        for kind in ("error", "suppress", "warn")
    ),
    _Spec(
        "--split-compile",
        "-split-compile",
        "setting",
        r"[0-9]{1,2}",
        "-split-compile",
        "split_compile",
    ),
    _Spec(
        "--fdevice-syntax-only",
        "-fdevice-syntax-only",
        "bool",
        None,
        "-fdevice-syntax-only",
        "fdevice_syntax_only",
    ),
    _Spec("--minimal", "-minimal", "bool", None, "-minimal", "minimal"),
    _Spec(
        "--Ofast-compile",
        "-Ofast-compile",
        "setting",
        r"0|min|mid|max",
        "--Ofast-compile",  # NVRTC 13 takes only the double-dash spelling of this one
        "ofast_compile",
    ),
    _Spec("--modify-stack-limit", "-modify-stack-limit", "setting", _BOOL, "-modify-stack-limit"),
    _Spec("--dlink-time-opt", "-dlto", "lto", None, field="link_time_optimization"),
    _Spec(
        "--no-source-include",
        "-no-source-include",
        "bool",
        None,
        "-no-source-include",
        "no_source_include",
    ),
    _Spec(
        "--use-bundled-headers",
        None,
        "drop",
        r".*",
        field="use_bundled_headers",
        reason="kcache compiles always use the toolchain's bundled headers",
    ),
    # Refused: they write files, read files kcache cannot account for, or reach no recipe field.
    _Spec("--time", "-time", "refuse", r".*", field="time", reason=_WRITES_FILES),
    _Spec(
        "--fdevice-time-trace",
        "-fdevice-time-trace",
        "refuse",
        r".*",
        field="fdevice_time_trace",
        reason=_WRITES_FILES,
    ),
    _Spec("--pch", "-pch", "refuse", None, field="pch", reason=_PCH),
    _Spec("--create-pch", "-create-pch", "refuse", r".*", field="create_pch", reason=_PCH),
    _Spec("--use-pch", "-use-pch", "refuse", r".*", field="use_pch", reason=_PCH),
    _Spec("--pch-dir", "-pch-dir", "refuse", r".*", field="pch_dir", reason=_PCH),
    _Spec("--pch-verbose", "-pch-verbose", "refuse", r".*", field="pch_verbose", reason=_PCH),
    _Spec("--pch-messages", "-pch-messages", "refuse", r".*", field="pch_messages", reason=_PCH),
    _Spec(
        "--instantiate-templates-in-pch",
        "-instantiate-templates-in-pch",
        "refuse",
        r".*",
        field="instantiate_templates_in_pch",
        reason=_PCH,
    ),
    _Spec(
        "--pre-include",
        "-include",
        "refuse",
        r".+",
        field="pre_include",
        reason='kcache recipes carry no pre-includes; write #include "<header>" at the top of the '
        "source instead (and give the header in `headers`)",
    ),
    _Spec(
        "--ptxas-options",
        "-Xptxas",
        "refuse",
        r".*",
        field="ptxas_options",
        reason="kcache recipes do not carry ptxas options (they are not in the recipe's "
        "allow-list); remove them, or compile this kernel without kcache",
    ),
    _Spec(
        "--gen-opt-lto",
        "-gen-opt-lto",
        "refuse",
        None,
        field="gen_opt_lto",
        reason="kcache's link-time optimization (`lto: true`) runs nvJitLink itself and does not "
        "carry this option; remove it",
    ),
    _Spec(
        "--no-cache",
        "-no-cache",
        "drop",
        None,
        field="no_cache",
        reason="it only turns off the compiler's own in-process cache, which changes no output "
        "byte; kcache caches the result",
    ),
    _Spec(
        "--optimization-info",
        "-opt-info",
        "refuse",
        r".*",
        field="optimization_info",
        reason=_NOT_CARRIED,
    ),
    _Spec(
        "--brief-diagnostics",
        "-brief-diag",
        "refuse",
        r".*",
        field="brief_diagnostics",
        reason=_NOT_CARRIED,
    ),
    _Spec(
        "--device-float128",
        "-device-float128",
        "refuse",
        None,
        field="device_float128",
        reason=_NOT_CARRIED,
    ),
    _Spec(
        "--frandom-seed",
        "-frandom-seed",
        "refuse",
        r".*",
        field="frandom_seed",
        reason=_NOT_CARRIED,
    ),
    _Spec(
        "--numba-debug", "-numba-debug", "refuse", None, field="numba_debug", reason=_NOT_CARRIED
    ),
    _Spec("--jump-table-density", "-jtd", "refuse", r".*", reason=_NOT_CARRIED),
    _Spec(
        "--device-stack-protector", "-device-stack-protector", "refuse", r".*", reason=_NOT_CARRIED
    ),
)


def _recipe_forms(spec: _Spec) -> tuple[str, ...]:
    """The patterns of the flags a recipe may write ``spec`` as (none: a recipe never carries it).

    A setting of its own (``setting`` or ``bool``, no alias's ``fixed`` value) in each of
    its spellings, with its value; the others as their ``recipe`` says. The rest are
    refused, dropped, or a recipe field's (``-arch`` is ``target``, ``-dlto`` ``output``
    or ``lto``, ``-I`` ``headers`` and ``include_sets``), and aliases have one spelling
    in a recipe (``-rdc=true``, not ``-dc``).
    """
    if spec.recipe is not None:
        return spec.recipe
    if spec.kind not in ("setting", "bool") or spec.fixed is not None:
        return ()
    value = "" if spec.value is None else f"=(?:{spec.value})"
    return tuple(f"{name}{value}" for name in (spec.long, spec.short) if name is not None)


#: The NVRTC options a recipe may carry, each matched whole (``fullmatch``): this table's,
#: written as :func:`_recipe_forms` says, in the regex syntax Python's ``re`` and ECMA-262
#: read alike (explicit classes, no ``\\S``, ``\\d`` or ``.``). Everything else is refused: options that read
#: or write files (-I, PCH, traces, output), options that the recipe's own fields own
#: (-arch is `target`, -dlto is `output`/`lto`), and anything unknown.
#: :mod:`kcache.recipe` checks flags with it; the server publishes it as a JSON Schema
#: pattern (``kcache_server.recipe_schema``).
ALLOWED_FLAGS = re.compile(
    "(?:" + "|".join(form for spec in _SPECS for form in _recipe_forms(spec)) + ")", re.ASCII
)
_BY_NAME: dict[str, _Spec] = {}
for _spec in _SPECS:
    _BY_NAME[_spec.long] = _spec
    if _spec.short is not None:
        _BY_NAME[_spec.short] = _spec
# The options whose value may also come as the next list element ("-D N", "-arch sm_90").
_SPLIT_VALUE = frozenset(
    {"-D", "--define-macro", "-U", "--undefine-macro", "-I", "--include-path", "-arch"}
    | {"--gpu-architecture", "-maxrregcount", "--maxrregcount", "-include", "--pre-include"}
    | {"-Xptxas", "--ptxas-options"}
)
# The order settings are written in (macros come right after --std, in their own order).
_SETTING_ORDER = [
    spec.long for spec in _SPECS if spec.kind in ("setting", "bool") and spec.fixed is None
]
_DIAG = ("--diag-error", "--diag-suppress", "--diag-warn")
_MACRO_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\([A-Za-z0-9_, .]*\))?(?:=.*)?", re.ASCII | re.S)
_MACRO_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*", re.ASCII)
_OPT_LEVEL_RE = re.compile(r"-O[0-9]")


@dataclass(frozen=True)
class TranslatedOptions:
    """An NVRTC option list read into recipe terms (see the module docstring)."""

    flags: tuple[str, ...]  # canonical recipe flags
    target: str | None  # from -arch, None when not given
    ltoir: bool  # -dlto / --dlink-time-opt was given
    include_dirs: tuple[tuple[str, str], ...]  # (where it was given, directory), in order


def _refuse(where: str, option: str, detail: str, field: str | None = None) -> RecipeError:
    named = f"{option!r}" if field is None else f"{option!r} (ProgramOptions.{field})"
    return RecipeError(where, f"{named} {detail}")


def translate_nvrtc_options(
    options: Iterable[str], *, where: str = "options", fields: bool = False
) -> TranslatedOptions:
    """Read an NVRTC option list (CuPy's ``options``) into canonical recipe terms.

    ``where`` names the argument in errors (``options[3]``); ``fields`` names cuda.core's
    ``ProgramOptions`` field beside the option. Raises :class:`RecipeError` for an option
    kcache refuses, an unknown one, or a malformed value, saying which and why.
    """
    items = list(options)
    settings: dict[str, str] = {}  # setting -> canonical flag (the last one given wins)
    diags: dict[int, str] = {}  # diagnostic number -> "--diag-error" etc. (last wins)
    macros: list[str] = []
    include_dirs: list[tuple[str, str]] = []
    target: str | None = None
    ltoir = False
    i = 0
    while i < len(items):
        option, at = items[i], f"{where}[{i}]"
        i += 1
        if not isinstance(option, str):
            raise RecipeError(at, f"options are strings, not {type(option).__name__}")
        spec, value = _lookup(option)
        if spec is None:
            if _OPT_LEVEL_RE.fullmatch(option):
                raise _refuse(at, option, "is no NVRTC option; NVRTC's is -dopt=on|off")
            raise _refuse(
                at,
                option,
                "is not an NVRTC option kcache knows; kcache passes only the options it can "
                "account for (see kcache.options)",
            )
        field = spec.field if fields else None
        shown = option
        if value is None and option in _SPLIT_VALUE:
            if i >= len(items) or not isinstance(items[i], str):
                raise _refuse(at, option, "needs a value after it", field)
            value = items[i]
            shown = f"{option} {value}"
            i += 1
        if spec.kind == "refuse":
            raise _refuse(at, shown, f"is refused: {spec.reason}", field)
        if spec.value is None and value is not None:
            raise _refuse(at, shown, f"takes no value ({spec.long})", field)
        if spec.value is not None and value is None:
            raise _refuse(at, shown, f"needs a value: {spec.long}=<value>", field)
        if value is not None and not re.fullmatch(spec.value or "", value, re.ASCII | re.S):
            raise _refuse(
                at, shown, f"has a value {spec.long} does not take: {_accepted(spec)}", field
            )
        if spec.kind == "drop":
            continue
        if spec.kind == "arch":
            assert value is not None
            try:
                target = parse_target(value, at).text
            except RecipeError as exc:
                raise _refuse(at, shown, f"names no target: {exc.detail}", field) from None
        elif spec.kind == "lto":
            ltoir = True
        elif spec.kind == "include":
            assert value is not None
            include_dirs.append((at, value))
        elif spec.kind == "macro":
            assert value is not None
            if not _MACRO_RE.fullmatch(value):
                raise _refuse(
                    at,
                    option,
                    "is not a macro definition (NAME, NAME=value or NAME(args)=value)",
                    field,
                )
            macros.append(f"-D{value}")
        elif spec.kind == "undef":
            assert value is not None
            if not _MACRO_NAME_RE.fullmatch(value):
                raise _refuse(at, option, "does not name a macro", field)
            macros.append(f"-U{value}")
        elif spec.long in _DIAG:
            assert value is not None
            for number in value.split(","):
                diags.pop(int(number), None)  # re-insert: the dict's order is the last given
                diags[int(number)] = spec.long
        elif spec.kind == "bool":
            settings[spec.long] = spec.canonical or spec.long
        elif spec.setting is not None:  # an alias that sets another option's value
            settings[spec.setting] = _setting_flag(spec.setting, spec.fixed)
        else:
            settings[spec.long] = f"{spec.canonical}={value}"
    flags = [settings.pop("--std")] if "--std" in settings else []
    flags += macros
    flags += [settings[name] for name in _SETTING_ORDER if name in settings]
    if "--display-error-number" in settings:
        flags.append(settings["--display-error-number"])
    flags += [f"{_BY_NAME[kind].short}={number}" for number, kind in sorted(diags.items())]
    return TranslatedOptions(tuple(flags), target, ltoir, tuple(include_dirs))


def _accepted(spec: _Spec) -> str:
    """The values ``spec`` takes, said for a person."""
    pattern = spec.value or ""
    if re.fullmatch(r"[A-Za-z0-9\-]+(?:\|[A-Za-z0-9\-]+)+", pattern):
        return "one of " + ", ".join(pattern.split("|"))
    if pattern.startswith("[0-9]"):
        return "numbers separated by commas" if "(?:," in pattern else "a number"
    if spec.long == "--std":
        return "c++03, c++11, c++14, c++17 or c++20"
    return f"a value matching {pattern}"


def _setting_flag(setting: str, fixed: str | None) -> str:
    if setting == "--relocatable-device-code":
        return f"-rdc={fixed}"
    return "--display-error-number" if fixed == "yes" else "--no-display-error-number"


def _lookup(option: str) -> tuple[_Spec | None, str | None]:
    """The spec of ``option`` and its attached value (``-DN=4``, ``--std=c++17``), if any."""
    spec = _BY_NAME.get(option)
    if spec is not None:
        return spec, None
    for prefix in ("-D", "-U", "-I"):  # the only options glued to their value
        if option.startswith(prefix) and not option.startswith("--") and len(option) > 2:
            return _BY_NAME[prefix], option[2:]
    name, sep, value = option.partition("=")
    if sep:
        return _BY_NAME.get(name), value
    return None, None


def recipe_flag_refusal(flag: str) -> str:
    """Why a recipe refuses ``flag`` (one of its ``flags``), and what to write instead.

    The recipe's allow-list (:data:`ALLOWED_FLAGS`) only says yes or no; the reason is
    here, where every NVRTC option is known: a refused option's own reason (it writes
    a file, PCH, ...), the recipe field that owns it (``-arch`` is ``target``), the
    accepted spelling of a known option (``-gpu-architecture`` style aliases,
    ``--use_fast_math``), or the closest known options for one nobody knows.
    """
    import difflib

    if _OPT_LEVEL_RE.fullmatch(flag) or re.fullmatch(r"-O[0-9]+", flag):
        return (
            f"{flag!r} is not an NVRTC option: NVRTC has no -O levels, its optimization "
            "switch is -dopt=on|off"
        )
    try:
        translated = translate_nvrtc_options([flag], where="flag")
    except RecipeError as exc:
        if "is not an NVRTC option kcache knows" not in exc.detail:
            return exc.detail  # a refused option's reason, or a value it does not take
        name = flag.partition("=")[0]
        spellings = sorted(_BY_NAME)
        close = difflib.get_close_matches(name, spellings, n=2, cutoff=0.75)
        if not close:  # "-use-fast-math": the dashes and underscores of NVRTC's names vary
            folded = {s.replace("_", "-").lstrip("-"): s for s in spellings}
            hit = folded.get(name.replace("_", "-").lstrip("-"))
            close = [hit] if hit else []
        # One spelling per option (the closest one), the closest option first.
        close = list({_BY_NAME[c].long: c for c in reversed(close)}.values())[::-1]
        hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        return f"{flag!r} is not an NVRTC option kcache knows{hint}"
    if translated.target is not None:
        return (
            f"{flag!r}: the target comes from the recipe's `target` (--target {translated.target})"
        )
    if translated.ltoir:
        return f"{flag!r}: LTO-IR comes from the recipe's `output` (ltoir) or `lto`, not a flag"
    if translated.include_dirs:
        return (
            f"{flag!r} reads a directory of the compiling machine, which a recipe cannot "
            "account for: give the headers (`headers`, --header NAME=FILE) or a registered "
            "include set (`include_sets`, --include-set NAME=DIR)"
        )
    if not translated.flags:
        return f"{flag!r} is not needed: kcache compiles always use the toolchain's bundled headers"
    spelled = " ".join(translated.flags)
    return f"{flag!r} is written {spelled!r} in a recipe"


# --------------------------------------------------------------------------- -I directories
def _same_dir(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except OSError:
        return False


def _read_include_dirs(
    dirs: Sequence[tuple[str, str]],
    registered: Mapping[str, str | os.PathLike[str]],
) -> tuple[list[str], dict[str, str]]:
    """Registered include sets for the ``-I`` directories that are one, headers for the others."""
    sets: list[str] = []
    headers: dict[str, str] = {}
    files = total = 0
    for at, text in dirs:
        directory = Path(text)
        match = next(
            (name for name, root in registered.items() if _same_dir(directory, Path(root))), None
        )
        if match is not None:
            if match not in sets:
                sets.append(match)
            continue
        if not directory.is_dir():
            raise RecipeError(at, f"-I {text}: not a directory")
        for relative, path in _header_files(directory):
            if relative in headers:
                continue  # an earlier -I directory has it: NVRTC searches them in order
            files += 1
            try:
                size = path.stat().st_size
            except OSError:
                continue
            total += size
            if files > INCLUDE_DIR_MAX_FILES or total > INCLUDE_DIR_MAX_BYTES:
                raise RecipeError(
                    at,
                    f"-I {text}: the -I directories hold more than {INCLUDE_DIR_MAX_FILES} header "
                    f"files or {INCLUDE_DIR_MAX_BYTES} bytes, too many to send as in-memory "
                    "headers; register the directory as an include set (the server's "
                    "`include_sets`, or KernelCache(include_sets={'name': directory}) for "
                    "local compiles) so the -I matches it by path",
                )
            try:
                data = path.read_bytes()
                text_of = data.decode("utf-8")
            except (OSError, UnicodeDecodeError):
                continue  # not a text header: a compile that includes it names it as unlisted
            if "\x00" not in text_of:
                headers[relative] = text_of
    return sets, headers


def _header_files(root: Path) -> Iterable[tuple[str, Path]]:
    """(include name, path) of the header files under ``root``, sorted, hidden parts skipped."""
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):  # no followlinks: no loops
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        base = Path(dirpath)
        for filename in filenames:
            path = base / filename
            if filename.startswith(".") or path.suffix.lower() not in _HEADER_SUFFIXES:
                continue
            relative = path.relative_to(root).as_posix()
            # Only names a recipe takes (the recipe checks them again, and their length,
            # LIMITS.name_chars): others are never inputs.
            if not _INCLUDE_NAME_RE.fullmatch(relative) or len(relative) > 256:
                continue
            if path.is_file():
                found.append((relative, path))
        if len(found) > INCLUDE_DIR_MAX_FILES * 4:
            break  # enough to know it is too many; never walk a whole filesystem
    return sorted(found)


# --------------------------------------------------------------------------- recipes
def _build(
    code: str,
    translated: TranslatedOptions,
    *,
    target: str,
    output: str,
    name: str,
    name_expressions: Sequence[str],
    headers: Mapping[str, str] | None,
    include_sets: Sequence[str],
    registered_include_sets: Mapping[str, str | os.PathLike[str]] | None,
    toolchain: str | None,
) -> dict[str, Any]:
    if translated.target is not None and target not in ("auto", translated.target):
        raise RecipeError(
            "target",
            f"{target!r} disagrees with the options' -arch={translated.target}; give one of them",
        )
    chosen = translated.target or target
    if isinstance(name_expressions, str):
        raise RecipeError("name_expressions", "must be a list of strings, not one string")
    sets, dir_headers = _read_include_dirs(translated.include_dirs, registered_include_sets or {})
    merged = {**dir_headers, **(headers or {})}  # headers given by name win over -I contents
    return {
        "source": code,
        "target": chosen,
        "name": name,
        "headers": merged,
        "flags": translated.flags,
        "output": output,
        "name_expressions": tuple(name_expressions),
        "include_sets": tuple(dict.fromkeys([*include_sets, *sets])),
        "toolchain": toolchain,
    }


def cupy_recipe_fields(
    code: str,
    options: Sequence[str] = (),
    name_expressions: Sequence[str] | None = (),
    *,
    target: str = "auto",
    name: str = "kernel.cu",
    headers: Mapping[str, str] | None = None,
    include_sets: Sequence[str] = (),
    registered_include_sets: Mapping[str, str | os.PathLike[str]] | None = None,
    toolchain: str | None = None,
    backend: str = "nvrtc",
    translate_cucomplex: bool = False,
    enable_cooperative_groups: bool = False,
    jitify: bool | None = False,
) -> dict[str, Any]:
    """The recipe fields of ``cupy.RawModule(code=code, options=options, name_expressions=...)``.

    The options are CuPy's (NVRTC's), read by :func:`translate_nvrtc_options`, followed
    by what CuPy adds itself (:data:`CUPY_IMPLICIT_FLAGS`). ``target`` is what CuPy's
    ``-arch`` for the current device would be (``auto``: the client resolves it); an
    ``-arch`` in ``options`` sets it instead. ``registered_include_sets`` (name ->
    directory) are the include sets an ``-I`` may name by path. The output is a cubin,
    or PTX for a ``compute_XX`` target. CuPy's own headers (``<cupy/complex.cuh>``) are
    not implied: register CuPy's include directory as an include set if a kernel uses them.
    """
    if backend != "nvrtc":
        raise RecipeError(
            "backend", f"{backend!r}: kcache compiles with NVRTC only (backend='nvrtc')"
        )
    for flag, what in (
        (translate_cucomplex, "translate_cucomplex rewrites the source against CuPy's own headers"),
        (jitify, "jitify rewrites the source with headers found on the compiling machine"),
        (
            enable_cooperative_groups,
            "enable_cooperative_groups links the kernel with the toolkit's libcudadevrt, "
            "which kcache recipes do not do",
        ),
    ):
        if flag:
            raise RecipeError(what.split(" ")[0], f"is not supported: {what}; compile without it")
    if isinstance(options, str):
        raise RecipeError("options", "must be a tuple of strings, not one string")
    translated = translate_nvrtc_options(options)
    if any(
        f == "-DCUPY_USE_JITIFY" or f.startswith("-DCUPY_USE_JITIFY=") for f in translated.flags
    ):
        raise RecipeError(
            "options", "-DCUPY_USE_JITIFY turns on jitify, which kcache does not support"
        )
    if translated.ltoir:
        raise RecipeError(
            "options",
            "-dlto makes LTO-IR, which a RawModule cannot load; for link-time optimization "
            "use a kcache Recipe with lto=True and link inputs",
        )
    # CuPy's flags come after the user's, so they win: canonicalise the combination.
    combined = translate_nvrtc_options([*options, *CUPY_IMPLICIT_FLAGS])
    chosen = combined.target or target
    output = "ptx" if chosen != "auto" and parse_target(chosen).is_virtual else "cubin"
    return _build(
        code,
        combined,
        target=target,
        output=output,
        name=name,
        name_expressions=name_expressions
        if isinstance(name_expressions, str)
        else tuple(name_expressions or ()),
        headers=headers,
        include_sets=include_sets,
        registered_include_sets=registered_include_sets,
        toolchain=toolchain,
    )


#: ProgramOptions fields with no NVRTC option that cuda.core's C++ path uses.
_CUDA_CORE_NVVM_ONLY = ("extra_sources", "use_libdevice")


def cuda_core_option_strings(options: Any) -> tuple[str | None, str | None, list[str]]:
    """(name, arch, NVRTC options) of a cuda.core ``ProgramOptions``, as cuda.core builds them.

    The options come from cuda.core itself (``as_bytes("nvrtc")``, ``_as_bytes()`` in
    older releases), so every field means what cuda.core makes of it. Fields that would
    make cuda.core act on the machine first are taken out: ``arch`` (``None`` asks the
    current device) is returned apart, ``use_bundled_headers`` (it installs headers into
    a directory) is dropped, as kcache compiles always use the bundled headers.
    """
    if not dataclasses.is_dataclass(options) or isinstance(options, type):
        raise RecipeError(
            "options",
            f"must be a cuda.core ProgramOptions, a list of NVRTC options or None, not "
            f"{type(options).__name__}",
        )
    for nvvm_only in _CUDA_CORE_NVVM_ONLY:
        if getattr(options, nvvm_only, None):
            raise RecipeError(
                f"options.{nvvm_only}",
                "is for cuda.core's NVVM backend; kcache compiles CUDA C++ with NVRTC",
            )
    name = getattr(options, "name", None)
    arch = getattr(options, "arch", None)
    changes: dict[str, Any] = {"arch": "sm_90"}  # a placeholder, never used: see above
    if getattr(options, "use_bundled_headers", None) is not None:
        changes["use_bundled_headers"] = None
    try:
        concrete: Any = dataclasses.replace(options, **changes)
        if hasattr(concrete, "as_bytes"):
            raw = concrete.as_bytes("nvrtc")
        elif hasattr(concrete, "_as_bytes"):  # cuda.core before 0.4
            raw = concrete._as_bytes()
        else:
            raw = concrete._formatted_options
    except RecipeError:
        raise
    except Exception as exc:  # cuda.core validates its fields with its own errors
        raise RecipeError("options", f"cuda.core refused these ProgramOptions: {exc}") from exc
    strings = [o.decode() if isinstance(o, bytes | bytearray) else str(o) for o in raw]
    strings = [o for o in strings if not o.startswith(("-arch=", "--gpu-architecture="))]
    return name, arch, strings


def cuda_core_recipe_fields(
    code: str,
    options: Any = None,
    target_type: str = "cubin",
    name_expressions: Sequence[str] = (),
    *,
    target: str = "auto",
    name: str | None = None,
    headers: Mapping[str, str] | None = None,
    include_sets: Sequence[str] = (),
    registered_include_sets: Mapping[str, str | os.PathLike[str]] | None = None,
    toolchain: str | None = None,
) -> dict[str, Any]:
    """The recipe fields of ``Program(code, "c++", options).compile(target_type, name_expressions)``.

    ``options`` is a cuda.core ``ProgramOptions`` (any release: it is read through
    cuda.core's own option builder, see :func:`cuda_core_option_strings`), a list of
    NVRTC options, or None. Its ``arch`` is the target (``None``: ``target``, by default
    ``auto``, the current device as cuda.core would pick it); its ``name`` the program
    name (cuda.core's default ``default_program`` keeps kcache's default, so equal
    programs key alike). ``target_type`` is the output: ``cubin``, ``ptx`` or ``ltoir``.
    """
    if target_type not in ("cubin", "ptx", "ltoir"):
        raise RecipeError("target_type", f"{target_type!r} is not one of cubin, ptx, ltoir")
    output = target_type
    fields = False
    if options is None:
        strings: list[str] = []
        option_name = arch = None
    elif isinstance(options, Sequence) and not isinstance(options, str):
        strings, option_name, arch = list(options), None, None
    else:
        option_name, arch, strings = cuda_core_option_strings(options)
        fields = True
    translated = translate_nvrtc_options(strings, fields=fields)
    if arch is not None:
        translated = dataclasses.replace(translated, target=parse_target(arch, "options.arch").text)
    if translated.ltoir and output != "ltoir":
        raise RecipeError(
            "options",
            f"link_time_optimization (-dlto) makes LTO-IR, but target_type is {target_type!r}; "
            "compile to 'ltoir', or leave link_time_optimization off",
        )
    if name is None:
        name = option_name if option_name not in (None, "default_program") else "kernel.cu"
    return _build(
        code,
        translated,
        target=target,
        output=output,
        name=name,
        name_expressions=name_expressions,
        headers=headers,
        include_sets=include_sets,
        registered_include_sets=registered_include_sets,
        toolchain=toolchain,
    )
