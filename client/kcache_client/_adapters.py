"""What the CuPy, cuda.core and PyTorch adapters share: lazy imports and the default cache."""

from __future__ import annotations

import importlib
import threading
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
    """One ``KernelCache()`` per process for adapters given no ``cache=`` (settings from the environment)."""
    global _default
    with _default_lock:
        if _default is None:
            from kcache_client._cache import KernelCache

            _default = KernelCache()
        return _default
