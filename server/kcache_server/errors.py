"""Server errors, and the one table that maps every error to an HTTP status.

Hierarchy (the core's errors are in :mod:`kcache.errors`)::

    KCacheError
    └── ServerError
        ├── BadRequestError (ValueError)            400: malformed JSON, a bad key in a path
        ├── ArtifactSetAsideError (ArtifactNotFoundError)  404: the stored blob failed its check
        ├── InvalidRequestError (ValueError)        422: a request field is wrong (names it)
        ├── UnauthenticatedError                    401: no token, or an unknown one
        ├── PermissionDeniedError                   403: the token lacks the scope
        ├── PayloadTooLargeError                    413: body over max_request_bytes or max_request_values
        ├── ReportLimitError                        429 + Retry-After: a token's reported lookups this minute
        ├── OverloadedError                         503 + Retry-After: compile queue full
        │   └── CompilerUnavailableError            503 + Retry-After: no compile worker is running
        ├── DatabaseUnavailableError (ConnectionError)  503 + Retry-After: the database cannot be reached
        ├── QuotaExceededError                      507: the token's stored compiles reach its quota
        ├── CannotCompileError                      501: this server has no usable compiler (fetches only)
        ├── CompileWorkerCrashedError (ToolchainError)  500: the worker died mid-compile
        ├── SchemaOutOfDateError                    start-up refusal: run `kcache db upgrade`
        ├── IndexMissingError                       start-up refusal: blobs but no database
        ├── InsecureBindError                       start-up refusal: tokens or loopback
        └── SigningKeyConflictError                 start-up refusal: the database names another signing key

The core never imports FastAPI; status codes live here only (:data:`ERROR_TABLE`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from kcache.errors import (
    ArtifactNotFoundError,
    ArtifactTooLargeError,
    CompileError,
    CompileTimeoutError,
    CorruptArtifactError,
    IncludeSetChangedError,
    InvalidArtifactError,
    KCacheError,
    LockTimeoutError,
    RecipeError,
    StoreFullError,
    StoreUnavailableError,
    ToolchainError,
    UnlistedIncludeError,
    UnresolvedRecipeError,
)
from kcache.foreign import ForeignConflictError
from kcache_server.request_ids import current_request_id

__all__ = [
    "ERROR_TABLE",
    "ArtifactSetAsideError",
    "BadRequestError",
    "CannotCompileError",
    "CompileWorkerCrashedError",
    "CompilerUnavailableError",
    "DatabaseUnavailableError",
    "ErrorInfo",
    "IndexMissingError",
    "InsecureBindError",
    "InvalidRequestError",
    "OverloadedError",
    "PayloadTooLargeError",
    "PermissionDeniedError",
    "QuotaExceededError",
    "ReportLimitError",
    "SchemaOutOfDateError",
    "ServerError",
    "SigningKeyConflictError",
    "UnauthenticatedError",
    "error_body",
    "error_info",
]


class ServerError(KCacheError):
    """Root of the server's own errors."""


class BadRequestError(ServerError, ValueError):
    """The request cannot be read at all (malformed JSON, a path key that is not hex)."""


class ArtifactSetAsideError(ServerError, ArtifactNotFoundError):
    """A stored blob failed verification on read and was set aside: a miss, with that reason.

    Answered as an evicted artifact is (404 ``not_found``), never as a server error:
    the store moved the damaged copy to its quarantine, and the next compile of the
    recipe stores the bytes afresh. ``digest`` names the blob, ``recipe_key`` the
    recipe when known; the quarantine's location goes to the server log only.
    """

    def __init__(self, digest: str, recipe_key: str | None = None) -> None:
        subject = (
            f"the artifact for recipe {recipe_key} (blob {digest})"
            if recipe_key
            else f"blob {digest}"
        )
        super().__init__(
            f"the stored copy of {subject} failed its integrity check (its bytes no longer hash "
            "to their name), so it was set aside and is not served: a miss until the recipe is "
            "compiled again (resolve it with compile: true)"
        )
        self.digest = digest
        self.recipe_key = recipe_key


class InvalidRequestError(ServerError, ValueError):
    """A request field is wrong; ``field`` names it."""

    def __init__(self, field: str, detail: str) -> None:
        super().__init__(f"{field}: {detail}")
        self.field = field
        self.detail = detail


class UnauthenticatedError(ServerError):
    """No bearer token, or one that is unknown or revoked."""


class PermissionDeniedError(ServerError):
    """The token is valid but lacks the scope the request needs."""


