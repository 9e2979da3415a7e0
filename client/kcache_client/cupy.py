"""``cupy.RawModule`` and ``cupy.RawKernel``, compiled through kcache: a one-line change.

::

    import cupy
    from kcache_client.cupy import RawModule      # was: from cupy import RawModule

    mod = RawModule(code=SOURCE, options=("-std=c++17",), name_expressions=("scale<float, 3>",))
    mod.get_function("scale<float, 3>")((blocks,), (256,), (x, n))   # CuPy arrays, as before

The options are translated by :meth:`kcache.Recipe.from_cupy` (each one mapped to a
recipe field with the same meaning, CuPy's own ``-ftz=true`` and
``--device-as-default-execution-space`` added, or refused naming the option). The
kernel is compiled once per recipe and device architecture through a
:class:`~kcache_client.KernelCache` (``cache=``, else one per process from the
environment), and the cubin is loaded into a real ``cupy.RawModule(path=...)``, so
``get_function`` returns CuPy's own ``RawKernel`` and launches take CuPy arrays
unchanged. Name expressions are looked up through the lowered names kcache stored
with the cubin. Like CuPy, compiles happen on first use, per device; ``target="auto"``
means the current CuPy device. CuPy is imported only when a kernel is first used.

What kcache cannot key safely (``backend="nvcc"``, ``jitify``, cooperative groups, an
option recipes do not carry) is compiled by CuPy itself, exactly as without kcache
(a *bypass*: warned once per reason, audited, an error under ``KCACHE_BYPASS=error``;
see :mod:`kcache_client._adapter_plans`). ``translate_cucomplex`` is applied before
keying, as CuPy applies it, and CuPy's own headers come from its include directory,
registered as an include set (:func:`cupy_include_set`). A compile error raises CuPy's
``cupy.cuda.compiler.CompileException`` (chained from kcache's error), and modules and
kernels pickle by their arguments, reloading from the cache on the other side.

:func:`install_backend` puts kcache behind CuPy's own kernel cache hook instead, for
every CuPy compile (``ElementwiseKernel``, ``ReductionKernel``, ``cupy.fuse``, CuPy's
own kernels): see :mod:`kcache_client._cupy_backend` (compiles that read user headers
through ``-I`` are never shared that way; they belong to ``RawModule`` here).
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from kcache.errors import CompileError
from kcache.recipe import Recipe
from kcache_client import _bypass
from kcache_client._adapter_plans import CUPY_PREPENDED_HEADERS, cupy_plan
from kcache_client._adapters import default_cache, require
from kcache_client._bypass import Bypass
from kcache_client._cupy_backend import install_backend, uninstall_backend
from kcache_client.errors import RecipeRefusedError, RequestRejectedError

if TYPE_CHECKING:
    from kcache_client._artifact import Artifact
    from kcache_client._cache import KernelCache

__all__ = ["RawKernel", "RawModule", "cupy_include_set", "install_backend", "uninstall_backend"]

_EXTRA = "cupy-cuda13x (or the cupy-cuda12x wheel matching your CUDA)"
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*", re.ASCII)


def _cupy() -> Any:
    return require("cupy", _EXTRA, "kcache_client.cupy")


def cupy_include_set() -> tuple[str, Path] | None:
    """(name, directory) of CuPy's include directory as kcache registers it, None without CuPy.

    The default cache registers it itself; give it to your own ``KernelCache``'s
    ``include_sets`` (and the server's, under the same name) for ``<cupy/...>`` includes.
    """
    from kcache_client._cupy_headers import installed_include_set

    return installed_include_set()


def _prepended_headers() -> tuple[str, ...]:
    """CuPy's own list of the headers ``translate_cucomplex`` prepends, where it is importable."""
    import sys

    for name in ("cupy._core._compile_with_cache", "cupy._core.core"):
        module = sys.modules.get(name)
        found = getattr(module, "_cupy_header_list", None)
        if isinstance(found, list) and all(isinstance(h, str) for h in found):
            # CuPy appends its bridge header to that list on every translate_cucomplex compile.
            return tuple(h for h in found if h != "cupy/cuComplex_bridge.h")
    return CUPY_PREPENDED_HEADERS


def _compile_exception(exc: CompileError, recipe: Recipe, options: Sequence[str]) -> Exception:
    """CuPy's ``CompileException`` for a kcache compile error (what CuPy code catches)."""
    compiler = _cupy().cuda.compiler
    log = getattr(exc, "log", "") or str(exc)
    try:
        return compiler.CompileException(log, recipe.source, recipe.name, tuple(options), "nvrtc")  # type: ignore[no-any-return]
    except TypeError:  # another CuPy release's signature
        return compiler.CompileException(log)  # type: ignore[no-any-return]


class RawModule:
    """A drop-in for ``cupy.RawModule`` whose code is compiled through kcache.

    The arguments are CuPy's; ``cache`` is the :class:`~kcache_client.KernelCache` to
    use, ``headers`` in-memory headers and ``include_sets`` registered include sets
    (the ``-I`` directories that are registered include sets of ``cache`` are found by
    path), ``target`` a fixed ``sm_XX`` instead of the current device's. ``path=``
    loads a compiled module as CuPy does, without kcache.
    """

    def __init__(
        self,
        code: str | None = None,
        *,
        path: str | os.PathLike[str] | None = None,
        options: Sequence[str] = (),
        backend: str = "nvrtc",
        translate_cucomplex: bool = False,
        enable_cooperative_groups: bool = False,
        name_expressions: Sequence[str] | None = None,
        jitify: bool | None = None,
        cache: KernelCache | None = None,
        target: str = "auto",
        headers: Mapping[str, str] | None = None,
        include_sets: Sequence[str] = (),
    ) -> None:
        if (code is None) == (path is None):
            raise TypeError("Exactly one of code and path keyword arguments must be given.")
        self.code = code
        self.file_path = None if path is None else os.fspath(path)
        self.options = tuple(options)
        self.backend = backend
        self.name_expressions = None if name_expressions is None else tuple(name_expressions)
        self.enable_cooperative_groups = enable_cooperative_groups
        self.translate_cucomplex = translate_cucomplex
        self.jitify = bool(jitify)
        # As given: CuPy 14 warns that the argument is deprecated whenever it is passed,
        # so a bypass hands it on only when the caller gave it (the pickling tests of
        # CuPy's suite turn that warning into an error).
        self._jitify_given = jitify
        self._cache = cache
        self._target = target
        self._headers = dict(headers or {})
        self._include_sets = tuple(include_sets)
        self._init_state()
        if code is not None:
            self._plan()

    def _init_state(self) -> None:
        self._lock = threading.Lock()
        self._loaded: dict[int, tuple[Any, Artifact | None]] = {}
        self._native: Any = None
        self.recipe: Recipe | None = None
        #: Why CuPy compiles this itself, uncached (None: it goes through kcache).
        self.bypass: Bypass | None = None

    def _plan(self) -> None:
        """The recipe, or the bypass: decided now, so a refusal is said where it was written."""
        assert self.code is not None
        cache = self._cache or default_cache()
        cupy_set = cupy_include_set() if "cupy/" in self.code or self.translate_cucomplex else None
        plan = cupy_plan(
            self.code,
            self.options,
            self.name_expressions,
            backend=self.backend,
            translate_cucomplex_=self.translate_cucomplex,
            enable_cooperative_groups=self.enable_cooperative_groups,
            jitify=self.jitify,
            target=self._target,
            headers=self._headers,
            include_sets=self._include_sets,
            registered_include_sets=cache.settings.include_sets,
            cupy_include_set=None if cupy_set is None else cupy_set[0],
            prepended=_prepended_headers() if self.translate_cucomplex else (),
        )
        if isinstance(plan, Bypass):
            _bypass.check(plan, cache)
            self.bypass = plan
            self._native_module()  # CuPy's own argument checks raise here, as in CuPy
        else:
            self.recipe = plan

    # Pickled by its arguments (as CuPy's own RawModule): the other side compiles, or
    # fetches from the cache, on first use. The cache object stays behind: the
    # unpickled module uses that process's default cache.
    def __getstate__(self) -> dict[str, Any]:
        """The module's arguments, without its cache, locks and loaded modules."""
        return {
            "code": self.code,
            "file_path": self.file_path,
            "options": self.options,
            "backend": self.backend,
            "translate_cucomplex": self.translate_cucomplex,
            "enable_cooperative_groups": self.enable_cooperative_groups,
            "name_expressions": self.name_expressions,
            "jitify": self._jitify_given,
            "target": self._target,
            "headers": self._headers,
            "include_sets": self._include_sets,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Rebuild from the arguments: the recipe (or bypass) is decided again here."""
        self.code = state["code"]
        self.file_path = state["file_path"]
        self.options = tuple(state["options"])
        self.backend = state["backend"]
        self.translate_cucomplex = state["translate_cucomplex"]
        self.enable_cooperative_groups = state["enable_cooperative_groups"]
        self.name_expressions = state["name_expressions"]
        self._jitify_given = state["jitify"]
        self.jitify = bool(self._jitify_given)
        self._cache = None
        self._target = state["target"]
        self._headers = dict(state["headers"])
        self._include_sets = tuple(state["include_sets"])
        self._init_state()
        if self.code is not None:
            self._plan()

    def _native_module(self) -> Any:
        """CuPy's own RawModule of these arguments, for a bypass (CuPy caches it per device)."""
        if self._native is None:
            given = {} if self._jitify_given is None else {"jitify": self._jitify_given}
            self._native = _cupy().RawModule(
                code=self.code,
                options=self.options,
                backend=self.backend,
                translate_cucomplex=self.translate_cucomplex,
                enable_cooperative_groups=self.enable_cooperative_groups,
                name_expressions=self.name_expressions,
                **given,
            )
        return self._native

    def _compile_bypassed(self, bypass: Bypass, device: Any, log_stream: TextIO | None) -> Any:
        cache = self._cache or default_cache()
        started = time.perf_counter()
        native = self._native_module()
        native.compile(log_stream)  # CuPy's compile, errors and all; later ones are CuPy's memo
        kernel = self.name_expressions[0] if self.name_expressions else None
        _bypass.record(
            bypass, cache, kernel=kernel, target=f"sm_{device.compute_capability}", started=started
        )
        return native

    def _load(self, log_stream: TextIO | None = None) -> tuple[Any, Artifact | None]:
        """The ``cupy.RawModule`` (and its artifact) for the current CuPy device, compiled once."""
        cupy = _cupy()
        device = cupy.cuda.Device()
        loaded = self._loaded.get(device.id)
        if loaded is not None:
            return loaded
        with self._lock:
            loaded = self._loaded.get(device.id)
            if loaded is None:
                if self.bypass is not None:
                    loaded = (self._compile_bypassed(self.bypass, device, log_stream), None)
                elif self.recipe is None:
                    assert self.file_path is not None
                    loaded = (cupy.RawModule(path=self.file_path), None)
                else:
                    loaded = self._load_recipe(self.recipe, device, log_stream)
                self._loaded[device.id] = loaded
        return loaded

    def _load_recipe(
        self, recipe: Recipe, device: Any, log_stream: TextIO | None
    ) -> tuple[Any, Artifact | None]:
        cache = self._cache or default_cache()
        concrete = recipe.with_defaults(target=f"sm_{device.compute_capability}")
        try:
            artifact = cache.get(concrete)
        except CompileError as exc:
            raise _compile_exception(exc, concrete, self.options) from exc
        except (RequestRejectedError, RecipeRefusedError) as exc:
            # The server refused the recipe's input (an include set it lacks, a quota):
            # CuPy compiles it, as it would without kcache.
            reason = getattr(exc, "code", "") or "refused"
            bypass = Bypass("cupy", f"server={reason}", str(exc)[:500])
            _bypass.check(bypass, cache)
            self.bypass = bypass
            return self._compile_bypassed(bypass, device, log_stream), None
        # CuPy reads a file: one holding exactly the bytes that were checked (Artifact.path),
        # and those, with the signature, checked again as Artifact.load() does.
        artifact.check()
        return _cupy().RawModule(path=str(artifact.path)), artifact

    def artifact(self) -> Artifact | None:
        """The kcache artifact loaded on the current device (None for ``path=`` modules)."""
        return self._load()[1]

    def _symbol(self, name: str) -> str:
        artifact = self._load()[1]
        if artifact is None:
            return name
        return artifact.lowered_names.get(name, name)

    def compile(self, log_stream: TextIO | None = None) -> None:
        """Compile (or fetch) and load now for the current device, as CuPy's ``compile``."""
        artifact = self._load(log_stream)[1]
        if log_stream is not None and artifact is not None and artifact.metadata.log:
            log_stream.write(artifact.metadata.log)

    def get_function(self, name: str) -> Any:
        """CuPy's ``RawKernel`` for ``name``: a name expression of the module, or a symbol."""
        return self._load()[0].get_function(self._symbol(name))

    def get_global(self, name: str) -> Any:
        """CuPy's ``get_global``: a ``cupy.ndarray`` over a ``__device__`` variable."""
        return self._load()[0].get_global(self._symbol(name))

    def get_texref(self, name: str) -> Any:
        """CuPy's ``get_texref`` for a texture reference of the module."""
        return self._load()[0].get_texref(self._symbol(name))

    @property
    def module(self) -> Any:
        """The loaded ``cupy.cuda.Module`` of the current device."""
        return self._load()[0].module


class RawKernel:
    """A drop-in for ``cupy.RawKernel`` whose code is compiled through kcache.

    ``name`` is the kernel's symbol (an ``extern "C"`` name) as in CuPy, or, beyond
    CuPy, a name expression such as ``scale<float, 3>``, which is instantiated and
    looked up through its lowered name. Calls, attributes and ``kernel`` are CuPy's
    own ``RawKernel``'s for the current device.
    """

    def __init__(
        self,
        code: str,
        name: str,
        options: Sequence[str] = (),
        backend: str = "nvrtc",
        translate_cucomplex: bool = False,
        *,
        enable_cooperative_groups: bool = False,
        jitify: bool | None = None,
        cache: KernelCache | None = None,
        target: str = "auto",
        headers: Mapping[str, str] | None = None,
        include_sets: Sequence[str] = (),
    ) -> None:
        self.code = code
        self.name = name
        self.options = tuple(options)
        self.backend = backend
        self._module = RawModule(
            code=code,
            options=options,
            backend=backend,
            translate_cucomplex=translate_cucomplex,
            enable_cooperative_groups=enable_cooperative_groups,
            name_expressions=None if _IDENTIFIER.fullmatch(name) else (name,),
            jitify=jitify,
            cache=cache,
            target=target,
            headers=headers,
            include_sets=include_sets,
        )
        self._kernels: dict[int, Any] = {}

    @property
    def recipe(self) -> Recipe | None:
        """The kcache recipe this kernel is compiled from (None when it bypasses kcache)."""
        return self._module.recipe

    @property
    def bypass(self) -> Bypass | None:
        """Why CuPy compiles this kernel itself, uncached (None: it goes through kcache)."""
        return self._module.bypass

    def __getstate__(self) -> dict[str, Any]:
        """Pickled by its module's arguments and its name, as CuPy's RawKernel."""
        return {
            "module": self._module,
            "code": self.code,
            "name": self.name,
            "options": self.options,
            "backend": self.backend,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Rebuild; the kernel is compiled (or fetched) on its first use here."""
        self._module = state["module"]
        self.code = state["code"]
        self.name = state["name"]
        self.options = tuple(state["options"])
        self.backend = state["backend"]
        self._kernels = {}

    def _kernel(self) -> Any:
        device = _cupy().cuda.get_device_id()
        kernel = self._kernels.get(device)
        if kernel is None:
            kernel = self._kernels[device] = self._module.get_function(self.name)
        return kernel

    def __call__(self, grid: Any, block: Any, args: Any, **kwargs: Any) -> None:
        """Launch as ``cupy.RawKernel.__call__(grid, block, args, *, shared_mem=0)``."""
        self._kernel()(grid, block, args, **kwargs)

    def compile(self, log_stream: TextIO | None = None) -> None:
        """Compile (or fetch) and load now for the current device."""
        self._module.compile(log_stream)

    @property
    def kernel(self) -> Any:
        """CuPy's ``cupy.cuda.Function`` on the current device."""
        return self._kernel().kernel

    @property
    def max_dynamic_shared_size_bytes(self) -> int:
        """As CuPy's (settable)."""
        return int(self._kernel().max_dynamic_shared_size_bytes)

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, value: int) -> None:
        self._kernel().max_dynamic_shared_size_bytes = value

    @property
    def preferred_shared_memory_carveout(self) -> int:
        """As CuPy's (settable)."""
        return int(self._kernel().preferred_shared_memory_carveout)

    @preferred_shared_memory_carveout.setter
    def preferred_shared_memory_carveout(self, value: int) -> None:
        self._kernel().preferred_shared_memory_carveout = value

    def __getattr__(self, name: str) -> Any:
        # attributes, num_regs, max_threads_per_block, ...: CuPy's RawKernel answers.
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._kernel(), name)
