"""``create_app(settings)``: the one place the server is wired together into a FastAPI app.

Every part is built here from the one :class:`~kcache_server.settings.Settings`,
every route comes from the one list :data:`kcache_server.routes.ROUTERS`, and one
lifespan starts and stops what runs in the background.

Start-up order: open the database, refuse an out-of-date schema (a brand-new
SQLite file is created at the head revision, so ``kcache serve`` works out of the
box) or a lost one (blobs but no tables: ``--recreate-index``), refuse an unsafe
bind, build the backends, the audit writer, the metrics and the audit retention;
the lifespan then starts the compile workers, the audit writer, the retention
worker, the evictor, the withdrawals follower and the verifier, and stops them in the
reverse order on shutdown.

Every request passes, outermost first: :class:`_RequestIds` (an id on every
response; an unexpected exception becomes a 500 carrying only that id, its
traceback logged under it), the request metrics, :class:`~kcache_server.auth.AuthGate`
(the token, checked before any body is read), :class:`_BodyLimit` (bodies counted
against ``max_request_bytes`` as they stream in),
:class:`~kcache_server.serving.query_params.KnownQueryParameters` (a query parameter the
route does not take is a 422), then the routes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import AsyncIterator

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import Match

from kcache.errors import KCacheError
from kcache_server import migrate
from kcache_server.asgi_types import ASGIApp, Message, Receive, Scope, Send
from kcache_server.auditing.retention import RetentionWorker
from kcache_server.auditing.writer import AuditLog, AuditRecord
from kcache_server.auth import AuthGate, TokenStore
from kcache_server.backends import open_backends, open_settings_database
from kcache_server.errors import (
    InsecureBindError,
    PayloadTooLargeError,
    error_body,
    error_info,
)
from kcache_server.eviction import install_eviction
from kcache_server.metrics import MetricsMiddleware, ServerMetrics, pool_sampler, store_sampler
from kcache_server.request_ids import HEADER, new_request_id, request_id_var
from kcache_server.routes import ROUTERS
from kcache_server.routes.health import install_readiness_gauges
from kcache_server.schemas import invalid_request
from kcache_server.security_headers import secure
from kcache_server.serving.artifact_fastpath import ArtifactFastPath
from kcache_server.serving.edge_audit import install_edge_audit
from kcache_server.serving.openapi import install_openapi
from kcache_server.serving.query_params import KnownQueryParameters
from kcache_server.serving.resolve_fastpath import ResolveFastPath
from kcache_server.settings import Settings
from kcache_server.state import ServerState
from kcache_server.verification import install_verification
from kcache_server.withdrawals import install_withdrawals

__all__ = ["SETTINGS_ENV", "check_bind", "create_app", "create_app_from_env", "serving_app"]

#: ``kcache serve --workers N`` hands its settings to each uvicorn worker through this variable.
SETTINGS_ENV = "KCACHE_SERVER_SETTINGS_JSON"


log = logging.getLogger(__name__)


def check_bind(settings: Settings, tokens: TokenStore) -> None:
    """Refuse a non-loopback bind that no token protects, unless ``force_insecure``.

    Asks the database first whatever the bind: a process that starts where tokens exist
    needs one from then on, even if they are all revoked later (:mod:`kcache_server.auth`).
    """
    guarded = tokens.any_active()
    if settings.loopback or settings.force_insecure or guarded:
        return
    raise InsecureBindError(
        f"refusing to serve on {settings.host} without tokens: anyone who can reach it could compile code "
        "here. Create a token with `kcache token create NAME --scope compile` (clients send it as "
        "KCACHE_TOKEN), or bind 127.0.0.1, or pass --force-insecure (KCACHE_FORCE_INSECURE=1) if a "
        "proxy in front authenticates"
    )


class _RequestIds:
    """An ``X-Request-ID`` on every response; an unhandled exception becomes a bare 500.

    Every response also gets ``X-Content-Type-Options: nosniff``, and an HTML one a
    ``Content-Security-Policy`` when it has none (:mod:`kcache_server.security_headers`).

    The id is also the context variable :data:`~kcache_server.request_ids.request_id_var`
    while the request runs, so error bodies and log lines anywhere can name it.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = new_request_id()
        token = request_id_var.set(request_id)
        header = (HEADER, request_id.encode())
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message["headers"] = secure([*message.get("headers", ()), header])
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except ClientDisconnect:
            # The client went away before its body was read whole (a load generator ending
            # its run, a rank killed): nobody is left to answer, and nothing went wrong here.
            log.debug("request %s: the client disconnected before its body was read", request_id)
        except Exception as exc:
            body = error_body(exc)  # logs the traceback under the request id
            if not started:
                await JSONResponse(body, error_info(exc).status)(scope, receive, send_with_id)
            # Handled here: re-raising would log the same traceback again, without the id.
        finally:
            request_id_var.reset(token)