class PayloadTooLargeError(ServerError):
    """The request body is over ``max_request_bytes``, or holds over ``max_request_values`` JSON values."""


class ReportLimitError(ServerError):
    """A batch of client events would take its token past ``audit.max_reported_per_minute``.

    ``reporter`` names the token, ``limit`` the bound, ``reported`` what the token
    reported this minute before the batch and ``batch`` the batch's lookups;
    ``retry_after`` is the seconds until the minute ends, when the count starts again.
    """

    def __init__(
        self, reporter: str, *, limit: int, reported: int, batch: int, retry_after: int
    ) -> None:
        super().__init__(
            f"this batch's {batch} lookups would take {reporter} past {limit} reported this "
            f"minute ({reported} so far), the most one token may report a minute "
            f"(audit.max_reported_per_minute); send it again in {retry_after} s"
        )
        self.reporter = reporter
        self.limit = limit
        self.reported = reported
        self.batch = batch
        self.retry_after = retry_after


class OverloadedError(ServerError):
    """Too many compiles are queued; the client should retry after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: int = 5) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class CompilerUnavailableError(OverloadedError):
    """No compile worker is running and none is starting (they died and could not be restarted)."""


class DatabaseUnavailableError(ServerError, ConnectionError):
    """The database cannot be reached: connecting failed, or the connection was lost.

    Raised by the engine's error hook (:mod:`kcache_server.db`) in place of the driver's
    error, so every caller sees one type; the driver's text (host, user, database) goes
    to the log only. ``connection_invalidated`` mirrors the attribute of SQLAlchemy's
    ``DBAPIError``: code that asks a database error whether it was an outage (the audit
    writer keeps its rows for later then) gets the same answer from this one. ``driver_error``
    is SQLAlchemy's error it replaces (for a command, which names the URL and the cause).
    """

    connection_invalidated = True

    def __init__(
        self, message: str, *, driver_error: BaseException | None = None, retry_after: int = 5
    ) -> None:
        super().__init__(message)
        self.driver_error = driver_error
        self.retry_after = retry_after


class QuotaExceededError(ServerError):
    """The caller's stored compiles reach its storage quota (``token_quota_bytes``)."""


class CannotCompileError(ServerError):
    """This server has no compiler it can use, so it serves only what is already compiled.

    ``reason`` is the toolchain's (:attr:`kcache.toolchain.Toolchain.cannot_compile`:
    the NVRTC found, the release needed, the pip command that installs it); ``what``
    says what was refused. Answered 501, not 503: asking again changes nothing until
    the operator installs the compiler, so clients do not retry it.
    """

    def __init__(self, reason: str, what: str = "the recipe is not held here and") -> None:
        super().__init__(
            f"{what} this server cannot compile; it serves only artifacts already compiled "
            f"(fetches by key or digest, resolve hits): {reason}"
        )
        self.reason = reason


class CompileWorkerCrashedError(ServerError, ToolchainError):
    """The compile worker process died while compiling; it was replaced."""


class SchemaOutOfDateError(ServerError):
    """The database schema is not at the revision this server needs."""


class IndexMissingError(ServerError):
    """The data directory holds blobs but the database has no tables: the index was lost."""


class InsecureBindError(ServerError):
    """A non-loopback bind with no tokens configured and no ``--force-insecure``."""


class SigningKeyConflictError(ServerError):
    """The database names a signing key this server cannot sign beside (another key in use,
    or its own key retired): replicas sharing a database sign with one key."""


@dataclass(frozen=True)
class ErrorInfo:
    """How one error type is answered: status and the ``error`` code of the JSON body."""

    status: int
    code: str
    retry: bool = False  # send Retry-After


