"""Errors raised by the kcache client.

Hierarchy (every class is also a :class:`kcache.errors.KCacheError`)::

    KCacheError
    └── ClientError
        ├── ServerUnavailableError (ConnectionError)   the server could not be reached; names URL and cause
        │   └── ServerBusyError                        429/503 answered until the retry budget ran out
        ├── ServerResponseError                        the server answered with an error status
        │   ├── AuthenticationError (PermissionError)  401/403: missing, wrong or under-scoped token
        │   ├── RequestRejectedError (ValueError)      400/413/422: the server refused the input
        │   └── RemoteNotFoundError (ArtifactNotFoundError)  404: unknown recipe, blob, or no compile allowed
        ├── RemoteCompileError (CompileError)          the server's compiler rejected the recipe; carries the log
        ├── RecipeRefusedError                         one recipe of a batch failed otherwise on the server (its code)
        ├── DigestMismatchError                        received bytes do not hash to the digest they claim
        ├── MetadataError                              the server's artifact metadata is malformed or does not fit
        ├── UntrustedArtifactError (SignatureError)    no signature by a trusted or pinned key covers an artifact
        ├── ResponseRefusedError                       an answer broke the protocol: a redirect, headers or a body
        │                                              over their bound, a body that is not the JSON asked for
        ├── BypassRefusedError (RecipeError)           KCACHE_BYPASS=error, and an adapter would hand a compile to its library
        ├── NoDeviceError (RuntimeError)               target "auto", Artifact.load() or a torch launch without a usable GPU
        ├── ArchitectureMismatchError (RuntimeError)   an artifact built for another GPU or a newer driver
        ├── LateCompileError                           a frozen cache missed its tiers after the warmup
        ├── CacheClosedError                           the KernelCache was closed: make a new one
        ├── CacheDirFullError (StoreFullError)         the cache directory's filesystem is full (or the quota spent)
        └── WarmupError                                a warmup failed; raised identically on every rank
            ├── WarmupCompileError (CompileError)      ... because a recipe does not compile
            └── WarmupTimeoutError (TimeoutError)      ... because a rank did not arrive, or the leader ran out of time

Core errors (:class:`~kcache.errors.RecipeError`, :class:`~kcache.errors.CompileError`
from a local compile, :class:`~kcache.errors.LockTimeoutError`) pass through as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kcache.errors import (
    ArtifactNotFoundError,
    CompileError,
    KCacheError,
    RecipeError,
    StoreFullError,
)
from kcache.signing import SignatureError

__all__ = [
    "ArchitectureMismatchError",
    "AuthenticationError",
    "BypassRefusedError",
    "CacheClosedError",
    "CacheDirFullError",
    "ClientError",
    "DigestMismatchError",
    "LateCompileError",
    "MetadataError",
    "NoDeviceError",
    "RecipeRefusedError",
    "RemoteCompileError",
    "RemoteNotFoundError",
    "RequestRejectedError",
    "ResponseRefusedError",
    "ServerBusyError",
    "ServerResponseError",
    "ServerUnavailableError",
    "UntrustedArtifactError",
    "WarmupCompileError",
    "WarmupError",
    "WarmupTimeoutError",
]


class ClientError(KCacheError):
    """Root of the errors the client raises on purpose."""


#: The ``url`` of a :class:`ServerUnavailableError` when no server is configured.
NO_SERVER = "(none)"


class ServerUnavailableError(ClientError, ConnectionError):
    """The server at ``url`` could not be reached after the bounded retries."""

    def __init__(self, url: str, cause: str) -> None:
        # "(none)": no server is configured at all, which nothing can reach.
        what = (
            "no kcache server is configured"
            if url == NO_SERVER
            else f"kcache server {url} is unreachable"
        )
        super().__init__(f"{what}: {cause}")
        self.url = url
        self.cause = cause


class ServerBusyError(ServerUnavailableError):
    """The server kept answering 429/503 (overloaded) until the retry budget was spent."""

    def __init__(self, url: str, status: int, retry_after: float | None) -> None:
        hint = f" (last Retry-After {retry_after:g}s)" if retry_after is not None else ""
        super().__init__(url, f"overloaded, HTTP {status}{hint}")
        self.status = status
        self.retry_after = retry_after


class ServerResponseError(ClientError):
    """The server answered ``status`` with the JSON error ``code`` and ``detail``."""

    def __init__(self, url: str, status: int, code: str, detail: str) -> None:
        super().__init__(f"{url}: HTTP {status} {code}: {detail}")
        self.url = url
        self.status = status
        self.code = code
        self.detail = detail


class AuthenticationError(ServerResponseError, PermissionError):
    """401/403: no token, a wrong token, or a token without the needed scope (KCACHE_TOKEN)."""


class RequestRejectedError(ServerResponseError, ValueError):
    """400/413/422: the server refused the request's input; ``detail`` says which field."""


