"""cuda.core's ``Program`` compiled through kcache, and a ``ProgramCacheResource`` on the node tier.

::

    from cuda.core import ProgramOptions
    from kcache_client.cuda_core import Program          # was: from cuda.core import Program

    prog = Program(SOURCE, "c++", options=ProgramOptions(std="c++17"))
    mod = prog.compile("cubin", name_expressions=("scale<float, 3>",))
    kernel = mod.get_kernel("scale<float, 3>")         # cuda.core's own ObjectCode and Kernel

``Program`` translates the ``ProgramOptions`` with :meth:`kcache.Recipe.from_cuda_core`
(each field mapped to a recipe field with the same meaning, or refused naming it),
resolves the recipe through a :class:`~kcache_client.KernelCache` and returns
cuda.core's ``ObjectCode`` made from the cached bytes, with the lowered names as its
symbol mapping, so ``get_kernel(name_expression)`` works on every hit (cuda.core's own
``cache=`` stores the bare binary and refuses name expressions for that reason).

:class:`ProgramCache` is cuda.core's own ``compile(..., cache=ProgramCache())`` over
kcache's foreign artifacts: this node's tier and the fleet's server, under cuda.core's
key (:mod:`kcache_client._cuda_core_cache`, docs/design.md section 10).
:func:`program_cache` is for code that keeps cuda.core's ``Program`` and passes
``compile(..., cache=...)``: a ``cuda.core.utils.ProgramCacheResource`` (cuda.core
1.x) whose entries live in kcache's node tier, under its size cap and LRU eviction
and ``kcache cache ls|rm|clear``, shared by every process of the node.

What kcache cannot key safely (PTX and NVVM input, a PCH or trace option, an option
recipes do not carry, ``compile(cache=...)``) is compiled by cuda.core's own
``Program``, exactly as without kcache (a *bypass*: warned once per reason, audited,
an error under ``KCACHE_BYPASS=error``; see :mod:`kcache_client._adapter_plans`). A
compile error raises cuda.core's ``NVRTCError`` (chained from kcache's error);
``options`` may be a ``ProgramOptions``, a dict of its fields or a list of NVRTC
options; ``handle`` and ``pch_status`` answer as cuda.core's.

cuda.core is imported only when used (``cuda.core``, or ``cuda.core.experimental``
in releases before 0.4).
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kcache.artifact import ArtifactMeta
from kcache.errors import CompileError, UnlistedIncludeError
from kcache.keys import sha256_hex
from kcache.recipe import Recipe
from kcache_client import _bypass
from kcache_client._adapter_plans import cuda_core_plan, refuse_extras
from kcache_client._adapters import cuda_core, default_cache, require
from kcache_client._bypass import Bypass
from kcache_client._cuda_core_cache import ProgramCache
from kcache_client.errors import RecipeRefusedError, RequestRejectedError

if TYPE_CHECKING:
    from kcache_client._artifact import Artifact
    from kcache_client._cache import KernelCache
    from kcache_client._tier import NodeTier

__all__ = ["PROGRAM_CACHE_KERNEL", "Program", "ProgramCache", "program_cache"]

#: The ``kernel`` field of node-tier entries stored by :func:`program_cache`.
PROGRAM_CACHE_KERNEL = "cuda.core ProgramCacheResource entry"


def _device_target(core: Any) -> str:
    """``sm_XY`` of cuda.core's current device, what cuda.core compiles for without an arch."""
    major, minor = core.Device().compute_capability
    return f"sm_{major}{minor}"


def nvrtc_error(exc: CompileError) -> Exception:
    """cuda.core's ``NVRTCError`` for a kcache compile error, worded as cuda.core words it."""
    log = getattr(exc, "log", "") or str(exc)
    message = f"6: NVRTC_ERROR_COMPILATION, compilation log:\n\n{log}"
    for module in ("cuda.core._utils.cuda_utils", "cuda.core.experimental._utils.cuda_utils"):
        try:
            error_class = importlib.import_module(module).NVRTCError
        except (ImportError, AttributeError):
            continue
        return error_class(message)  # type: ignore[no-any-return]
    return RuntimeError(message)


def nvrtc_backend() -> Any:
    """What cuda.core's Program says its C++ backend is: ``CompilerBackendType.NVRTC`` (a
    ``str`` enum, cuda.core 1.x), else the string ``"NVRTC"`` (releases before it)."""
    try:
        return importlib.import_module("cuda.core.typing").CompilerBackendType.NVRTC
    except (ImportError, AttributeError):
        return "NVRTC"


