"""Errors raised by the kcache core.

Hierarchy::

    KCacheError
    ├── InvalidKeyError (ValueError)          a recipe key or digest that is not 64 lowercase hex digits
    ├── RecipeError (ValueError)              bad recipe input; names the field and the limit
    │   ├── UnresolvedRecipeError             target "auto", no toolchain or an unpinned include set at keying time
    │   ├── IncludeSetChangedError            the recipe pins an include set to contents it no longer has
    │   └── UnlistedIncludeError              the compile reached a file that is not a recipe input
    ├── ToolchainError (RuntimeError)         NVRTC/nvJitLink missing or unusable
    │   └── DependencyTraceError              a compile's dependency trace is not proven complete
    ├── CompileError                          NVRTC or nvJitLink rejected the recipe; carries the log
    │   ├── CompileTimeoutError (TimeoutError)  the compile ran past its time limit
    │   └── ArtifactTooLargeError             the compile's output is over the artifact size limit
    ├── InvalidArtifactError                  compiler output is not a cubin for the target
    ├── ArtifactNotFoundError (FileNotFoundError)  no artifact for a key or digest
    ├── CorruptArtifactError                  stored bytes no longer match their digest
    ├── StoreFullError (OSError)              the store's filesystem is out of space
    ├── StoreUnavailableError (ConnectionError)  the object store (bucket) cannot be reached
    │   └── BucketMissingError                    the bucket does not exist
    └── LockTimeoutError (TimeoutError)       a cooperating-writer lock was not acquired in time

Errors carry fields, not just text, so the server can map them to statuses and
clients can act on them.
"""

from __future__ import annotations

__all__ = [
    "ArtifactNotFoundError",
    "ArtifactTooLargeError",
    "BucketMissingError",
    "CompileError",
    "CompileTimeoutError",
    "CorruptArtifactError",
    "DependencyTraceError",
    "IncludeSetChangedError",
    "InvalidArtifactError",
    "InvalidKeyError",
    "KCacheError",
    "LockTimeoutError",
    "RecipeError",
    "StoreFullError",
    "StoreUnavailableError",
    "ToolchainAbsentError",
    "ToolchainError",
    "UnlistedIncludeError",
    "UnresolvedRecipeError",
]


class KCacheError(Exception):
    """Root of every error kcache raises on purpose."""


class InvalidKeyError(KCacheError, ValueError):
    """A recipe key or digest is not exactly 64 lowercase hex digits (a sha256).

    ``field`` names where the value came from (``"digest"``, ``"recipe_key"``,
    ``"keys[3]"``), so each layer can turn it into its own error: the server a 400
    or a field error, the CLI a usage message. A key is never used to build a path
    before it passed this check.
    """

    def __init__(self, field: str, detail: str) -> None:
        super().__init__(f"{field} {detail}")
        self.field = field
        self.detail = detail


class RecipeError(KCacheError, ValueError):
    """A recipe field is malformed or over a limit.

    ``field`` names the offending field (dotted for nested ones, for example
    ``headers["../x.h"]``), so an HTTP layer can say precisely what was wrong.
    """

    def __init__(self, field: str, detail: str) -> None:
        super().__init__(f"{field}: {detail}")
        self.field = field
        self.detail = detail


class UnresolvedRecipeError(RecipeError):
    """The recipe still says ``target="auto"`` or names no toolchain, so it has no key yet."""


class IncludeSetChangedError(RecipeError):
    """The recipe pins an include set to a digest of contents the set no longer holds.

    Such a recipe can still be answered by its exact key, never compiled or matched: the
    files it names are gone. ``current`` is the set's digest now, so a client can pin
    its recipes again (``GET /v1/toolchains``) and ask once more.
    """

    def __init__(self, field: str, name: str, pinned: str, current: str) -> None:
        super().__init__(
            field,
            f"include set {name!r} changed: the recipe pins its contents {pinned[:16]}.., this "
            f"side holds {current[:16]}.. now (files were edited, added or removed). Pin the "
            "current contents (name it without '@', or as GET /v1/toolchains lists it) and ask "
            "again",
        )
        self.name = name
        self.pinned = pinned
        self.current = current


