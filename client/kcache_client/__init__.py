"""kcache client: fetch or request cubins by recipe, a node-local tier, multi-rank warmup.

from kcache import Recipe
from kcache_client import KernelCache

cache = KernelCache()                      # KCACHE_URL, KCACHE_TOKEN, KCACHE_CACHE_DIR
cache.warmup(recipes)                      # once per job under torch.distributed
kernel = cache.get(recipes[0]).load()      # a cuda.core Kernel
results = cache.get_many(recipes)          # an Artifact or a typed error per recipe

Everything else a cache can be told is one ``ClientSettings`` (``KernelCache(settings=...)``).
"""

from typing import TYPE_CHECKING

from kcache.lazy import lazy_exports
from kcache_client.errors import (
    ArchitectureMismatchError,
    AuthenticationError,
    BypassRefusedError,
    ClientError,
    DigestMismatchError,
    LateCompileError,
    MetadataError,
    NoDeviceError,
    RecipeRefusedError,
    RemoteCompileError,
    RemoteNotFoundError,
    RequestRejectedError,
    ResponseRefusedError,
    ServerBusyError,
    ServerResponseError,
    ServerUnavailableError,
    UntrustedArtifactError,
    WarmupCompileError,
    WarmupError,
    WarmupTimeoutError,
)

if TYPE_CHECKING:
    from kcache.job_manifest import JobManifest
    from kcache_client._artifact import Artifact, ArtifactOrigin
    from kcache_client._cache import KernelCache
    from kcache_client._collective import Collective, StoreCollective, TorchCollective
    from kcache_client._device import auto_target
    from kcache_client._events import EventSink
    from kcache_client._settings import ClientSettings, RetryPolicy
    from kcache_client._stats import CacheStats
    from kcache_client._tier import NodeTier, default_cache_dir
    from kcache_client._warmup import WarmupResult

from kcache_client._version import __version__ as __version__

# Imported on first use, so `import kcache_client` (and the `kcache` command, which loads
# the client's subcommands) does not pay for httpx, threads and the tier until they are used.
_LAZY = {
    "Artifact": "kcache_client._artifact",
    "ArtifactOrigin": "kcache_client._artifact",
    "CacheStats": "kcache_client._stats",
    "KernelCache": "kcache_client._cache",
    "JobManifest": "kcache.job_manifest",
    "WarmupResult": "kcache_client._warmup",
    "Collective": "kcache_client._collective",
    "StoreCollective": "kcache_client._collective",
    "TorchCollective": "kcache_client._collective",
    "auto_target": "kcache_client._device",
    "EventSink": "kcache_client._events",
    "RetryPolicy": "kcache_client._settings",
    "ClientSettings": "kcache_client._settings",
    "NodeTier": "kcache_client._tier",
    "default_cache_dir": "kcache_client._tier",
}

__all__ = [
    "ArchitectureMismatchError",
    "Artifact",
    "ArtifactOrigin",
    "AuthenticationError",
    "BypassRefusedError",
    "CacheStats",
    "ClientError",
    "ClientSettings",
    "Collective",
    "DigestMismatchError",
    "EventSink",
    "JobManifest",
    "KernelCache",
    "LateCompileError",
    "MetadataError",
    "NoDeviceError",
    "NodeTier",
    "RecipeRefusedError",
    "RemoteCompileError",
    "RemoteNotFoundError",
    "RequestRejectedError",
    "ResponseRefusedError",
    "RetryPolicy",
    "ServerBusyError",
    "ServerResponseError",
    "ServerUnavailableError",
    "StoreCollective",
    "TorchCollective",
    "UntrustedArtifactError",
    "WarmupCompileError",
    "WarmupError",
    "WarmupResult",
    "WarmupTimeoutError",
    "auto_target",
    "default_cache_dir",
]


__getattr__, __dir__ = lazy_exports("kcache_client", _LAZY, globals(), __all__)
