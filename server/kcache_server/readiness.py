"""Readiness checks of the backends a server depends on, each bounded in time.

``/readyz`` (:mod:`kcache_server.routes.health`) asks the database and, with a
``store_url``, the bucket (the store the server's store keeps copies of). A backend that is down can answer at once (connection
refused) or never (a stopped process, a black-holed network: the connection opens
and no answer comes), so each check is a :class:`BoundedCheck`:

- it runs on a thread of its own and the probe waits for it at most ``timeout_s``;
  past that the check reads ``failed: ... did not answer within N s``;
- at most one runs at a time: probes that arrive while one is out wait for that one
  (up to their own deadline), so a hung backend costs one thread, not one per probe;
- a result is kept for ``ttl_s``: load balancers probe every replica every few
  seconds, and the bucket is asked at most once per ``ttl_s`` whatever they do.

The bucket's check is its store's :meth:`~kcache.store.base.ArtifactStore.probe` (for
S3, a listing of at most one name, never retried, with its own timeout); the database's is
``SELECT 1`` and its schema's revision, which must be the one this server started with (a
database dropped and recreated empty, or restored from an older backup, answers ``SELECT 1``
while every request would fail). What a check says is for anyone who can reach the port: it names what failed and what to do, never a
driver's or the bucket's error text (those go to the server log).

The compiler's checks (:func:`compiler_checks`) ask nothing remote: the compile workers
running and their confinement. A server that cannot compile (no NVRTC >= 13.3:
:mod:`kcache_server.compiler_presence`) reads ``degraded`` on both, with the reason:
it is ready, because what it is for then is serving fetches, and a load balancer that
took it out of service would stop those too. A compile sent to it answers 501
``cannot_compile`` whatever the probes say.
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time
from collections.abc import Callable

import sqlalchemy as sa

from kcache.errors import BucketMissingError, StoreUnavailableError
from kcache.store.base import ArtifactStore
from kcache_server.backends import Backends
from kcache_server.compile_pool import ProcessPoolCompiler
from kcache_server.migrate import script_head
from kcache_server.request_ids import current_request_id

__all__ = ["BUCKET_TTL_S", "BoundedCheck", "Readiness", "compiler_checks"]

log = logging.getLogger(__name__)

#: How long the bucket's answer is kept (seconds): a few probes' worth.
BUCKET_TTL_S = 3.0


class BoundedCheck:
    """A check of one backend that never makes its caller wait past ``timeout_s``.

    ``check`` returns the result (``ok ...`` or ``failed: ...``) and may block; it runs
    on a daemon thread, one at a time, and its result is kept for ``ttl_s`` (0: every
    call that finds none running starts one).
    """

    def __init__(
        self,
        name: str,
        check: Callable[[], str],
        *,
        timeout_s: float,
        ttl_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self._check = check
        self.timeout_s = timeout_s
        self.ttl_s = ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._result: str | None = None
        self._at = 0.0
        self._running: threading.Event | None = None

    def status(self) -> str:
        """The check's result: kept, fresh, or ``failed`` once ``timeout_s`` passed without one."""
        with self._lock:
            if self._result is not None and self._clock() - self._at < self.ttl_s:
                return self._result
            done = self._running
            if done is None:
                done = self._running = threading.Event()
                context = contextvars.copy_context()  # the request id, for the log lines
                threading.Thread(
                    target=context.run,
                    args=(self._run, done),
                    name=f"kcache-ready-{self.name}",
                    daemon=True,
                ).start()
        if done.wait(self.timeout_s):
            with self._lock:
                if self._result is not None:
                    return self._result
        return _no_answer(self.name, self.timeout_s)

    def _run(self, done: threading.Event) -> None:
        try:
            result = self._check()
        except Exception as exc:  # a check's own failure is a failed check, never a 500
            log.warning("readyz: the %s check raised %s: %s", self.name, type(exc).__name__, exc)
            result = f"failed: the {self.name} check failed (the server log says why)"
        with self._lock:
            self._result = result
            self._at = self._clock()
            self._running = None
        done.set()


def _no_answer(name: str, timeout_s: float) -> str:
    """What a check says of a backend that gave no answer within ``timeout_s`` (logged too)."""
    log.warning(
        "readyz %s: the %s did not answer within %g s", current_request_id(), name, timeout_s
    )
    return f"failed: the {name} did not answer within {timeout_s:g} s"