def debug_source_bypass(options: Any, native_program: Any = None) -> Bypass | None:
    """The bypass of a debug compile whose source file cuda.core makes, else None.

    cuda.core 1.2+ (its Program has ``_try_materialize_nvrtc_debug_source``) writes the
    source of a ``debug`` or ``lineinfo`` compile left without a ``ProgramOptions.name``
    to a temporary ``.cu`` file of its own, made when the Program is, compiles under that
    file's name so cuda-gdb can show the source, names the ObjectCode by it and removes
    it at close. The binary then names a file of this one Program: kcache has nothing
    to share, so cuda.core compiles it. Older releases name it ``default_program``,
    which kcache compiles as any other.
    """
    if not (getattr(options, "debug", None) or getattr(options, "lineinfo", None)):
        return None
    if getattr(options, "name", None) not in (None, "default_program"):
        return None
    native_program = native_program or cuda_core().Program  # ``options`` are cuda.core's here
    if not hasattr(native_program, "_try_materialize_nvrtc_debug_source"):
        return None
    return Bypass(
        "cuda.core",
        "debug-source-file",
        "a debug or lineinfo compile without ProgramOptions.name is compiled under a "
        "temporary copy of its source that cuda.core makes per Program for cuda-gdb",
    )


def _made_in(filename: str, program: Program) -> Any:
    """cuda.core's Program of ``program``'s code and options, made by a frame of ``filename``.

    cuda.core names the temporary source file of a debug compile after the Python file
    whose frame made its Program (``{caller}_{kernel}_XXXXXXXX.cu``); made here, that
    would be this module, so the one call is compiled as a line of the caller's file.
    """
    made = compile("Program(code, code_type, options)", filename, "eval")
    names = {"code": program.code, "code_type": program.code_type, "options": program.options}
    return eval(made, {"Program": cuda_core().Program}, names)


def _options(options: Any) -> Any:
    """``options`` as cuda.core's Program takes them: a dict is ``ProgramOptions(**options)``."""
    if isinstance(options, Mapping):
        return cuda_core().ProgramOptions(**options)
    return options


def object_code(artifact: Artifact, name: str) -> Any:
    """cuda.core's ``ObjectCode`` named ``name`` over an artifact's bytes, with its lowered
    names as symbol mapping.

    As cuda.core's own ``compile()`` returns it: not loaded, so no GPU is needed (an
    ahead-of-time build or a GPU-less CI compiles as with cuda.core), and the name is the
    program's (``ProgramOptions.name``), not the kernel's. The module is loaded when a
    kernel is first asked of it, where CUDA refuses a cubin of another architecture as it
    would cuda.core's own.
    """
    core = cuda_core()
    artifact.check()  # its bytes and signature (a verdict already reached is reused)
    mapping = {expr: mangled.encode() for expr, mangled in artifact.lowered_names.items()}
    make = {
        "cubin": core.ObjectCode.from_cubin,
        "ptx": core.ObjectCode.from_ptx,
        "ltoir": core.ObjectCode.from_ltoir,
    }[artifact.kind]
    return make(artifact.data, name=name, symbol_mapping=mapping or None)


