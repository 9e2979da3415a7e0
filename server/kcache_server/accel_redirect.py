"""nginx sends the bytes: the ``X-Accel-Redirect`` answer's path, and when to give it.

Behind the deploy's nginx (``accel_redirect`` set, ``deploy/nginx/kcache.conf.template``)
a fetch is answered with its headers, an empty body and ``X-Accel-Redirect`` to the
blob's file; nginx sends it. Both the FastAPI routes and the fast path
(:mod:`~kcache_server.serving.artifact_fastpath`) build that answer from here.
"""

from __future__ import annotations

import contextlib
import os
import stat
import time

from kcache.keys import is_hex_key

__all__ = ["ACCEL_HEADER", "TOUCH_S", "accel_path", "accel_wanted", "on_disk"]

#: A request header saying "send the bytes yourself": nginx's fallback when its file is gone.
ACCEL_HEADER = "X-KCache-Accel"


def accel_path(prefix: str, digest: str) -> str:
    """nginx's internal URI of ``digest``'s blob under ``prefix``: ``<prefix>ab/cd/<digest>``.

    Only a digest that passed the key check becomes a path (the store's own fan-out,
    :class:`~kcache.store.local.LocalArtifactStore`); anything else is a ``ValueError``.
    """
    if not is_hex_key(digest):
        raise ValueError(f"not a digest: {digest!r}")
    return f"{prefix}{digest[:2]}/{digest[2:4]}/{digest}"


#: A redirected blob's file gets its mtime refreshed when it is older than this: the local
#: copies' LRU (eviction, kcache.eviction) goes by mtime, and nginx's reads do not touch it.
TOUCH_S = 60.0


def on_disk(path: str) -> bool:
    """Whether ``path`` is a file nginx can send; its mtime refreshed once it is :data:`TOUCH_S` old."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    if not stat.S_ISREG(st.st_mode):
        return False  # nothing nginx should send (the route's read sets it aside)
    if time.time() - st.st_mtime > TOUCH_S:
        with contextlib.suppress(OSError):  # evicted meanwhile: nginx falls back
            os.utime(path)
    return True


def accel_wanted(prefix: str | None, value: str | None) -> bool:
    """Whether to answer with ``X-Accel-Redirect``: set up, and not refused by ``X-KCache-Accel``."""
    return prefix is not None and (value or "").strip().lower() != "off"
