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

:func:`program_cache` is for code that keeps cuda.core's ``Program`` and passes
``compile(..., cache=...)``: a ``cuda.core.utils.ProgramCacheResource`` (cuda.core
1.x) whose entries live in kcache's node tier, under its size cap and LRU eviction
and ``kcache cache ls|rm|clear``, shared by every process of the node.

cuda.core is imported only when used (``cuda.core``, or ``cuda.core.experimental``
in releases before 0.4).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kcache.artifact import ArtifactMeta
from kcache.keys import sha256_hex
from kcache.recipe import Recipe
from kcache_client._adapters import cuda_core, default_cache, require

if TYPE_CHECKING:
    from kcache_client._artifact import Artifact
    from kcache_client._cache import KernelCache
    from kcache_client._tier import NodeTier

__all__ = ["PROGRAM_CACHE_KERNEL", "Program", "program_cache"]

#: The ``kernel`` field of node-tier entries stored by :func:`program_cache`.
PROGRAM_CACHE_KERNEL = "cuda.core ProgramCacheResource entry"


def _device_target(core: Any) -> str:
    """``sm_XY`` of cuda.core's current device, what cuda.core compiles for without an arch."""
    major, minor = core.Device().compute_capability
    return f"sm_{major}{minor}"


def object_code(artifact: Artifact, name: str) -> Any:
    """cuda.core's ``ObjectCode`` over an artifact's bytes, with its lowered names as symbol mapping."""
    core = cuda_core()
    if artifact.kind in ("cubin", "ptx"):
        return artifact.load_module()  # checks the architecture against the device first
    mapping = {expr: mangled.encode() for expr, mangled in artifact.lowered_names.items()}
    return core.ObjectCode.from_ltoir(artifact.data, name=name, symbol_mapping=mapping or None)


class Program:
    """A drop-in for cuda.core's ``Program`` for CUDA C++, compiled through kcache.

    ``code``, ``code_type`` and ``options`` are cuda.core's (``options`` a
    ``ProgramOptions``, or a list of NVRTC options); ``cache`` is the
    :class:`~kcache_client.KernelCache` (else one per process from the environment),
    ``headers`` in-memory headers, ``include_sets`` registered include sets. Only
    ``code_type="c++"`` goes through kcache: PTX and NVVM input is not NVRTC's.
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
        if str(code_type).lower() != "c++":
            raise ValueError(
                f"code_type {code_type!r}: kcache compiles CUDA C++ with NVRTC; use cuda.core's "
                "own Program for PTX and NVVM input"
            )
        if not isinstance(code, str):
            raise TypeError(f"code must be a str for code_type 'c++', not {type(code).__name__}")
        self.code = code
        self.code_type = "c++"
        self.options = options
        self._cache = cache
        self._headers = dict(headers or {})
        self._include_sets = tuple(include_sets)
        self._closed = False

    @property
    def backend(self) -> str:
        """``NVRTC``, as cuda.core's Program says for C++ code."""
        return "NVRTC"

    @property
    def is_closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def close(self) -> None:
        """Nothing to release: the compile ran in kcache. Later compiles are refused."""
        self._closed = True

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
        the artifact. ``cache=`` (cuda.core's program cache) is refused: kcache is the cache.
        """
        if self._closed:
            raise RuntimeError("this Program is closed")
        if cache is not None:
            raise TypeError(
                "kcache_client.cuda_core.Program caches through kcache: drop cache= (or use "
                "cuda.core's own Program with kcache_client.cuda_core.program_cache())"
            )
        recipe = self.recipe(target_type, name_expressions)
        if recipe.target == "auto":
            recipe = recipe.with_defaults(target=_device_target(cuda_core()))
        artifact = (self._cache or default_cache()).get(recipe)
        if logs is not None and artifact.metadata.log:
            logs.write(artifact.metadata.log)
        name = getattr(self.options, "name", None) or "default_program"
        return object_code(artifact, name)


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