class RemoteNotFoundError(ServerResponseError, ArtifactNotFoundError):
    """404: the server knows no artifact for this key or digest (and was not asked to compile)."""


class RemoteCompileError(CompileError, ClientError):
    """The server's NVRTC/nvJitLink rejected the recipe; ``log`` is the compiler's log."""

    def __init__(self, recipe_key: str | None, log: str, *, detail: str = "") -> None:
        super().__init__(recipe_key, log or detail)
        self.detail = detail


class BypassRefusedError(ClientError, RecipeError):
    """An adapter would have compiled this with its library, uncached, and ``KCACHE_BYPASS=error``.

    ``library`` is ``cupy`` or ``cuda.core``, ``reason`` the short code the audit records
    (``backend=nvcc``, ``option=--time``, ...), ``detail`` the sentence saying why.
    """

    def __init__(self, library: str, reason: str, detail: str) -> None:
        RecipeError.__init__(self, reason, f"{library} compile bypasses kcache: {detail}")
        self.library = library
        self.reason = reason


class DigestMismatchError(ClientError):
    """Bytes received from ``url`` hash to ``actual``, not the ``expected`` digest."""

    def __init__(self, url: str, expected: str, actual: str) -> None:
        super().__init__(f"bytes from {url} hash to {actual}, expected {expected}; refused")
        self.url = url
        self.expected = expected
        self.actual = actual


class RecipeRefusedError(ClientError):
    """One recipe of a batch failed on the server for another reason than its compile.

    ``code`` is the server's error code (``invalid_recipe``, ``quota_exceeded``, ...),
    ``detail`` its sentence, ``recipe_key`` the recipe, ``log`` a compiler log if any.
    """

    def __init__(self, url: str, code: str, detail: str, *, recipe_key: str, log: str = "") -> None:
        super().__init__(f"{url}: recipe {recipe_key} refused: {code}: {detail}")
        self.url = url
        self.code = code
        self.detail = detail
        self.recipe_key = recipe_key
        self.log = log


class MetadataError(ClientError):
    """The server's metadata for an artifact cannot be trusted; nothing was stored.

    It is malformed, contradicts the response it came with (another digest, another
    size), or does not fit the recipe (another target, kind or toolchain). ``url`` is
    where it came from, ``problem`` what was wrong.
    """

    def __init__(self, url: str, problem: str) -> None:
        super().__init__(f"artifact metadata from {url} refused: {problem}")
        self.url = url
        self.problem = problem


class UntrustedArtifactError(ClientError, SignatureError):
    """An artifact (a server's answer from ``url``, or what ``url`` names: a node-tier entry,
    an artifact being checked) is not signed by a key trusted for this client's server;
    ``problem`` says why (no signature, an unknown key, another server's key, one that does
    not verify) and how to fix it where that is a configuration. Nothing was used or stored.
    """

    def __init__(self, url: str, problem: str) -> None:
        super().__init__(f"refused {url}: {problem}")
        self.url = url
        self.problem = problem


class ResponseRefusedError(ClientError):
    """An answer from ``url`` broke the protocol and was refused; ``problem`` says how.

    A redirect (never followed: the token goes to the configured server only), headers
    or a body over their bound (a body may have what its metadata promises, a JSON answer
    a fixed cap), or a body that is not the JSON its route answers. The connection is
    dropped, the request is not retried (the server would answer the same) and nothing
    is stored. ``status`` is the answer's HTTP status when it had one.
    """

    def __init__(self, url: str, problem: str, *, status: int | None = None) -> None:
        super().__init__(f"answer from {url} refused: {problem}")
        self.url = url
        self.problem = problem
        self.status = status


class NoDeviceError(ClientError, RuntimeError):
    """A CUDA device was needed and none is usable: ``target="auto"``, ``Artifact.load()``,
    the torch adapter's launch on a machine without a GPU or driver (or a CPU-only torch)."""


class ArchitectureMismatchError(ClientError, RuntimeError):
    """An artifact cannot run here: built for ``artifact`` (``sm_80``, ``PTX ISA 9.5``), the device
    or driver is ``device`` (``sm_90``, ``CUDA 13.0 driver``). Raised before the driver sees the bytes.
    """

    def __init__(self, message: str, *, artifact: str, device: str) -> None:
        super().__init__(message)
        self.artifact = artifact
        self.device = device


