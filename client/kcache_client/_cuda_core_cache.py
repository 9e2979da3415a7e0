"""kcache behind cuda.core's own program cache: ``Program.compile(..., cache=ProgramCache())``.

cuda.core (1.x) takes any ``ProgramCacheResource`` (``cuda.core.utils``) as ``cache=``:
it derives the key (``make_program_cache_key``: code, options, target, its versions),
asks ``get(key)``, and on a miss compiles and stores ``cache[key] = ObjectCode``.
:class:`ProgramCache` keeps those entries as foreign artifacts under cuda.core's key
(docs/design.md section 10): this process's memory, the node tier, then the server, and
publishes what cuda.core compiled in the background. A lookup never raises (cuda.core
would let the exception out and never compile): whatever goes wrong is a miss.

cuda.core's key already refuses options that read files (``include_path``,
``pre_include``, PCH) unless the caller supplies an ``extra_digest``; kcache takes the
key as given. ``__delitem__``, ``clear`` and ``len`` work on this node's copies (the
memory and the node tier); a published entry leaves the server by an admin's ``DELETE``.
``close`` (the end of ``with cache:``) waits for the queued publishes, at most
:data:`~kcache_client._foreign.EXIT_FLUSH_S` seconds.

cuda.core is imported when the class is first made, never when this module is.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kcache.foreign import ForeignName
    from kcache_client._cache import KernelCache

__all__ = ["LIBRARY", "ProgramCache", "program_cache_class"]

#: The foreign namespace's library name.
LIBRARY = "cuda-core"
#: The target of every name: cuda.core's key covers the architecture itself.
TARGET = "any"
#: The file the binary is named in a group.
PAYLOAD = "payload"
#: Keys longer than this many bytes are filed under their sha256.
_LONG_KEY = 100

_class: Any = None
_lock = threading.Lock()


def _key_bytes(key: Any) -> bytes:
    if isinstance(key, str):
        return key.encode("utf-8")  # "k" and b"k" are one entry, as cuda.core says
    if isinstance(key, bytes | bytearray | memoryview):
        return bytes(key)
    raise TypeError(f"cache keys must be bytes or str, got {type(key).__name__}")


def _value_bytes(value: Any) -> bytes:
    """What cuda.core's caches store for a value: the bytes, or an ObjectCode's code."""
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    code = getattr(value, "code", None)
    if isinstance(code, str | os.PathLike):
        return Path(code).read_bytes()  # a path-backed ObjectCode: the file's bytes
    if isinstance(code, bytes | bytearray | memoryview):
        return bytes(code)
    raise TypeError(f"cache values must be bytes-like or ObjectCode, got {type(value).__name__}")


def _versions() -> tuple[str, str]:
    """cuda.core's version and the NVRTC it compiles with."""
    core = importlib.import_module("cuda.core")
    version = str(getattr(core, "__version__", "unknown"))
    try:
        from cuda.bindings import nvrtc

        _, major, minor = nvrtc.nvrtcVersion()
        toolchain = f"nvrtc-{major}.{minor}"
    except Exception:
        toolchain = "nvrtc"
    return version, toolchain


def program_cache_class() -> Any:
    """The ``ProgramCacheResource`` subclass, built on first use (its base is cuda.core's)."""
    global _class
    with _lock:
        if _class is not None:
            return _class
        utils = importlib.import_module("cuda.core.utils")
        base = getattr(utils, "ProgramCacheResource", None)
        if base is None:
            raise ImportError(
                "this cuda.core has no ProgramCacheResource (it came in cuda.core 1.0): "
                "pip install -U 'cuda-core>=1.0'"
            )

        class KcacheProgramCache(base):  # type: ignore[misc,valid-type]
            """cuda.core's program cache as kcache foreign artifacts; see the module docstring."""

            def __init__(self, cache: KernelCache | None = None) -> None:
                from kcache_client._foreign import ForeignCache

                self.foreign = ForeignCache(cache)
                self.version, self.toolchain = _versions()

            def _name(self, key: Any) -> ForeignName:
                from kcache.foreign import ForeignName

                raw = _key_bytes(key)
                text = raw.hex() if len(raw) <= _LONG_KEY else "h" + hashlib.sha256(raw).hexdigest()
                return ForeignName(LIBRARY, self.version, TARGET, self.toolchain, text)

            def __getitem__(self, key: Any) -> bytes:
                group = self.foreign.get(self._name(key))
                if group is None or PAYLOAD not in group:
                    raise KeyError(key)
                return group[PAYLOAD]

            def get(self, key: Any, default: bytes | None = None) -> bytes | None:
                try:
                    return self[key]
                except KeyError:
                    return default
                except TypeError:
                    raise
                except Exception:  # never let a lookup stop the compile
                    return default

            def __setitem__(self, key: Any, value: Any) -> None:
                self.foreign.put(self._name(key), {PAYLOAD: _value_bytes(value)})

            def __delitem__(self, key: Any) -> None:
                if not self.foreign.forget(self._name(key)):
                    raise KeyError(key)

            def __len__(self) -> int:
                return len(self.foreign.local_names(LIBRARY))

            def clear(self) -> None:
                self.foreign.clear_memory()
                if self.foreign._tier_usable():
                    names = self.foreign.local_names(LIBRARY)
                    if names:
                        self.foreign.cache.tier.remove(names)

            def flush(self, timeout: float = 30.0) -> bool:
                """Wait for this cache's queued publishes (True when done)."""
                return self.foreign.flush(timeout)

            def close(self) -> None:
                """Finish the queued publishes (bounded) and close the connections.

                cuda.core closes a resource at the end of ``with cache:`` (and asks every
                resource holding sockets to release them there); what was compiled in the
                block is then on the server, not left to the process's exit. A later use
                opens a new connection.
                """
                self.foreign.close()

        _class = KcacheProgramCache
        return _class


def ProgramCache(cache: KernelCache | None = None) -> Any:
    """A cuda.core ``ProgramCacheResource`` over kcache (memory, node tier, server) for
    ``Program.compile(..., cache=...)``; ``cache``: whose server and tier (default: the process's)."""
    return program_cache_class()(cache)
