"""A full cache directory: said once, with its path and the fix, and survived where it can be.

Writing into the node tier (a blob, an alias, a record, a server's facts, a prefetch's
marker) on a full filesystem raised the core's ``StoreFullError`` ("[Errno 28] no space
left to publish 31098b09….json"), which named neither the directory nor a way out, and
failed the user's ``get`` although the kernel had been fetched. Here it becomes
:class:`~kcache_client.errors.CacheDirFullError`, naming the directory and the fixes
(free space, ``kcache cache clear``, ``KCACHE_CACHE_MAX_BYTES``, ``--cache-dir`` /
``KCACHE_CACHE_DIR``), and what happens next depends on what the write was for:

* **Kept for later** (:func:`tolerate_full`): a kernel fetched from the server, verified,
  and already in this process's memory; the server's facts; a record or a completeness
  marker. The tier is a cache, so its failure to keep a copy costs the next process a
  fetch, never this process its answer: the write is dropped and one WARNING per process
  and directory says so (a training job keeps running while a disk is full; ranks of a
  node would otherwise all die on the first kernel).
* **Needed now** (:func:`refuse_full`): a file asked for (``Artifact.path``), or a local
  compile, whose engine keeps its result only in the directory. Then the error is raised.

An exhausted quota (``EDQUOT``) is the same case with its own words.
"""

from __future__ import annotations

import errno
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from os import PathLike

from kcache.fsutil import is_disk_full
from kcache_client.errors import CacheDirFullError

__all__ = ["full_error", "refuse_full", "tolerate_full"]

_log = logging.getLogger("kcache_client")
_warned: set[str] = set()
_warned_lock = threading.Lock()


def full_error(
    root: str | PathLike[str], exc: BaseException, doing: str = "writing into it"
) -> CacheDirFullError | None:
    """``exc`` as :class:`CacheDirFullError` of the directory ``root``, or None when ``exc``
    is not a full disk or a spent quota (the core's ``StoreFullError``, or an ``OSError``
    with ``ENOSPC``/``EDQUOT``)."""
    if isinstance(exc, CacheDirFullError):
        return exc
    if not is_disk_full(exc):
        return None
    code = getattr(exc, "errno", None) or errno.ENOSPC
    return CacheDirFullError(str(root), code, doing)


@contextmanager
def refuse_full(root: str | PathLike[str], doing: str = "writing into it") -> Iterator[None]:
    """Raise a full disk under the block as :class:`CacheDirFullError` (one line, no chain)."""
    try:
        yield
    except OSError as exc:
        full = full_error(root, exc, doing)
        if full is None:
            raise
        raise full from None


@contextmanager
def tolerate_full(root: str | PathLike[str], doing: str = "keeping a copy") -> Iterator[None]:
    """Drop a write under the block that a full disk stopped, warning once per process and
    directory (module docstring); any other error passes."""
    try:
        yield
    except OSError as exc:
        full = full_error(root, exc, doing)
        if full is None:
            raise
        warn_full(full)


def warn_full(full: CacheDirFullError) -> None:
    """One WARNING per process and directory: the error's sentence, and what happens instead."""
    with _warned_lock:
        if full.path in _warned:
            return
        _warned.add(full.path)
    _log.warning(
        "kcache: %s. Going on without it: kernels fetched are used from memory and not kept "
        "there (the next process fetches them again)",
        full,
    )
