"""Include sets pinned to their contents before a recipe is keyed (``name@<digest>``).

A recipe key covers an include set by the digest of its contents (docs/design.md "What a
binding rests on"), so before keying, a client pins each set a recipe names:

- a set registered here (``ClientSettings.include_sets``, ``KCACHE_CLIENT_INCLUDE_SETS``,
  a CuPy ``-I`` directory) by the digest of its files here, walked at most once a
  second (:meth:`kcache.include_sets.IncludeSets.digest`): a header edited between two
  runs, or in a running process, gives its recipes other keys, so no tier answers
  the old kernel;
- any other by the server's word: ``include_set_digests`` of ``GET /v1/toolchains``,
  asked once per process and again at every warmup and prefetch (:meth:`refresh`), and
  when the server answers ``409 include_set_changed`` (a set edited since: the client
  pins again and asks once more). The answer is kept in the node tier too, so a
  process whose server is down keys recipes as it last could.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from kcache.errors import RecipeError
from kcache.include_sets import IncludeSets
from kcache.keys import is_hex_key

__all__ = ["IncludeSetPins", "server_set_digests"]


def server_set_digests(toolchains: Mapping[str, Any]) -> dict[str, str]:
    """The ``include_set_digests`` of a ``GET /v1/toolchains`` answer, checked (hex digests only)."""
    found = toolchains.get("include_set_digests")
    if not isinstance(found, dict):
        return {}
    return {str(k): v for k, v in found.items() if isinstance(k, str) and is_hex_key(v)}


class IncludeSetPins:
    """The digests this process pins include sets to: its own sets' and its server's."""

    def __init__(
        self,
        local_sets: Mapping[str, str | Path],
        server_digests: Callable[[], Mapping[str, str]],
    ) -> None:
        self._local_dirs = dict(local_sets)
        self._local: IncludeSets | None = None
        self._server_digests = server_digests
        self._server: dict[str, str] | None = None
        self._walk_now = False  # the next pin walks this process's own sets afresh
        self._lock = threading.Lock()

    def digests(self, names: Sequence[str]) -> dict[str, str]:
        """name -> digest of each of ``names``; a RecipeError names a set nobody registered."""
        out: dict[str, str] = {}
        remote = [name for name in names if name not in self._local_dirs]
        if len(remote) < len(names):
            local = self._local_sets()
            fresh, self._walk_now = self._walk_now, False
            for name in names:
                if name in self._local_dirs:
                    out[name] = local.digest(name, max_age_s=0 if fresh else None)
        if remote:
            server = self._server_view()
            for name in remote:
                if name not in server:
                    known = ", ".join(sorted({*server, *self._local_dirs})) or "none"
                    raise RecipeError(
                        "include_sets",
                        f"include set {name!r} is registered neither on the server nor here "
                        f"(known: {known}); register it (KCACHE_CLIENT_INCLUDE_SETS for a "
                        "directory here)",
                    )
                out[name] = server[name]
        return out

    def refresh(self) -> None:
        """Ask the server again at the next pin (a warmup, a prefetch, a 409 include_set_changed)."""
        with self._lock:
            self._server = None
            self._walk_now = True

    def _server_view(self) -> dict[str, str]:
        with self._lock:
            if self._server is None:
                self._server = dict(self._server_digests())
            return self._server

    def _local_sets(self) -> IncludeSets:
        if self._local is None:
            self._local = IncludeSets(self._local_dirs)
        return self._local
