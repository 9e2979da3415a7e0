"""kcache core: recipes and keys, NVRTC/nvJitLink compiles, a content-addressed store, locks."""

from typing import TYPE_CHECKING

from kcache._version import __version__ as __version__
from kcache.lazy import lazy_exports

if TYPE_CHECKING:
    from kcache.artifact import ArtifactMeta, CompileFailure, CompileOutput, ManifestEntry
    from kcache.compilers import Compiler, InProcessCompiler
    from kcache.deps import Dependency
    from kcache.engine import Engine, Resolution
    from kcache.errors import (
        ArtifactNotFoundError,
        CompileError,
        CompileTimeoutError,
        CorruptArtifactError,
        InvalidArtifactError,
        KCacheError,
        LockTimeoutError,
        RecipeError,
        StoreFullError,
        ToolchainError,
        UnresolvedRecipeError,
    )
    from kcache.include_sets import IncludeSets
    from kcache.index import FileIndex, Index
    from kcache.local_engine import open_local_engine
    from kcache.locks import FileKeyLock, KeyLock, SingleFlight
    from kcache.recipe import LinkInput, Recipe
    from kcache.store import ArtifactStore, LocalArtifactStore
    from kcache.toolchain import Toolchain, load_toolchain

# Imported on first use: every `kcache` command and every compile worker imports this
# package (kcache.cli is in it), and `kcache --help` must not pay for the compilers,
# the store and the locks (about 100 ms) to print its text.
_LAZY = {
    "ArtifactMeta": "kcache.artifact",
    "CompileFailure": "kcache.artifact",
    "CompileOutput": "kcache.artifact",
    "ManifestEntry": "kcache.artifact",
    "Compiler": "kcache.compilers",
    "InProcessCompiler": "kcache.compilers",
    "Dependency": "kcache.deps",
    "Engine": "kcache.engine",
    "Resolution": "kcache.engine",
    "ArtifactNotFoundError": "kcache.errors",
    "CompileError": "kcache.errors",
    "CompileTimeoutError": "kcache.errors",
    "CorruptArtifactError": "kcache.errors",
    "InvalidArtifactError": "kcache.errors",
    "KCacheError": "kcache.errors",
    "LockTimeoutError": "kcache.errors",
    "RecipeError": "kcache.errors",
    "StoreFullError": "kcache.errors",
    "ToolchainError": "kcache.errors",
    "UnresolvedRecipeError": "kcache.errors",
    "IncludeSets": "kcache.include_sets",
    "FileIndex": "kcache.index",
    "Index": "kcache.index",
    "open_local_engine": "kcache.local_engine",
    "FileKeyLock": "kcache.locks",
    "KeyLock": "kcache.locks",
    "SingleFlight": "kcache.locks",
    "LinkInput": "kcache.recipe",
    "Recipe": "kcache.recipe",
    "ArtifactStore": "kcache.store",
    "LocalArtifactStore": "kcache.store",
    "Toolchain": "kcache.toolchain",
    "load_toolchain": "kcache.toolchain",
}

__all__ = [
    "ArtifactMeta",
    "ArtifactNotFoundError",
    "ArtifactStore",
    "CompileError",
    "CompileFailure",
    "CompileOutput",
    "CompileTimeoutError",
    "Compiler",
    "CorruptArtifactError",
    "Dependency",
    "Engine",
    "FileIndex",
    "FileKeyLock",
    "InProcessCompiler",
    "IncludeSets",
    "Index",
    "InvalidArtifactError",
    "KCacheError",
    "KeyLock",
    "LinkInput",
    "LocalArtifactStore",
    "LockTimeoutError",
    "ManifestEntry",
    "Recipe",
    "RecipeError",
    "Resolution",
    "SingleFlight",
    "StoreFullError",
    "Toolchain",
    "ToolchainError",
    "UnresolvedRecipeError",
    "load_toolchain",
    "open_local_engine",
]

__getattr__, __dir__ = lazy_exports("kcache", _LAZY, globals(), __all__)
