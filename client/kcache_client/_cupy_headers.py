"""CuPy's own include directory as an include set: ``#include <cupy/complex.cuh>`` through kcache.

CuPy puts its include directory (``cupy/_core/include``) on every compile's path, so
kernels include ``<cupy/complex.cuh>`` and ``translate_cucomplex`` includes
``<cupy/cuComplex_bridge.h>``. kcache serves those headers from an include set named
for the CuPy release and the content of CuPy's own headers,
``cupy-<version>-<12 hex digits>`` (``cupy-14_2_0-...``: the dots written ``_``): :func:`include_set_name` computes it from the
directory alone, so a server (which need not have CuPy installed) registers a copy of
the directory under the very name the client asks for::

    python -m kcache_client._cupy_headers /path/to/cupy/_core/include 14.2.0
    # prints {"cupy-14_2_0-...": "/path/to/cupy/_core/include"} for the server's include_sets

The digest covers every file under ``cupy/`` except the bundled third-party trees
(``cupy/_cccl``, ``cupy/_cuda``, pinned by the release): a few hundred small files,
hashed once per process. Each compile also records the hash of every header it read
(:mod:`kcache.deps`), so a hit is never served for headers that changed.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
import os
import re
import sys
from pathlib import Path

__all__ = ["include_set_name", "installed_include_set"]

_SKIPPED = ("cupy/_cccl/", "cupy/_cuda/")


def include_set_name(directory: str | os.PathLike[str], version: str) -> str:
    """``cupy-<version>-<digest>`` (dots as ``_``) of CuPy's include ``directory``: the same on client and server."""
    root = Path(directory)
    digest = hashlib.sha256(version.encode() + b"\0")
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for filename in sorted(filenames):
            path = Path(dirpath) / filename
            relative = path.relative_to(root).as_posix()
            if relative.startswith(_SKIPPED) or not relative.startswith("cupy/"):
                continue
            digest.update(relative.encode() + b"\0")
            digest.update(hashlib.sha256(path.read_bytes()).digest())
    # Include set names are letters, digits, _ and -: "14.2.0" is written "14_2_0".
    spelled = re.sub(r"[^A-Za-z0-9_-]", "_", version)
    return f"cupy-{spelled}-{digest.hexdigest()[:12]}"


@functools.cache
def installed_include_set() -> tuple[str, Path] | None:
    """(name, directory) of the importable CuPy's include directory, or None without CuPy."""
    try:
        cupy = importlib.import_module("cupy")
    except ImportError:
        return None
    directory = Path(str(cupy.__file__)).parent / "_core" / "include"
    if not (directory / "cupy").is_dir():
        return None
    return include_set_name(directory, str(cupy.__version__)), directory


def _main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(
            "usage: python -m kcache_client._cupy_headers INCLUDE_DIR CUPY_VERSION", file=sys.stderr
        )
        return 2
    directory, version = argv
    print(json.dumps({include_set_name(directory, version): str(Path(directory).resolve())}))
    return 0


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
