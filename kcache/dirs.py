"""Where kcache keeps things by default, each overridable by one environment variable.

    cache directory     $KCACHE_CACHE_DIR      else <user cache>/kcache/client   (client commands)
    server data dir     $KCACHE_DATA_DIR       else ./.kcache                    (server commands)
    toolchains          $KCACHE_TOOLCHAIN_DIR  else <user cache>/kcache/toolchains

``<user cache>`` is ``$XDG_CACHE_HOME``, else ``~/.cache``.

The two kinds of directory never mix. The *cache directory* is the user's (and a
node's) own: the client's node tier and what ``kcache compile`` builds without a
server, indexed by JSON files under ``index/``. A *server data directory* belongs to
``kcache serve``: its blobs are indexed by a SQL database (``kcache.db`` beside them,
or PostgreSQL), and only server commands (``serve``, ``db``, ``token``) write it.
:func:`directory_kind` tells them apart, so maintenance commands can do the right
thing with whichever they are given.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

__all__ = [
    "SERVER_DATABASE_FILE",
    "cache_dir",
    "data_dir",
    "directory_kind",
    "mark_cache_dir",
    "toolchain_dir",
    "user_cache_dir",
]

#: The SQLite database a server keeps in its data directory (its index, unless PostgreSQL).
SERVER_DATABASE_FILE = "kcache.db"

DirectoryKind = Literal["cache", "server", "absent"]

#: Marks a cache directory (https://bford.info/cachedir/: backup tools skip it too).
CACHE_TAG_FILE = "CACHEDIR.TAG"
_CACHE_TAG = (
    "Signature: 8a477f597d28d172789f06886806bc55\n"
    "# This file marks a kcache cache directory (the node tier and local compiles).\n"
)


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


def cache_dir(explicit: str | os.PathLike[str] | None = None) -> Path:
    """The user's cache directory: ``explicit``, else ``$KCACHE_CACHE_DIR``, else ``~/.cache/kcache/client``.

    The client's node tier and local compiles share it, so what one command put there
    every other command (and every process of the node) finds.
    """
    if explicit:
        return Path(explicit)
    return user_cache_dir("client", "KCACHE_CACHE_DIR")


def data_dir(explicit: str | os.PathLike[str] | None = None) -> Path:
    """A server's data directory: ``explicit``, else ``$KCACHE_DATA_DIR``, else ``./.kcache``."""
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("KCACHE_DATA_DIR") or ".kcache")


def mark_cache_dir(root: Path) -> None:
    """Create ``root`` as a cache directory: the tag is written before any blob can be, so
    :func:`directory_kind` never mistakes a cache that is being filled for a server's."""
    tag = root / CACHE_TAG_FILE
    if tag.exists():
        return
    root.mkdir(parents=True, exist_ok=True)
    staging = root / f".{CACHE_TAG_FILE}.{os.getpid()}"
    staging.write_text(_CACHE_TAG)
    os.replace(staging, tag)  # concurrent creators write the same bytes


def directory_kind(root: Path) -> DirectoryKind:
    """``server`` for a server's data directory, ``cache`` for a cache directory, ``absent``.

    A server's directory has its SQLite index (``kcache.db``) or, with PostgreSQL,
    blobs and neither a cache tag nor a JSON index beside them; anything else that
    exists is a cache directory (possibly still empty). The tag matters while a new
    cache is being filled: its first blob lands before its first index file.
    """
    if not root.is_dir():
        return "absent"
    if (root / SERVER_DATABASE_FILE).exists():
        return "server"
    if (root / CACHE_TAG_FILE).exists() or (root / "index").is_dir():
        return "cache"
    if (root / "blobs").is_dir():
        return "server"
    return "cache"
