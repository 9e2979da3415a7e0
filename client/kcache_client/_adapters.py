"""What the CuPy, cuda.core and PyTorch adapters share: lazy imports and the default cache."""

from __future__ import annotations

import dataclasses
import importlib
import sys
import threading
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kcache_client._cache import KernelCache

__all__ = ["cuda_core", "default_cache", "require"]

_default: KernelCache | None = None
_default_lock = threading.Lock()


def require(module: str, extra: str, what: str) -> Any:
    """Import ``module`` for ``what``, or raise an ImportError naming the package to install.

    The adapters import their library only when used, so ``import kcache_client.cupy``
    works without CuPy and only a use of it says what is missing.
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"{what} needs {module}, which is not installed: pip install {extra}"
        ) from exc


def cuda_core() -> Any:
    """``cuda.core`` (1.x, and 0.x releases that export ObjectCode there) or ``cuda.core.experimental``."""
    try:
        core = importlib.import_module("cuda.core")
        if hasattr(core, "ObjectCode"):
            return core
    except ImportError:
        pass
    return require("cuda.core.experimental", "'kcache-client[cuda-core]'", "the cuda.core adapter")


def default_cache() -> KernelCache:
    """One ``KernelCache()`` per process for adapters given no ``cache=`` (settings from the environment).

    Where CuPy is imported, its include directory is one of the cache's include sets
    (:mod:`kcache_client._cupy_headers`), as CuPy puts it on every compile's path.
    """
    global _default
    with _default_lock:
        if _default is None:
            from kcache_client._cache import KernelCache
            from kcache_client._settings import ClientSettings

            settings = ClientSettings.from_env()
            cupy_set = _cupy_include_set()
            if cupy_set is not None and cupy_set[0] not in settings.include_sets:
                sets = {**settings.include_sets, cupy_set[0]: cupy_set[1]}
                settings = dataclasses.replace(settings, include_sets=MappingProxyType(sets))
            _default = KernelCache(settings=settings)
        return _default


def _cupy_include_set() -> tuple[str, Path] | None:
    # Only a process that imported CuPy pays for hashing its headers (once).
    if "cupy" not in sys.modules:
        return None
    from kcache_client._cupy_headers import installed_include_set

    return installed_include_set()