class UnlistedIncludeError(RecipeError):
    """An include reached a file that is not one of the recipe's inputs.

    The inputs are the source, the in-memory ``headers``, the toolchain's bundled
    headers and the include sets the recipe names. ``include`` is the include as
    written (a path string, never the file's content). The text is the same whether
    the file exists or not, so the error is no existence oracle.
    """

    def __init__(self, include: str, field: str = "source") -> None:
        shown = include if len(include) <= 200 else include[:200] + "..."
        super().__init__(
            field,
            f"#include {shown!r} is not one of the recipe's inputs (the source, `headers`, the "
            "toolchain's headers and the named include sets); give it in `headers` or register "
            "an include set",
        )
        self.include = include


class ToolchainError(KCacheError, RuntimeError):
    """NVRTC or nvJitLink is not installed, or could not be loaded or prepared."""


class ToolchainAbsentError(ToolchainError):
    """NVRTC or nvJitLink is not installed at all (rather than installed and broken): a
    client-only install, which fetches kernels from a server and compiles none itself."""


class DependencyTraceError(ToolchainError):
    """NVRTC's record of the files a successful compile read is not proven complete.

    Nothing is stored from such a compile. The NVRTC of the process that ran it is
    no longer trusted (see :mod:`kcache.nvrtc`); the compile is run again in a fresh
    process, and this error reaches a caller only when that fails the same way.
    """


class CompileError(KCacheError):
    """The compiler rejected the recipe.

    ``log`` is the full NVRTC or nvJitLink log. ``cached`` is true when the
    failure was served from a negative entry instead of a fresh compile.
    """

    def __init__(self, recipe_key: str | None, log: str, *, cached: bool = False) -> None:
        first = next((line for line in log.splitlines() if "error" in line), log.strip()[:200])
        super().__init__(f"compile failed: {first}")
        self.recipe_key = recipe_key
        self.log = log
        self.cached = cached


class CompileTimeoutError(CompileError, TimeoutError):
    """The compile ran past its time limit and was killed.

    Its message is the log's first line (what ran past which limit, and the setting):
    that log has no compiler line with "error" in it to pick, and a remembered one's
    note ("answered with this error ... until") is not the cause.
    """

    def __init__(self, recipe_key: str | None, log: str, *, cached: bool = False) -> None:
        super().__init__(recipe_key, log, cached=cached)
        self.args = (f"compile timed out: {log.strip().splitlines()[0] if log.strip() else ''}",)


class ArtifactTooLargeError(CompileError):
    """The compile succeeded, but its output is over the artifact size limit; nothing was stored.

    A refusal of this recipe (its output, not the server's state), so it is remembered
    like a compile error, for a while; ``log`` says the size and the limit.
    """

    def __init__(self, recipe_key: str | None, log: str, *, cached: bool = False) -> None:
        super().__init__(recipe_key, log, cached=cached)
        self.args = (f"artifact too large: {log.splitlines()[0] if log else ''}",)


class InvalidArtifactError(KCacheError):
    """Compiler output failed validation (not an ELF, not EM_CUDA, or the wrong SM)."""


class ArtifactNotFoundError(KCacheError, FileNotFoundError):
    """No artifact is known for this recipe key or digest."""


class CorruptArtifactError(KCacheError):
    """A stored blob's bytes no longer hash to its name; it has been quarantined."""

    def __init__(self, digest: str, actual: str, quarantined_to: str | None) -> None:
        super().__init__(
            f"blob {digest} is corrupt (its bytes hash to {actual}); "
            f"moved to {quarantined_to or 'nowhere (already gone)'}"
        )
        self.digest = digest
        self.actual = actual
        self.quarantined_to = quarantined_to


class StoreFullError(KCacheError, OSError):
    """The store's filesystem has no space left; nothing was published."""


class StoreUnavailableError(KCacheError, ConnectionError):
    """The object store could not be reached or refused the request; nothing was published.

    ``url`` names the store (``s3://bucket/prefix``), never its credentials.
    """

    def __init__(self, url: str, detail: str) -> None:
        super().__init__(f"{url}: {detail}")
        self.url = url
        self.detail = detail


class BucketMissingError(StoreUnavailableError):
    """The bucket the store names does not exist; ``detail`` says so and names the setting."""


class LockTimeoutError(KCacheError, TimeoutError):
    """A cooperating-writer lock could not be acquired within the timeout."""