#: The one mapping from error types to HTTP answers. Looked up along the MRO, so a
#: subclass listed here wins over its base (CompileTimeoutError over CompileError).
ERROR_TABLE: dict[type[BaseException], ErrorInfo] = {
    BadRequestError: ErrorInfo(400, "bad_request"),
    UnresolvedRecipeError: ErrorInfo(400, "unresolved_recipe"),
    InvalidRequestError: ErrorInfo(422, "invalid_request"),
    UnlistedIncludeError: ErrorInfo(422, "unlisted_include"),
    # A recipe pinned to a set's earlier contents: a conflict with the server's state, which
    # the client resolves by pinning the current contents (kcache_client does, once).
    IncludeSetChangedError: ErrorInfo(409, "include_set_changed"),
    # A foreign group naming one file twice with other bytes (docs/design.md section 10).
    ForeignConflictError: ErrorInfo(409, "conflict"),
    RecipeError: ErrorInfo(422, "invalid_recipe"),
    CompileTimeoutError: ErrorInfo(422, "compile_timeout"),
    ArtifactTooLargeError: ErrorInfo(422, "artifact_too_large"),
    CompileError: ErrorInfo(422, "compile_error"),
    UnauthenticatedError: ErrorInfo(401, "unauthorized"),
    PermissionDeniedError: ErrorInfo(403, "forbidden"),
    # A blob that failed its check answers as an evicted one does: a miss, with the reason.
    ArtifactSetAsideError: ErrorInfo(404, "not_found"),
    ArtifactNotFoundError: ErrorInfo(404, "not_found"),
    PayloadTooLargeError: ErrorInfo(413, "too_large"),
    ReportLimitError: ErrorInfo(429, "too_many_reported", retry=True),
    CompilerUnavailableError: ErrorInfo(503, "compiler_unavailable", retry=True),
    OverloadedError: ErrorInfo(503, "overloaded", retry=True),
    LockTimeoutError: ErrorInfo(503, "lock_timeout", retry=True),
    StoreFullError: ErrorInfo(507, "store_full"),
    # The bucket is down: retry soon (a replica's local blob cache still serves what it holds).
    StoreUnavailableError: ErrorInfo(503, "store_unavailable", retry=True),
    # PostgreSQL is down: retry soon (fetches this replica holds in memory are still served).
    DatabaseUnavailableError: ErrorInfo(503, "database_unavailable", retry=True),
    QuotaExceededError: ErrorInfo(507, "quota_exceeded"),
    # A fetch-only server (no NVRTC >= 13.3): asking again does not help, so no Retry-After.
    CannotCompileError: ErrorInfo(501, "cannot_compile"),
    CompileWorkerCrashedError: ErrorInfo(500, "compiler_crashed"),
    InvalidArtifactError: ErrorInfo(500, "invalid_artifact"),
    CorruptArtifactError: ErrorInfo(500, "corrupt_artifact"),
    ToolchainError: ErrorInfo(500, "toolchain_error"),
    KCacheError: ErrorInfo(500, "internal_error"),
}

_INTERNAL = ErrorInfo(500, "internal_error")


def error_info(exc: BaseException) -> ErrorInfo:
    """The table entry for ``exc`` (nearest class in its MRO), else a 500."""
    for cls in type(exc).__mro__:
        info = ERROR_TABLE.get(cls)
        if info is not None:
            return info
    return _INTERNAL


_log = logging.getLogger("kcache_server.errors")


def _driver_reason(exc: BaseException) -> str:
    """`` (driver: <first line>)`` for an error that replaced a driver's, for the log only."""
    driver = getattr(exc, "driver_error", None)
    if driver is None:
        return ""
    first = (str(getattr(driver, "orig", None) or driver).strip().splitlines() or [""])[0]
    return f" (driver: {type(driver).__name__}: {first[:300]})"


def error_body(exc: BaseException) -> dict[str, Any]:
    """The JSON body for ``exc``: ``error`` and ``detail``, plus the fields the error carries.

    A 500 says only its code and the request id: its text may hold SQL, paths or
    other callers' data. The traceback is logged here, under that id (one record),
    so no caller of this function can forget to.
    """
    info = error_info(exc)
    if info.status == 500:
        request_id = current_request_id()
        _log.error(
            "request %s failed with %s: %s: %s",
            request_id,
            info.code,
            type(exc).__name__,
            exc,
            exc_info=(type(exc), exc, exc.__traceback__),
        )
        return {
            "error": info.code,
            "detail": f"internal error; the server log has the details under request id {request_id}",
            "request_id": request_id,
        }
    # Overloaded, store full: expected conditions, one line each. Not a compile refused by a
    # server that cannot compile (501): its start said why once, and /metrics counts them.
    if info.status >= 500 and not isinstance(exc, CannotCompileError):
        _log.warning(
            "request %s answered %d %s: %s%s",
            current_request_id(),
            info.status,
            info.code,
            exc,
            _driver_reason(exc),
        )
    body: dict[str, Any] = {"error": info.code, "detail": str(exc)}
    if isinstance(exc, RecipeError | InvalidRequestError):
        body["field"] = exc.field
    if isinstance(exc, ArtifactSetAsideError) and exc.recipe_key:
        body["recipe_key"] = exc.recipe_key
    if isinstance(exc, CompileError):
        body["log"] = exc.log
        body["recipe_key"] = exc.recipe_key
        body["cached"] = exc.cached
    return body
