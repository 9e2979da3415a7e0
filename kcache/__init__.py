"""kcache core: recipes and keys, NVRTC/nvJitLink compiles, a content-addressed store, locks."""

from kcache._version import __version__ as __version__
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