class Program:
    """A drop-in for cuda.core's ``Program`` for CUDA C++, compiled through kcache.

    ``code``, ``code_type`` and ``options`` are cuda.core's (``options`` a
    ``ProgramOptions``, or a list of NVRTC options); ``cache`` is the
    :class:`~kcache_client.KernelCache` (else one per process from the environment),
    ``headers`` in-memory headers, ``include_sets`` registered include sets. Only
    ``code_type="c++"`` goes through kcache: PTX and NVVM input is cuda.core's own
    Program's (a bypass), and so is an unknown ``code_type`` (cuda.core raises for it).
    """

    def __init__(
        self,
        code: str,
        code_type: str = "c++",
        options: Any = None,
        *,
        cache: KernelCache | None = None,
        headers: Mapping[str, str] | None = None,
        include_sets: Sequence[str] = (),
    ) -> None:
        self.code = code
        self.code_type = str(code_type).lower()
        self.options = _options(options)
        self._cache = cache
        self._headers = dict(headers or {})
        self._include_sets = tuple(include_sets)
        self._closed = False
        self._native: Any = None
        self._pch_status: str | None = None
        #: Why cuda.core compiles this program itself (None: kcache decides per compile).
        self.bypass: Bypass | None = None
        #: Why the latest compile was cuda.core's own (None: it went through kcache).
        self.last_bypass: Bypass | None = None
        if self.code_type not in ("c++", "ptx", "nvvm"):
            # Not an input anyone compiles: cuda.core's own error (a RuntimeError).
            self._native = cuda_core().Program(code, code_type, self.options)
        if self.code_type != "c++" or not isinstance(code, str):
            what = self.code_type if self.code_type != "c++" else type(code).__name__
            self.bypass = Bypass(
                "cuda.core",
                f"code_type={what}",
                "kcache compiles CUDA C++ source with NVRTC; cuda.core compiles this input itself",
            )
            refuse_extras(self.bypass, headers=self._headers, include_sets=self._include_sets)
            _bypass.check(self.bypass, self._cache or default_cache())
            self._native_program()  # cuda.core's own checks of the code and options raise here
        elif getattr(self.options, "extra_sources", None) is not None:
            self._native_program()  # NVRTC takes one source: cuda.core's own ValueError
        elif not (self._headers or self._include_sets):
            # (kcache's own headers or include sets keep the compile kcache's: cuda.core takes none)
            self.bypass = debug_source_bypass(self.options)
            if self.bypass is not None:
                _bypass.check(self.bypass, self._cache or default_cache())
                # Its source file is made with the Program and named after the Python file
                # that made it: this caller's, as if it had called cuda.core itself.
                self._native = _made_in(sys._getframe(1).f_code.co_filename, self)

    def _native_program(self) -> Any:
        """cuda.core's own Program of the same code and options (made once, when needed)."""
        if self._native is None:
            self._native = cuda_core().Program(self.code, self.code_type, self.options)
        return self._native

    @property
    def handle(self) -> Any:
        """cuda.core's handle: of the NVRTC program of this code and options (made on first use)."""
        return self._native_program().handle

    @property
    def pch_status(self) -> str | None:
        """As cuda.core's: kcache never compiles with PCH, so None unless cuda.core compiled it."""
        return self._pch_status

    @property
    def backend(self) -> Any:
        """``NVRTC`` for C++ code (cuda.core's ``CompilerBackendType`` where it has one), as
        cuda.core's Program says; cuda.core's own for other input."""
        if self.code_type != "c++" and self._native is not None:
            return self._native.backend
        return nvrtc_backend()

    @property
    def is_closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def close(self) -> None:
        """Close cuda.core's program if one was made; later compiles are refused."""
        self._closed = True
        if self._native is not None:
            self._native.close()

    def recipe(self, target_type: str = "cubin", name_expressions: Sequence[str] = ()) -> Recipe:
        """The kcache recipe of ``compile(target_type, name_expressions)`` (``auto`` unresolved)."""
        cache = self._cache or default_cache()
        return Recipe.from_cuda_core(
            self.code,
            self.options,
            target_type,
            tuple(name_expressions),
            headers=self._headers,
            include_sets=self._include_sets,
            registered_include_sets=cache.settings.include_sets,
        )

    def compile(
        self,
        target_type: str = "cubin",
        name_expressions: Sequence[str] = (),
        logs: Any = None,
        *,
        cache: Any = None,
    ) -> Any:
        """cuda.core's ``ObjectCode`` for ``target_type`` (``cubin``, ``ptx`` or ``ltoir``).

        ``logs`` (an object with ``write``) receives the compile log kcache stored with
        the artifact. With ``cache=`` (a cuda.core ``ProgramCacheResource``, such as
        :func:`program_cache`), cuda.core's own Program compiles through that cache.
        """
        if self._closed:
            raise RuntimeError("Program has been closed")  # cuda.core's words
        kcache = self._cache or default_cache()
        if cache is not None:
            bypass = Bypass(
                "cuda.core",
                "compile(cache=)",
                "a cuda.core ProgramCacheResource was given, so cuda.core's own protocol runs",
            )
            return self._compile_bypassed(bypass, target_type, name_expressions, logs, cache=cache)
        if self.bypass is not None:
            return self._compile_bypassed(self.bypass, target_type, name_expressions, logs)
        plan = cuda_core_plan(
            self.code,
            self.options,
            target_type,
            tuple(name_expressions),
            headers=self._headers,
            include_sets=self._include_sets,
            registered_include_sets=kcache.settings.include_sets,
        )
        if isinstance(plan, Bypass):
            _bypass.check(plan, kcache)
            return self._compile_bypassed(plan, target_type, name_expressions, logs)
        recipe = plan
        if recipe.target == "auto":
            recipe = recipe.with_defaults(target=_device_target(cuda_core()))
        try:
            artifact = kcache.get(recipe)
        except CompileError as exc:
            raise nvrtc_error(exc) from exc
        except (RequestRejectedError, RecipeRefusedError, UnlistedIncludeError) as exc:
            # The server, or a local compile, refused the recipe's input (a quoted include
            # NVRTC would find beside the program, say): cuda.core compiles it, as without kcache.
            if isinstance(exc, UnlistedIncludeError):
                reason = "unlisted_include"
            else:
                reason = f"server={getattr(exc, 'code', '') or 'refused'}"
            bypass = Bypass("cuda.core", reason, str(exc))
            _bypass.check(bypass, kcache)
            return self._compile_bypassed(bypass, target_type, name_expressions, logs)
        if logs is not None and artifact.metadata.log:
            logs.write(artifact.metadata.log)
        name = getattr(self.options, "name", None) or "default_program"
        return object_code(artifact, name)

    def _compile_bypassed(
        self,
        bypass: Bypass,
        target_type: str,
        name_expressions: Sequence[str],
        logs: Any,
        **kwargs: Any,
    ) -> Any:
        """cuda.core's own compile of this program, reported as a bypass."""
        started = time.perf_counter()
        self.last_bypass = bypass
        native = self._native_program()
        compiled = native.compile(target_type, name_expressions, logs, **kwargs)
        self._pch_status = getattr(native, "pch_status", None)
        kernel = next(iter(name_expressions), None)
        _bypass.record(bypass, self._cache or default_cache(), kernel=kernel, started=started)
        return compiled