class WarmupError(ClientError):
    """A multi-rank warmup failed. Every rank raises one with the same fields.

    ``kind`` is the class name of the leader's original error, ``recipe_key`` and
    ``log`` are set when one recipe was the cause, ``leader`` is the failing rank (the
    group rank of the leader, or of the rank that was waited for), ``missing_ranks`` the
    ranks that did not arrive when that is known (torch.distributed's global ranks for a
    torch group).
    """

    def __init__(
        self,
        message: str,
        *,
        kind: str = "",
        recipe_key: str | None = None,
        log: str = "",
        leader: int = 0,
        missing_ranks: Sequence[int] = (),
    ) -> None:
        super().__init__(message)
        self._set_fields(message, kind, recipe_key, log, leader, missing_ranks)

    def _set_fields(
        self,
        message: str,
        kind: str,
        recipe_key: str | None,
        log: str,
        leader: int,
        missing_ranks: Sequence[int],
    ) -> None:
        self.args = (message,)
        self.message = message
        self.kind = kind
        self.recipe_key = recipe_key
        self.log = log
        self.leader = leader
        self.missing_ranks = [int(r) for r in missing_ranks]

    def to_dict(self) -> dict[str, Any]:
        """A plain form that crosses process boundaries (pickled exceptions with fields do not)."""
        return {
            "class": type(self).__name__,
            "message": self.message,
            "kind": self.kind,
            "recipe_key": self.recipe_key,
            "log": self.log,
            "leader": self.leader,
            "missing_ranks": list(self.missing_ranks),
        }

    @staticmethod
    def from_dict(data: dict[str, Any]) -> WarmupError:
        """Inverse of :meth:`to_dict`, picking the same subclass."""
        cls: type[WarmupError] = {
            "WarmupCompileError": WarmupCompileError,
            "WarmupTimeoutError": WarmupTimeoutError,
        }.get(str(data.get("class")), WarmupError)
        return cls(
            str(data["message"]),
            kind=str(data.get("kind", "")),
            recipe_key=data.get("recipe_key"),
            log=str(data.get("log", "")),
            leader=int(data.get("leader", 0)),
            missing_ranks=[int(r) for r in data.get("missing_ranks") or ()],
        )


class WarmupCompileError(WarmupError, CompileError):
    """A warmup recipe does not compile; ``except CompileError`` catches it on every rank."""

    def __init__(
        self,
        message: str,
        *,
        kind: str = "",
        recipe_key: str | None = None,
        log: str = "",
        leader: int = 0,
        missing_ranks: Sequence[int] = (),
    ) -> None:
        # CompileError's constructor takes (recipe_key, log), not a message: call it
        # directly, then set the warmup fields as WarmupError does.
        CompileError.__init__(self, recipe_key, log or message)
        self._set_fields(message, kind, recipe_key, log, leader, missing_ranks)


class WarmupTimeoutError(WarmupError, TimeoutError):
    """A warmup did not finish within its timeout: a rank did not arrive (``missing_ranks``),
    the leader was slow, lost or died, or the job's key-value store stopped answering."""


class LateCompileError(ClientError):
    """A frozen cache (``KernelCache.freeze("error")``, or after a warmup with
    ``KCACHE_AFTER_WARMUP=error``) was asked for a kernel its memory and node tiers do not
    hold: the warmup did not cover it, and nothing is fetched or compiled after the barrier.

    ``recipe_key``, ``kernel`` and ``target`` name the recipe asked for.
    """

    def __init__(self, recipe_key: str, kernel: str, target: str) -> None:
        super().__init__(
            f"late compile refused: kernel {kernel or '(unnamed)'} for {target} (recipe "
            f"{recipe_key}) is not in this node's tiers, and the cache is frozen since its "
            "warmup (KernelCache.freeze('error') or KCACHE_AFTER_WARMUP=error): add the recipe "
            "to the warmup or its manifest, or freeze with 'warn' to let it compile"
        )
        self.recipe_key = recipe_key
        self.kernel = kernel
        self.target = target


class CacheClosedError(ClientError):
    """A ``KernelCache`` was used after its ``close()`` (or the ``with`` block that closed it):
    its connections, tier handles and event sender are gone. Make a new ``KernelCache``."""

    def __init__(self, doing: str) -> None:
        super().__init__(
            f"{doing}: this KernelCache was closed (close(), or the end of its with block); "
            "make a new KernelCache to go on"
        )
        self.doing = doing

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.doing,))


class CacheDirFullError(ClientError, StoreFullError):
    """A write into the cache directory ``path`` (the node tier) failed: its filesystem has no
    space left (``ENOSPC``) or its user's quota is spent (``EDQUOT``), as ``errno`` says.

    The message names the directory and the ways out (free space, ``kcache cache clear``,
    ``KCACHE_CACHE_MAX_BYTES``, another directory with ``--cache-dir``/``KCACHE_CACHE_DIR``).
    Raised where a file was needed (``Artifact.path``, a local compile, whose result lives
    in the directory); a kernel fetched from a server is used from memory instead, with one
    warning saying the same (:mod:`kcache_client._disk_full`).
    """

    def __init__(self, path: str, code: int, doing: str) -> None:
        from kcache.dirs import full_cache_dir_message

        message = full_cache_dir_message(path, code, doing)
        StoreFullError.__init__(self, code, message)
        self.path = path
        self.doing = doing
        self.message = message

    def __str__(self) -> str:
        return self.message

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.path, self.errno, self.doing))