class _BodyLimit:
    """413 for request bodies over the limit, by Content-Length or by counting a streamed body.

    A chunked body (no Content-Length) is counted as it arrives and refused at the
    first byte past the limit, so no request holds more than ``limit`` bytes.
    """

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > self.limit:
                exc = PayloadTooLargeError(
                    f"the request body is {int(value)} bytes; the limit is {self.limit} (max_request_bytes)"
                )
                await JSONResponse(error_body(exc), 413)(scope, receive, send)
                return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise PayloadTooLargeError(
                    f"the request body is over the limit of {self.limit} bytes (max_request_bytes)"
                )
            return message

        await self.app(scope, counted, send)


def _error_response(exc: BaseException) -> JSONResponse:
    info = error_info(exc)
    headers = {"Retry-After": str(getattr(exc, "retry_after", 5))} if info.retry else None
    return JSONResponse(error_body(exc), info.status, headers=headers)


async def _kcache_error(_: Request, exc: Exception) -> JSONResponse:
    return _error_response(exc)


async def _validation_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return _error_response(invalid_request(exc.errors()))


def allowed_methods(request: Request) -> list[str]:
    """Every method some route serves at the request's path, sorted.

    Starlette answers a 405 with the methods of the first route whose path matched,
    but one path can have several routes (``GET`` and ``HEAD /v1/blobs/{digest}``,
    ``GET``/``POST``/``DELETE /v1/pins``): ``Allow`` must name them all.
    """
    methods: set[str] = set()
    routes = list(request.app.router.routes)
    while routes:
        route = routes.pop()
        # FastAPI >= 0.160 mounts each included router as one route holding its own.
        inner = getattr(route, "original_router", None)
        if inner is not None:
            routes.extend(inner.routes)
            continue
        match, _ = route.matches(request.scope)
        if match is not Match.NONE:
            methods.update(getattr(route, "methods", None) or ())
    return sorted(methods)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    if isinstance(exc.__cause__, KCacheError):  # FastAPI wraps errors raised while reading the body
        return _error_response(exc.__cause__)
    headers = dict(exc.headers or {})
    detail = str(exc.detail)
    if exc.status_code == 405:
        allowed = allowed_methods(request)
        headers["Allow"] = ", ".join(allowed)
        detail = f"{request.method} is not allowed here; this path serves {', '.join(allowed)}"
    codes = {404: "not_found", 405: "method_not_allowed"}
    return JSONResponse(
        {"error": codes.get(exc.status_code, "http_error"), "detail": detail},
        exc.status_code,
        headers=headers or None,
    )


async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
    # Reached only for an exception raised outside _RequestIds (it handles the rest).
    return JSONResponse(error_body(exc), 500)


def _count_lookups(audit: AuditLog, metrics: ServerMetrics) -> None:
    """Every audit record is also counted in the Prometheus metrics, and so is every dropped row."""

    def count(
        record: AuditRecord,
    ) -> None:  # a row standing for several (the edge log's) counts each
        metrics.lookup(record.outcome, record.tier, latency_ms=record.latency_ms, n=record.count)

    def dropped(_: AuditRecord, reason: str) -> None:
        metrics.audit_rows_dropped.labels(reason=reason).inc()

    audit.listeners.append(count)
    audit.drop_listeners.append(dropped)
    audit.lookup_listeners.append(metrics.kernel_lookups)  # the one hit rate, as recorded


