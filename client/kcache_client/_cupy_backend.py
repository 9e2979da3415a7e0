"""kcache behind CuPy's own kernel cache hook: every CuPy compile, not only ``RawModule``'s.

CuPy (14.x) looks every compiled kernel up in a ``KernelCacheBackend``
(``cupy/cuda/_compiler_cache.py``: ``load(name) -> bytes | None``, ``save(name, cubin,
source)``), set by ``cupy.cuda.compiler._set_kernel_cache_backend`` (experimental in
CuPy). :func:`install_backend` puts kcache's in place: ``ElementwiseKernel``,
``ReductionKernel``, ``cupy.fuse``, ``RawKernel`` and CuPy's own kernels are then found
in this process's memory, the node tier and the server (a foreign artifact under CuPy's
key, docs/design.md section 10), and what CuPy compiles is published after the compile,
in the background.

**Fail closed.** CuPy's key covers the options as strings, not the contents of headers
read through ``-I`` directories (cupy#941), and ``load``/``save`` are not given the
options. The backend reads them from the frame of CuPy's ``_compile_with_cache_cuda``
that called it; a compile whose options name an include directory other than CuPy's own
headers and the CUDA headers CuPy adds (``-I``, ``--include-path``), or a pre-include
(``-include``, ``--pre-include``), is never shared: it goes to CuPy's own per-user disk
cache (``fallback``), exactly as without kcache. Where the options cannot be found (a
CuPy whose compiler is laid out otherwise), nothing is shared at all, with one warning.
Compiles that need user headers belong to :class:`kcache_client.cupy.RawModule`, whose
recipe keys cover every header's contents.

CuPy is imported only by :func:`install_backend`, never when this module is.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import threading
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kcache.foreign import ForeignName
    from kcache_client._cache import KernelCache
    from kcache_client._foreign import ForeignCache

__all__ = ["LIBRARY", "install_backend", "shareable_options", "uninstall_backend"]

log = logging.getLogger("kcache_client.cupy")

#: The foreign namespace's library name.
LIBRARY = "cupy"
#: The CuPy function whose frame holds a compile's options and architecture.
_CALLER = ("cupy.cuda.compiler", "_compile_with_cache_cuda")
#: Frames looked through for it (load/save are called from it directly).
_DEPTH = 6
#: The file the payload is named in a group.
PAYLOAD = "payload"

_INCLUDE_DIR = ("-I", "--include-path")
#: Option tuples whose verdict a backend remembers (CuPy compiles with few distinct ones).
_VERDICTS = 4096
_PRE_INCLUDE = ("-include", "--pre-include")

_installed: Any = None
_class: Any = None
_class_lock = threading.Lock()


def _option_values(options: Sequence[str], names: tuple[str, ...]) -> tuple[list[str], bool]:
    """The values of ``names`` in ``options`` (``-Idir``, ``-I dir``, ``--include-path=dir``),
    and whether any was cut off (a name last, with no value)."""
    values: list[str] = []
    cut = False
    items = list(options)
    i = 0
    while i < len(items):
        opt = items[i]
        for name in names:
            if opt == name:
                if i + 1 < len(items):
                    values.append(items[i + 1])
                    i += 1
                else:
                    cut = True
                break
            if opt.startswith(name + "="):
                values.append(opt[len(name) + 1 :])
                break
            if len(name) == 2 and opt.startswith(name):  # -Idir
                values.append(opt[2:])
                break
        i += 1
    return values, cut


def _within(path: str, roots: Iterable[str]) -> bool:
    real = os.path.realpath(path)
    return any(real == root or real.startswith(root.rstrip(os.sep) + os.sep) for root in roots)


def shareable_options(
    options: Sequence[Any] | None, allowed_roots: Iterable[str], *, real_roots: bool = False
) -> str | None:
    """Why a compile with ``options`` must not be shared (None: it may be).

    Shared only when every include directory is under ``allowed_roots`` (CuPy's own
    headers and the CUDA headers, which CuPy's key covers through its version and
    NVRTC's) and nothing is pre-included; unknown options (None) are never shared.
    ``real_roots``: the roots are resolved already (``os.path.realpath``).
    """
    if options is None:
        return "the compile's options could not be found"
    strings = [o for o in options if isinstance(o, str)]
    if len(strings) != len(options):
        return "an option that is not a string"
    pre, _ = _option_values(strings, _PRE_INCLUDE)
    if pre or any(o in _PRE_INCLUDE for o in strings):
        return "a pre-included file"
    dirs, cut = _option_values(strings, _INCLUDE_DIR)
    if cut:
        return "an include option without its directory"
    roots = list(allowed_roots) if real_roots else [os.path.realpath(r) for r in allowed_roots]
    for directory in dirs:
        if not _within(directory, roots):
            return f"the include directory {directory} (cupy#941: CuPy's key does not cover its headers)"
    return None


def _caller_frame() -> Any:
    frame: Any = sys._getframe(2)
    for _ in range(_DEPTH):
        if frame is None:
            return None
        code = frame.f_code
        if code.co_name == _CALLER[1] and frame.f_globals.get("__name__") == _CALLER[0]:
            return frame
        frame = frame.f_back
    return None


def _allowed_roots(cupy: Any) -> list[str]:
    """CuPy's include directory and the CUDA header directories CuPy puts on every compile."""
    roots = [os.path.join(os.path.dirname(cupy.__file__), "_core", "include")]
    try:
        from cuda.pathfinder import find_nvidia_header_directory

        found = find_nvidia_header_directory("cudart")
        if found:
            roots.append(str(found))
    except Exception:  # pathfinder absent or failing: only CuPy's own directory counts
        pass
    try:
        cuda_path = cupy.cuda.get_cuda_path()
        if cuda_path:
            roots.append(os.path.join(cuda_path, "include"))
    except Exception:
        pass
    return roots


def _backend_class(base: type) -> Any:
    global _class
    with _class_lock:
        if _class is not None and _class.__bases__[0] is base:
            return _class

        class KcacheKernelCacheBackend(base):  # type: ignore[misc]
            """CuPy's kernel cache through kcache's foreign artifacts; see the module docstring."""

            def __init__(
                self,
                foreign: ForeignCache,
                fallback: Any,
                version: str,
                toolchain: Any,
                roots: list[str],
            ) -> None:
                self.foreign = foreign
                self.fallback = fallback
                self.version = version
                self._toolchain = toolchain
                self.roots = [os.path.realpath(r) for r in roots]
                #: options -> why they are not shared (None: shared), decided once each.
                self._verdicts: dict[tuple[Any, ...], str | None] = {}
                #: Compiles kept off the fleet, by reason (first words).
                self.unshared: dict[str, int] = {}
                self._warned = False

            def _name(self, name: str) -> ForeignName | None:
                """The foreign name of this compile, or None when it must not be shared."""
                from kcache.foreign import ForeignName

                frame = _caller_frame()
                options = None if frame is None else frame.f_locals.get("options")
                why = self._verdict(options)
                if why is None and frame is not None:
                    arch = frame.f_locals.get("arch")
                    backend = frame.f_locals.get("backend") or "nvrtc"
                    if arch is None:
                        why = "the compile's architecture could not be found"
                    else:
                        try:
                            return ForeignName(
                                LIBRARY,
                                self.version,
                                f"sm_{arch}",
                                f"{backend}-{self._toolchain()}",
                                name,
                            )
                        except Exception as exc:  # a name kcache cannot file: not shared
                            why = f"an unusable name ({exc})"
                reason = (why or "unknown").split(" (")[0]
                self.unshared[reason] = self.unshared.get(reason, 0) + 1
                if frame is None and not self._warned:
                    self._warned = True
                    log.warning(
                        "kcache: this CuPy's compiler does not show its options to the cache "
                        "backend; nothing is shared through kcache (CuPy's disk cache is used)"
                    )
                return None

            def _verdict(self, options: Any) -> str | None:
                if not isinstance(options, tuple):
                    return shareable_options(options, self.roots, real_roots=True)
                try:
                    return self._verdicts[options]
                except KeyError:
                    pass
                except TypeError:  # an option that cannot be hashed: decided each time
                    return shareable_options(options, self.roots, real_roots=True)
                why = shareable_options(options, self.roots, real_roots=True)
                if len(self._verdicts) >= _VERDICTS:
                    self._verdicts.clear()
                self._verdicts[options] = why
                return why

            def load(self, name: str) -> bytes | None:
                foreign_name = self._name(name)
                if foreign_name is None:
                    return self.fallback.load(name)  # type: ignore[no-any-return]
                group = self.foreign.get(foreign_name)
                if group is None or PAYLOAD not in group:
                    return None
                return group[PAYLOAD]

            def save(self, name: str, cubin: bytes, source: str) -> None:
                foreign_name = self._name(name)
                if foreign_name is None:
                    self.fallback.save(name, cubin, source)
                    return
                self.foreign.put(foreign_name, {PAYLOAD: bytes(cubin)})

        _class = KcacheKernelCacheBackend
        return _class


def _nvrtc_version(compiler: Any) -> Any:
    def version() -> str:
        try:
            major, minor = compiler._get_nvrtc_version()
            return f"{major}.{minor}"
        except Exception:
            return "unknown"

    return version


def install_backend(cache: KernelCache | None = None, *, fallback: Any = None) -> Any:
    """Put kcache's ``KernelCacheBackend`` in place for every CuPy compile of this process.

    ``cache``: the :class:`~kcache_client.KernelCache` whose server and node tier are used
    (default: the process's, from the environment). ``fallback``: where compiles that
    must not be shared go (default: CuPy's own ``DiskKernelCacheBackend``). Returns the
    backend; :func:`uninstall_backend` puts the one before it back.
    """
    global _installed
    from kcache_client._foreign import ForeignCache

    cupy = importlib.import_module("cupy")
    compiler = importlib.import_module("cupy.cuda.compiler")
    cache_module = importlib.import_module("cupy.cuda._compiler_cache")
    base = cache_module.KernelCacheBackend
    if fallback is None:
        fallback = cache_module.DiskKernelCacheBackend()
    backend = _backend_class(base)(
        ForeignCache(cache),
        fallback,
        str(cupy.__version__),
        _nvrtc_version(compiler),
        _allowed_roots(cupy),
    )
    previous = getattr(compiler, "_kernel_cache_backend", None)
    compiler._set_kernel_cache_backend(backend)
    _installed = (backend, previous)
    return backend


def uninstall_backend() -> None:
    """Put back the backend :func:`install_backend` replaced, after this process's writes."""
    global _installed
    if _installed is None:
        return
    backend, previous = _installed
    compiler = importlib.import_module("cupy.cuda.compiler")
    backend.foreign.flush()
    if previous is not None:
        compiler._set_kernel_cache_backend(previous)
    _installed = None
