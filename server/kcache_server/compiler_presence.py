"""Whether this server compiles: the toolchain it runs with, or why it serves fetches only.

Serving an artifact already compiled needs no compiler: a replica behind a build farm,
or a read-only edge, answers fetches by key, resolve hits, foreign lookups and stats
with the database and the store alone. So a server whose NVRTC is older than 13.3 (no
bundled headers), or that has no NVRTC or nvJitLink at all, starts anyway under the
default ``compiler = "auto"``, with a toolchain that compiles nothing
(:func:`kcache.toolchain.probe_toolchain`) and one warning line saying why and what
installs the compiler. Everything that would compile refuses with
:class:`~kcache_server.errors.CannotCompileError` (501 ``cannot_compile``) naming the
same reason. ``compiler = "required"`` keeps the old refusal to start (a build farm
that must compile); ``compiler = "off"`` never compiles, whatever is installed.
"""

from __future__ import annotations

import logging

from kcache.toolchain import Toolchain, load_toolchain, probe_toolchain
from kcache_server.settings import Settings

__all__ = ["server_toolchain"]

log = logging.getLogger("kcache_server")

#: What ``compiler = "off"`` answers compiles with.
OFF_REASON = "compiling is turned off here (compiler = off, KCACHE_COMPILER)"


def server_toolchain(settings: Settings) -> Toolchain:
    """The toolchain this server compiles with, or one that says why it cannot (see module).

    Raises :class:`~kcache.errors.ToolchainError` only with ``compiler = "required"``.
    """
    if settings.compiler == "off":
        toolchain = Toolchain.absent(OFF_REASON)
    elif settings.compiler == "required":
        toolchain = load_toolchain(settings.toolchain_dir)
    else:
        toolchain = probe_toolchain(settings.toolchain_dir)
    if not toolchain.compiles:
        log.warning(
            "kcache server: this server cannot compile and serves fetches only (compiles "
            "answer 501 cannot_compile): %s",
            toolchain.cannot_compile,
        )
    return toolchain
