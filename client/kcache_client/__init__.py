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
from kcache_client import errors as _errors
from kcache_client.errors import *  # noqa: F403  (errors.__all__, the public errors)

if TYPE_CHECKING:  # _LAZY's names, for type checkers (tests/test_lazy_exports.py)
    from kcache.job_manifest import JobManifest as JobManifest
    from kcache_client._artifact import Artifact as Artifact
    from kcache_client._artifact import ArtifactOrigin as ArtifactOrigin
    from kcache_client._cache import KernelCache as KernelCache
    from kcache_client._collective import Collective as Collective
    from kcache_client._collective import StoreCollective as StoreCollective
    from kcache_client._collective import TorchCollective as TorchCollective
    from kcache_client._device import auto_target as auto_target
    from kcache_client._events import EventSink as EventSink
    from kcache_client._settings import ClientSettings as ClientSettings
    from kcache_client._settings import RetryPolicy as RetryPolicy
    from kcache_client._stats import CacheStats as CacheStats
    from kcache_client._tier import NodeTier as NodeTier
    from kcache_client._tier import default_cache_dir as default_cache_dir
    from kcache_client._warmup import WarmupResult as WarmupResult

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

__all__ = [*_errors.__all__, *_LAZY]


__getattr__, __dir__ = lazy_exports("kcache_client", _LAZY, globals(), __all__)
