"""Where kcache keeps things by default, each overridable by one environment variable.

    data directory      $KCACHE_DATA_DIR       else ./.kcache            (CLI and server store)
    toolchains          $KCACHE_TOOLCHAIN_DIR  else <user cache>/kcache/toolchains
    client node tier    $KCACHE_CACHE_DIR      else <user cache>/kcache/client

``<user cache>`` is ``$XDG_CACHE_HOME``, else ``~/.cache``.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["data_dir", "toolchain_dir", "user_cache_dir"]


def user_cache_dir(name: str, override_env: str | None = None) -> Path:
    """``$override_env`` if set, else ``<user cache>/kcache/<name>``."""
    explicit = os.environ.get(override_env) if override_env else None
    if explicit:
        return Path(explicit)
    cache_home = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache_home) / "kcache" / name


def toolchain_dir() -> Path:
    """Where NVRTC's bundled headers are extracted, once per toolchain."""
    return user_cache_dir("toolchains", "KCACHE_TOOLCHAIN_DIR")


def data_dir(explicit: str | os.PathLike[str] | None = None) -> Path:
    """``explicit``, else ``$KCACHE_DATA_DIR``, else ``./.kcache``."""
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("KCACHE_DATA_DIR") or ".kcache")
