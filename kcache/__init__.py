"""kcache core: recipes and keys, NVRTC/nvJitLink compiles, a content-addressed store, locks."""

from typing import TYPE_CHECKING

from kcache._version import __version__ as __version__
from kcache.lazy import lazy_exports

if TYPE_CHECKING:  # _LAZY's names, for type checkers (tests/test_lazy_exports.py)
    from kcache.artifact import ArtifactMeta as ArtifactMeta
    from kcache.artifact import CompileFailure as CompileFailure
    from kcache.artifact import CompileOutput as CompileOutput
    from kcache.artifact import ManifestEntry as ManifestEntry
    from kcache.compilers import Compiler as Compiler
    from kcache.compilers import InProcessCompiler as InProcessCompiler
    from kcache.deps import Dependency as Dependency
    from kcache.engine import Engine as Engine
    from kcache.engine import Resolution as Resolution
    from kcache.errors import ArtifactNotFoundError as ArtifactNotFoundError
    from kcache.errors import CompileError as CompileError
    from kcache.errors import CompileTimeoutError as CompileTimeoutError
    from kcache.errors import CorruptArtifactError as CorruptArtifactError
    from kcache.errors import InvalidArtifactError as InvalidArtifactError
    from kcache.errors import KCacheError as KCacheError
    from kcache.errors import LockTimeoutError as LockTimeoutError
    from kcache.errors import RecipeError as RecipeError
    from kcache.errors import StoreFullError as StoreFullError
    from kcache.errors import ToolchainError as ToolchainError
    from kcache.errors import UnresolvedRecipeError as UnresolvedRecipeError
    from kcache.include_sets import IncludeSets as IncludeSets
    from kcache.index import FileIndex as FileIndex
    from kcache.index import Index as Index
    from kcache.local_engine import open_local_engine as open_local_engine
    from kcache.locks import FileKeyLock as FileKeyLock
    from kcache.locks import KeyLock as KeyLock
    from kcache.locks import SingleFlight as SingleFlight
    from kcache.recipe import LinkInput as LinkInput
    from kcache.recipe import Recipe as Recipe
    from kcache.store import ArtifactStore as ArtifactStore
    from kcache.store import LocalArtifactStore as LocalArtifactStore
    from kcache.toolchain import Toolchain as Toolchain
    from kcache.toolchain import load_toolchain as load_toolchain

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

__all__ = [*_LAZY]

__getattr__, __dir__ = lazy_exports("kcache", _LAZY, globals(), __all__)
