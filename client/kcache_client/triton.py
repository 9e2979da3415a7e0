"""kcache behind Triton's own cache: ``TRITON_CACHE_MANAGER=kcache_client.triton:CacheManager``.

Triton asks a cache manager (``triton.runtime.cache``) for each kernel's *group*: the
files its compile made (IRs, PTX, cubin, the metadata JSON that names them), written one
by one with ``put`` and tied together by ``put_group``. :class:`CacheManager` keeps
Triton's own layout on local disk (``triton.knobs.cache.dir``: ``TRITON_CACHE_DIR``, else
``~/.triton/cache``:
``<dir>/<key>/<file>`` and ``__grp__<file>`` naming the group's files), so it and
Triton's ``FileCacheManager`` read each other's entries, and shares each group as one
foreign artifact (docs/design.md section 10): Triton's key and the group's metadata file
name, under ``triton``, Triton's version. A group is published whole, after
``put_group``, in the background; a reader gets every file of it or none, and writes the
files locally before the ``__grp__`` file that names them, so a reader of the local
directory never sees a group whose files are not all there. Triton's own remote cache
stores file by file, and a group there can be torn.

A lookup never raises and a server out of reach is a miss (Triton then compiles). A
group in the local directory is used while the server's withdrawals do not name it (an
admin removed it: docs/design.md section 3), read as before a node tier's answer; one
they name is removed, and looked up afresh.
Files put without a group (a launcher's ``.so``, autotuning results) stay on this node:
nothing tells what they were built from beyond Triton's key, and a launcher is specific
to the node's Python and driver. Triton's override and dump directories (debugging) are
Triton's own ``FileCacheManager``'s business, unchanged.

Nothing is imported from Triton unless an override or dump manager is asked for.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

__all__ = ["LIBRARY", "CacheManager"]

#: The foreign namespace's library name.
LIBRARY = "triton"
#: Target and toolchain of every name: Triton's key covers the backend and the target.
TARGET = TOOLCHAIN = "any"
_GROUP_PREFIX = "__grp__"

_foreign: Any = None
_foreign_lock = threading.Lock()


def _shared() -> Any:
    """The process's :class:`~kcache_client._foreign.ForeignCache` (one for every manager)."""
    global _foreign
    with _foreign_lock:
        if _foreign is None:
            from kcache_client._foreign import ForeignCache

            _foreign = ForeignCache()
        return _foreign


def _triton_version() -> str:
    try:
        return str(importlib.import_module("triton").__version__)
    except Exception:
        return "unknown"


def _cache_root() -> Path:
    """Triton's cache directory, where Triton's own ``FileCacheManager`` puts it.

    Triton 3.4+ reads it from ``triton.knobs.cache.dir``, which a program may set
    (``knobs.cache.dir = ...``) instead of ``TRITON_CACHE_DIR``; it is read here when
    Triton's knobs are loaded (as they are whenever Triton makes a manager), never
    imported. Else the environment, as older Tritons read it.
    """
    knobs = sys.modules.get("triton.knobs")
    configured = getattr(getattr(knobs, "cache", None), "dir", None)
    if isinstance(configured, str) and configured.strip():
        return Path(configured.strip())
    configured = os.environ.get("TRITON_CACHE_DIR", "").strip()
    if configured:
        return Path(configured)
    home = os.environ.get("TRITON_HOME") or str(Path.home())
    return Path(home) / ".triton" / "cache"


def _read_group(paths: dict[str, str]) -> dict[str, bytes] | None:
    """A local group's files (name -> bytes), or None when one cannot be read."""
    try:
        return {child: Path(path).read_bytes() for child, path in paths.items()}
    except OSError:
        return None