# --------------------------------------------------------------------------- program cache
_program_cache_class: Any = None
_class_lock = threading.Lock()


def _value_bytes(value: Any) -> bytes:
    """What cuda.core's caches store for a value: the bytes, or an ObjectCode's code."""
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    code = getattr(value, "code", None)
    if isinstance(code, str | os.PathLike):
        return Path(code).read_bytes()
    if isinstance(code, bytes | bytearray | memoryview):
        return bytes(code)
    raise TypeError(f"cache values must be bytes-like or ObjectCode, got {type(value).__name__}")


def _kind(data: bytes) -> str:
    if data.startswith(b"\x7fELF"):
        return "cubin"
    return "ptx" if b".version" in data[:4096] else "ltoir"


def _tier_program_cache() -> Any:
    """The ``ProgramCacheResource`` subclass, built on first use (its base is cuda.core's)."""
    global _program_cache_class
    with _class_lock:
        if _program_cache_class is not None:
            return _program_cache_class
        utils = require(
            "cuda.core.utils", "'cuda-core>=1.0'", "kcache_client.cuda_core.program_cache"
        )
        base = getattr(utils, "ProgramCacheResource", None)
        if base is None:
            raise ImportError(
                "this cuda.core has no ProgramCacheResource (it came in cuda.core 1.0): "
                "pip install -U 'cuda-core>=1.0', or use kcache_client.cuda_core.Program"
            )

        class NodeTierProgramCache(base):  # type: ignore[misc,valid-type]
            """cuda.core program-cache entries in kcache's node tier.

            A cuda.core key is stored under ``sha256("cuda.core\\0" + key)`` as a recipe
            key; the bytes are a blob of the tier like any artifact.
            """

            def __init__(self, tier: NodeTier) -> None:
                self.tier = tier

            @staticmethod
            def _alias(key: bytes | str) -> str:
                if isinstance(key, str):
                    key = key.encode("utf-8")
                if not isinstance(key, bytes | bytearray):
                    raise TypeError(f"cache keys must be bytes or str, got {type(key).__name__}")
                return sha256_hex(b"cuda.core\x00" + bytes(key))

            def __getitem__(self, key: bytes | str) -> bytes:
                found = self.tier.lookup(self._alias(key))
                if found is None:
                    raise KeyError(key)
                return found[1]

            def __setitem__(self, key: bytes | str, value: Any) -> None:
                data = _value_bytes(value)
                alias = self._alias(key)
                meta = ArtifactMeta(
                    digest=sha256_hex(data),
                    size=len(data),
                    kind=_kind(data),
                    target="",
                    toolchain="cuda.core",
                    kernel=PROGRAM_CACHE_KERNEL,
                )
                self.tier.publish(alias, alias, meta, data)

            def __delitem__(self, key: bytes | str) -> None:
                alias = self._alias(key)
                if self.tier.lookup(alias) is None:
                    raise KeyError(key)
                self.tier.remove([alias])

            def _aliases(self) -> list[str]:
                return [
                    k
                    for entry in self.tier.entries()
                    if entry.kernel == PROGRAM_CACHE_KERNEL
                    for k in entry.recipe_keys
                ]

            def __len__(self) -> int:
                return len(self._aliases())

            def clear(self) -> None:
                aliases = self._aliases()
                if aliases:
                    self.tier.remove(aliases)

        _program_cache_class = NodeTierProgramCache
        return _program_cache_class


def program_cache(cache: KernelCache | None = None) -> Any:
    """A cuda.core ``ProgramCacheResource`` over the node tier of ``cache`` (default: the process's).

    Pass it to cuda.core's own ``Program.compile(..., cache=...)``. Keys are cuda.core's
    (``make_program_cache_key``); kcache adds its tier's bounds, eviction and tools.
    """
    return _tier_program_cache()((cache or default_cache()).tier)