def create_app(settings: Settings | None = None) -> FastAPI:
    """The kcache server application for ``settings`` (default: from the environment)."""
    settings = settings or Settings()
    db = open_settings_database(settings)
    migrate.prepare_database(settings, db)  # creates a first SQLite database; refuses a lost index
    tokens = TokenStore(db, settings.auth_cache_s)
    check_bind(settings, tokens)
    backends = open_backends(settings, db)
    # One of several uvicorn workers: its samples say which (see kcache_server.metrics).
    worker = str(os.getpid()) if settings.workers > 1 else None
    metrics = ServerMetrics(
        toolchain=backends.toolchain.id, compiles=backends.toolchain.compiles, worker=worker
    )
    metrics.add_sampler(store_sampler(db, metrics))
    metrics.add_sampler(pool_sampler(backends.compiler, metrics))
    audit = AuditLog(db, settings.audit.flush_s)
    _count_lookups(audit, metrics)
    retention = RetentionWorker(db, settings.audit.retention_days, settings.audit.rollup_interval_s)
    state = ServerState(
        settings=settings,
        backends=backends,
        tokens=tokens,
        audit=audit,
        metrics=metrics,
        retention=retention,
    )
    evictor = install_eviction(state)  # refuses water marks that make no sense
    verifier, verify_pool = install_verification(state)
    withdrawals = install_withdrawals(state)  # in every process, whatever else is on
    edge_log = install_edge_audit(state)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state.limiter = anyio.CapacityLimiter(settings.request_threads)
        await anyio.to_thread.run_sync(backends.compiler.start)
        audit.start()
        if edge_log is not None:
            edge_log.start()
        retention.start()
        evictor.start()
        withdrawals.start()
        verifier.start()
        try:
            yield
        finally:
            await anyio.to_thread.run_sync(verifier.close)
            if verify_pool is not None:
                await anyio.to_thread.run_sync(verify_pool.close)
            await anyio.to_thread.run_sync(withdrawals.close)
            await anyio.to_thread.run_sync(evictor.close)
            await anyio.to_thread.run_sync(retention.close)
            if edge_log is not None:
                await anyio.to_thread.run_sync(edge_log.close)
            await anyio.to_thread.run_sync(audit.close)
            await anyio.to_thread.run_sync(backends.compiler.close)
            db.dispose()

    app = FastAPI(
        title="kcache",
        version="0.1.0",
        summary="Content-addressed JIT CUDA kernel cache",
        description="Resolve recipes to cubins compiled once with NVRTC; fetch them by recipe key or digest.",
        lifespan=lifespan,
        # No Swagger UI or ReDoc: FastAPI's pages load their scripts from a public CDN, on
        # the origin whose dashboard holds a bearer token. The contract is /openapi.json.
        docs_url=None,
        redoc_url=None,
    )
    app.state.kcache = state
    app.state.evictor = evictor
    app.state.verifier = verifier
    app.state.withdrawals = withdrawals
    install_openapi(app, state)
    install_readiness_gauges(app, state)  # kcache_ready is current at every scrape
    for router in ROUTERS:
        app.include_router(router)
    # Middleware added first runs innermost: unknown query parameters refused, the body
    # limit, then the token gate (before any body is read), then the request metrics, then
    # request ids.
    app.add_middleware(KnownQueryParameters, router=app.router)
    app.add_middleware(_BodyLimit, limit=settings.max_request_bytes)
    app.add_middleware(AuthGate, tokens=tokens)
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    app.add_middleware(_RequestIds)
    app.add_exception_handler(KCacheError, _kcache_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
    return app


def serving_app(app: FastAPI) -> ArtifactFastPath:
    """What uvicorn serves: ``app`` behind the fetch-by-key and resolve-hit fast paths.

    The fast paths sit outside the framework (even outside FastAPI's own ``__call__``),
    so a warm fetch costs a few microseconds of Python and a resolve hit little more
    than reading its recipe; everything else reaches ``app``.
    """
    state = app.state.kcache
    return ArtifactFastPath(ResolveFastPath(app, state), state)


def create_app_from_env() -> ArtifactFastPath:
    """Factory for uvicorn workers: settings from ``$KCACHE_SERVER_SETTINGS_JSON``, else the environment."""
    raw = os.environ.get(SETTINGS_ENV)
    return serving_app(create_app(Settings.model_validate(json.loads(raw)) if raw else Settings()))
