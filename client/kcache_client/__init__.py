"""kcache client: fetch or request cubins by recipe, a node-local tier, multi-rank warmup.

from kcache import Recipe
from kcache_client import KernelCache

cache = KernelCache()                      # KCACHE_URL, KCACHE_TOKEN, KCACHE_CACHE_DIR
cache.warmup(recipes)                      # once per job under torch.distributed
kernel = cache.get(recipes[0]).load()      # a cuda.core Kernel
"""

from kcache_client._artifact import Artifact
from kcache_client._cache import CacheStats, KernelCache, Resolved, WarmupResult
from kcache_client._collective import Collective, StoreCollective, TorchCollective
from kcache_client._device import auto_target
from kcache_client._events import EventSink
from kcache_client._http import RetryPolicy
from kcache_client._settings import ClientSettings
from kcache_client._tier import NodeTier, default_cache_dir
from kcache_client.errors import (
    ArchitectureMismatchError,
    AuthenticationError,
    ClientError,
    DigestMismatchError,
    NoDeviceError,
    RemoteCompileError,
    RemoteNotFoundError,
    RequestRejectedError,
    ServerBusyError,
    ServerResponseError,
    ServerUnavailableError,
    WarmupCompileError,
    WarmupError,
    WarmupTimeoutError,
)

__version__ = "0.1.0"

__all__ = [
    "ArchitectureMismatchError",
    "Artifact",
    "AuthenticationError",
    "CacheStats",
    "ClientError",
    "ClientSettings",
    "Collective",
    "DigestMismatchError",
    "EventSink",
    "KernelCache",
    "NoDeviceError",
    "NodeTier",
    "RemoteCompileError",
    "RemoteNotFoundError",
    "RequestRejectedError",
    "Resolved",
    "RetryPolicy",
    "ServerBusyError",
    "ServerResponseError",
    "ServerUnavailableError",
    "StoreCollective",
    "TorchCollective",
    "WarmupCompileError",
    "WarmupError",
    "WarmupResult",
    "WarmupTimeoutError",
    "auto_target",
    "default_cache_dir",
]
