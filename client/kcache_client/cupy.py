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
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, TextIO

from kcache.recipe import Recipe
from kcache_client._adapters import default_cache, require

if TYPE_CHECKING:
    from kcache_client._artifact import Artifact
    from kcache_client._cache import KernelCache

__all__ = ["RawKernel", "RawModule"]

_EXTRA = "cupy-cuda13x (or the cupy-cuda12x wheel matching your CUDA)"
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*", re.ASCII)


def _cupy() -> Any:
    return require("cupy", _EXTRA, "kcache_client.cupy")


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
        self._cache = cache
        self._lock = threading.Lock()
        self._loaded: dict[int, tuple[Any, Artifact | None]] = {}
        self.recipe: Recipe | None = None
        if code is not None:
            registered = (cache or default_cache()).settings.include_sets
            # Translated now, not at first use: a refused option is said where it was written.
            self.recipe = Recipe.from_cupy(
                code,
                self.options,
                self.name_expressions,
                target=target,
                headers=headers,
                include_sets=include_sets,
                registered_include_sets=registered,
                backend=backend,
                translate_cucomplex=translate_cucomplex,
                enable_cooperative_groups=enable_cooperative_groups,
                jitify=jitify,
            )

    def _load(self) -> tuple[Any, Artifact | None]:
        """The ``cupy.RawModule`` (and its artifact) for the current CuPy device, compiled once."""
        cupy = _cupy()
        device = cupy.cuda.Device()
        loaded = self._loaded.get(device.id)
        if loaded is not None:
            return loaded
        with self._lock:
            loaded = self._loaded.get(device.id)
            if loaded is None:
                if self.recipe is None:
                    assert self.file_path is not None
                    loaded = (cupy.RawModule(path=self.file_path), None)
                else:
                    concrete = self.recipe.with_defaults(target=f"sm_{device.compute_capability}")
                    artifact = (self._cache or default_cache()).get(concrete)
                    loaded = (cupy.RawModule(path=str(artifact.path)), artifact)
                self._loaded[device.id] = loaded
        return loaded

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
        artifact = self._load()[1]
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
    def recipe(self) -> Recipe:
        """The kcache recipe this kernel is compiled from."""
        assert self._module.recipe is not None
        return self._module.recipe

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