class CacheManager:
    """Triton's cache manager over a local directory and kcache; see the module docstring.

    Made by Triton as ``CacheManager(key, override=False, dump=False)``.
    """

    def __init__(self, key: str, override: bool = False, dump: bool = False) -> None:
        self.key = key
        self._delegate: Any = None
        if override or dump:  # Triton's debugging directories: Triton's own manager
            cache = importlib.import_module("triton.runtime.cache")
            self._delegate = cache.FileCacheManager(key, override=override, dump=dump)
            self.cache_dir = self._delegate.cache_dir
            return
        self.cache_dir = str(_cache_root() / key)
        os.makedirs(self.cache_dir, exist_ok=True)
        #: Bytes put by this manager, by file name, until their group is published.
        self._pending: dict[str, bytes] = {}

    # ------------------------------------------------------------------ local files
    def _path(self, filename: str) -> str:
        return os.path.join(self.cache_dir, filename)

    def _write(self, data: bytes, filename: str) -> str:
        """Write ``filename`` atomically (a temporary file beside it, renamed)."""
        path = self._path(filename)
        temp = os.path.join(self.cache_dir, f".tmp.{os.getpid()}.{uuid.uuid4().hex}.{filename}")
        with open(temp, "wb") as f:
            f.write(data)
        os.replace(temp, path)
        return path

    def has_file(self, filename: str) -> bool:
        """Whether the file is here (a group's files come with :meth:`get_group`)."""
        if self._delegate is not None:
            return bool(self._delegate.has_file(filename))
        return os.path.exists(self._path(filename))

    def get_file(self, filename: str) -> str | None:
        """The file's local path, or None."""
        if self._delegate is not None:
            return self._delegate.get_file(filename)  # type: ignore[no-any-return]
        return self._path(filename) if self.has_file(filename) else None

    def put(self, data: Any, filename: str, binary: bool = True) -> str:
        """Write a file here; it is shared when a group names it (:meth:`put_group`)."""
        if self._delegate is not None:
            return self._delegate.put(data, filename, binary=binary)  # type: ignore[no-any-return]
        raw = data if isinstance(data, bytes) else str(data).encode("utf-8")
        self._pending[filename] = raw
        return self._write(raw, filename)

    # ------------------------------------------------------------------ groups
    def _local_group(self, filename: str) -> dict[str, str] | None:
        try:
            with open(self._path(_GROUP_PREFIX + filename)) as f:
                children = json.load(f).get("child_paths")
        except (OSError, ValueError, AttributeError):
            return None
        if not isinstance(children, dict):
            return None
        found = {c: p for c, p in children.items() if isinstance(p, str) and os.path.exists(p)}
        return found if len(found) == len(children) else None

    def _name(self, filename: str) -> Any:
        from kcache.foreign import ForeignName

        return ForeignName(LIBRARY, _triton_version(), TARGET, TOOLCHAIN, f"{self.key}.{filename}")

    def get_group(self, filename: str) -> dict[str, str] | None:
        """The group's files (name -> local path): here whole, else from kcache whole, else None."""
        if self._delegate is not None:
            return self._delegate.get_group(filename)  # type: ignore[no-any-return]
        local = self._local_group(filename)
        try:
            name = self._name(filename)
        except Exception:  # a key or file name kcache cannot file: never shared
            return local
        if local is not None:
            # A copy kcache (or this node's compile) wrote: used while the server has not
            # withdrawn the group (an admin's removal); else gone, and looked up afresh.
            try:
                holds = _shared().copy_holds(name, lambda: _read_group(local))
            except Exception:  # kcache not usable here (its settings): Triton's copy as before
                holds = True
            if holds:
                return local
            with contextlib.suppress(OSError):
                os.unlink(self._path(_GROUP_PREFIX + filename))
        files = _shared().get(name)
        if not files:
            return None
        try:
            paths = {child: self._write(data, child) for child, data in files.items()}
            self._write(json.dumps({"child_paths": paths}).encode(), _GROUP_PREFIX + filename)
        except OSError:
            return None
        return paths

    def put_group(self, filename: str, group: dict[str, str]) -> str:
        """Tie the files together here, then publish them as one group (in the background)."""
        if self._delegate is not None:
            return self._delegate.put_group(filename, group)  # type: ignore[no-any-return]
        path = self._write(json.dumps({"child_paths": group}).encode(), _GROUP_PREFIX + filename)
        files: dict[str, bytes] = {}
        for child, child_path in group.items():
            data = self._pending.get(child)
            if data is None:
                try:
                    data = Path(child_path).read_bytes()
                except OSError:
                    return path  # a file gone: nothing half published
            files[child] = data
        with contextlib.suppress(Exception):  # publishing is best effort: Triton has its kernel
            _shared().put(self._name(filename), files)
        for child in group:
            self._pending.pop(child, None)
        return path