def _database(db: sa.Engine, head: str | None) -> str:
    """``SELECT 1``, then the schema's revision against ``head`` (None: not checked)."""
    revisions: list[str] | None = None
    try:
        with db.connect() as conn:
            conn.execute(sa.text("SELECT 1"))
            if head is not None:
                try:
                    found = conn.execute(sa.text("SELECT version_num FROM alembic_version"))
                    revisions = sorted(found.scalars())
                except sa.exc.DBAPIError:  # no such table: a database recreated empty
                    revisions = []
    except Exception as exc:  # any driver error means not ready
        # The driver's text can hold the host, user and database name: log it, do not answer it.
        request_id = current_request_id()
        cause = getattr(exc, "driver_error", None) or exc  # DatabaseUnavailableError's original
        log.warning(
            "readyz %s: the database check failed: %s: %s", request_id, type(cause).__name__, cause
        )
        return (
            "failed: database unreachable (the server log has the error under request id "
            f"{request_id})"
        )
    if head is not None and revisions != [head]:
        have = f"revision {', '.join(revisions)}" if revisions else "no kcache schema"
        return (
            f"failed: the database has {have}, this server revision {head}: it was replaced "
            "or migrated since the server started; restore it, or run `kcache db upgrade` "
            "and restart the server"
        )
    return "ok"


def _bucket(bucket: ArtifactStore, timeout_s: float) -> str:
    """The bucket's probe; its own timeout is ``timeout_s`` (the check's bound, see Backends).

    A probe that gave up at that timeout met a bucket that did not answer (a stopped
    process, a black hole): said as the bound's own failure, whichever of the two
    deadlines came first, not as a bucket that refused or cannot be reached.
    """
    started = time.monotonic()
    try:
        bucket.probe()  # logs the bucket's error itself
    except StoreUnavailableError as exc:
        if time.monotonic() - started >= timeout_s:
            return _no_answer("bucket", timeout_s)
        if isinstance(exc, BucketMissingError):  # the store named the cause and the setting
            return f"failed: {exc.detail}; compiles and fetches of blobs this replica holds no copy of answer 503 until it does"
        return (
            "failed: the bucket cannot be reached or refuses this server's credentials "
            f"(the server log says why, near request id {current_request_id()}); fetches of "
            "blobs this replica holds no copy of answer 503 until it is back"
        )
    return "ok"


class Readiness:
    """The bounded checks of one server's backends (built once per app, with its state)."""

    def __init__(self, backends: Backends, *, timeout_s: float) -> None:
        head = script_head()  # read once: the scripts this server was started with
        self.database = BoundedCheck(
            "database", lambda: _database(backends.db, head), timeout_s=timeout_s
        )
        remote = backends.store.remote
        self.bucket = (
            BoundedCheck(
                "bucket",
                lambda: _bucket(remote, timeout_s),
                timeout_s=timeout_s,
                ttl_s=BUCKET_TTL_S,
            )
            if remote is not None
            else None
        )


def compiler_checks(compiler: ProcessPoolCompiler, sandbox_mode: str) -> dict[str, str]:
    """``compile_workers`` and ``compile_sandbox`` for ``/readyz`` (see the module docstring).

    ``sandbox_mode`` is the setting in force (``Settings.compile_sandbox_mode``), named
    when workers run unconfined by choice.
    """
    toolchain = compiler.toolchain
    if not toolchain.compiles:
        degraded = f"degraded: this server cannot compile and serves fetches only: {toolchain.cannot_compile}"
        return {
            "compile_workers": degraded,
            "compile_sandbox": "degraded: no compile worker runs here (this server cannot compile)",
        }
    alive = compiler.alive
    workers = f"ok ({alive} running)" if alive else "failed: no compile worker is running"
    return {"compile_workers": workers, "compile_sandbox": _sandbox(compiler, sandbox_mode)}


def _sandbox(compiler: ProcessPoolCompiler, sandbox_mode: str) -> str:
    """Whether compile workers run confined by Landlock.

    ``degraded`` (the operator allowed unconfined workers: compile_sandbox best-effort
    or off) does not make the server unready, but says so on every probe; with
    ``required`` an unconfined worker never starts, so this never reads degraded then.
    """
    status = compiler.sandbox
    if status is None:
        return "failed: no compile worker has reported its confinement yet"
    if status.active:
        return f"ok ({status.detail})"
    return (
        f"degraded: {status.detail} (compile_sandbox={sandbox_mode}); "
        "NVRTC in the workers can open any file this server can read"
    )
