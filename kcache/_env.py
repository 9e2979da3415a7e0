"""Reading kcache's own environment variables, with errors that name the variable."""

from __future__ import annotations

import os

from kcache.errors import KCacheError

__all__ = ["env_flag"]

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def env_flag(name: str) -> bool | None:
    """The yes/no variable ``name``: None when unset or empty, else True or False.

    Anything else is refused naming the variable, rather than read as "no": a typo
    in ``KCACHE_LOCAL_COMPILE=ture`` should not silently turn the feature off.
    """
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return None
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise KCacheError(f"{name}={raw!r} is not a yes/no value: set it to 1 or 0 (or unset it)")
