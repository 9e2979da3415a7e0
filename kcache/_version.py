"""The one version of kcache-core, kcache-client and kcache-server, which are released together.

This file is the only place the version is written. ``client/kcache_client/_version.py``
and ``server/kcache_server/_version.py`` are symbolic links to it, so every
distribution's build reads it from inside its own source tree (setuptools' ``attr:``
for the version, the client's and server's ``setup.py`` for :func:`core_requirement`),
and every sdist carries a copy of it.
"""

from __future__ import annotations

import re

__version__ = "0.1.0"

#: The core's distribution name (its import name is ``kcache``; the PyPI name ``kcache``
#: belongs to an unrelated project).
CORE_DISTRIBUTION = "kcache-core"


def core_requirement(extras: str = "") -> str:
    """The requirement on the kcache core that a client or server of this version declares.

    The core of this release or a later patch of the same ``major.minor`` series:
    ``kcache-core>=0.1.0,<0.2`` (``extras="nvrtc"`` gives ``kcache-core[nvrtc]>=0.1.0,<0.2``).
    A new minor release may change the recipe schema or the engine's API, so a client
    or server never runs against another series.
    """
    release = re.fullmatch(r"([0-9]+)\.([0-9]+)(?:[.+-].*)?", __version__)
    if release is None:  # a malformed version must fail the build, not yield a wrong range
        raise ValueError(f"kcache version {__version__!r} does not start with MAJOR.MINOR")
    major, minor = int(release.group(1)), int(release.group(2))
    name = f"{CORE_DISTRIBUTION}[{extras}]" if extras else CORE_DISTRIBUTION
    return f"{name}>={__version__},<{major}.{minor + 1}"
