"""What the tests and the benchmarks share: free ports, real kcache servers, small recipes, waiting.

Tests import it as ``tests.support``; the benchmarks run as ``python bench/x.py`` and put
the repository root on ``sys.path`` first. Fixtures live in the ``conftest.py`` files and
build on what is here; nothing here is a fixture.

Only the standard library and httpx are imported at module level, so a client-only
install (and a benchmark) can import this module; what needs the server's packages
(uvicorn, SQLAlchemy, ``kcache_server``) or pytest imports it where it is used.

Every server started here is checked for tracebacks when it stops: a server in normal
operation logs none, and nothing else would notice one (a request still answers, the
test passes). :class:`ServerProcess` reads its log file, :class:`ServerThread` the
records logged in this process while it ran, on its event loop or on a thread of no
other server's loop (uvicorn's loggers do not propagate to the root, so they are
listened to as well). Their ``stop()`` (and ``check_log()``) raise
:class:`AssertionError` naming each exception; a test that provokes one on purpose
says so, around the provoking call with ``with server.tracebacks_allowed("Name",
reason=...)``, or for the server's whole life with ``server.allow_tracebacks(...)``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import httpx

__all__ = [
    "FAST",
    "KCACHE",
    "NEVER_FINISHES",
    "PG_ADMIN_URL",
    "QUIET",
    "ROOT",
    "TRACEBACK",
    "VECTOR_ADD",
    "ServerProcess",
    "ServerThread",
    "answers_200",
    "audit_rows",
    "free_port",
    "full_runs",
    "never_finishes",
    "pg_database",
    "sample_size",
    "tracebacks",
    "unique",
    "upgrade",
    "vector_add",
    "wait_until",
]

#: The repository root.
ROOT = Path(__file__).resolve().parents[1]
#: The console script a user runs (the venv's), not ``python -m``.
KCACHE = str(Path(sys.executable).with_name("kcache"))
#: A PostgreSQL role that may create databases; tests make their own databases under it.
PG_ADMIN_URL = os.environ.get(
    "KCACHE_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)


# ------------------------------------------------------------------------------ full runs
#: Set to "1" by ``pytest --slow`` (tests/conftest.py), before any test module is imported,
#: and so seen by the workers and commands the tests start as well.
SLOW_RUNS = "KCACHE_TESTS_SLOW"


def full_runs() -> bool:
    """Whether this is a ``--slow`` run: the tests marked ``slow`` and the property runs at
    their full size (CI runs it nightly). Otherwise each property run is a bounded,
    seeded sample that still fails where the property does."""
    return os.environ.get(SLOW_RUNS) == "1"


def sample_size(default: int, full: int) -> int:
    """``full`` in a ``--slow`` run, else ``default`` (a sample of the same property)."""
    return full if full_runs() else default


# ------------------------------------------------------------------------------ ports, names
def free_port() -> int:
    """A loopback port nobody listened on a moment ago (for servers in other processes).

    In-process servers bind port 0 themselves (:class:`ServerThread`), which cannot race.
    """
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def unique(prefix: str = "t") -> str:
    """A tag no other test run uses (put into a recipe, it makes the recipe's key new)."""
    return f"{prefix}-{uuid.uuid4().hex}"


# ------------------------------------------------------------------------------ recipes
#: A bounds-checked vector add, ``add(x, y, out, n)``: the core tests' and benchmarks' kernel.
VECTOR_ADD = """
extern "C" __global__ void add(const float* x, const float* y, float* out, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = x[i] + y[i];
}
"""

#: A template that never finishes instantiating: it runs into any compile time limit.
NEVER_FINISHES = (
    "template <int N, unsigned long long K> struct X {\n"
    "  enum : unsigned long long { v = X<N - 1, K * 2>::v + X<N - 1, K * 2 + 1>::v };\n"
    "};\n"
    "template <unsigned long long K> struct X<0, K> { enum : unsigned long long { v = K }; };\n"
    "__global__ void k(unsigned long long* o) { *o = X<60, 1>::v; }\n"
)


def vector_add(tag: str, target: str = "sm_80") -> dict[str, Any]:
    """A small, fast, valid recipe (kernel ``vadd``) as an API body; ``tag`` makes its key new."""
    return {
        "source": (
            f"// {tag}\n"
            'extern "C" __global__ void vadd(float* out, const float* a, const float* b, int n) {\n'
            "  int i = blockIdx.x * blockDim.x + threadIdx.x;\n"
            "  if (i < n) out[i] = a[i] + b[i];\n"
            "}\n"
        ),
        "target": target,
    }


def never_finishes(tag: str, target: str = "sm_80") -> dict[str, Any]:
    """A recipe of :data:`NEVER_FINISHES` as an API body; ``tag`` makes its key new."""
    return {"source": f"// {tag}\n{NEVER_FINISHES}", "target": target}


# ------------------------------------------------------------------------------ waiting
def wait_until(
    condition: Callable[[], object], what: str, timeout: float = 60.0, interval: float = 0.02
) -> None:
    """Return as soon as ``condition()`` is true; AssertionError naming ``what`` after ``timeout`` s.

    The timeout is a liveness bound (it fails only if the event never comes), not a timing.
    """
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


def answers_200(url: str) -> bool:
    """Whether ``url`` answers 200 right now (an unreachable server is a no, not an error)."""
    try:
        return httpx.get(url, timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def requests_counted(metrics: str, route: str, method: str, status: str) -> float:
    """``kcache_http_requests_total`` for one route, method and status, read from ``/metrics`` text."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = {"route": route, "method": method, "status": status}
    return sum(
        s.value
        for family in text_string_to_metric_families(metrics)
        if family.name == "kcache_http_requests"
        for s in family.samples
        if s.name.endswith("_total") and s.labels == wanted
    )


# ------------------------------------------------------------------------------ tracebacks
#: What opens every traceback Python prints (chained ones and exception groups too).
TRACEBACK = "Traceback (most recent call last)"
#: The line between two tracebacks of one chain: the next one is what was raised last.
_CHAINED = (
    "During handling of the above exception, another exception occurred:",
    "The above exception was the direct cause of the following exception:",
)
#: A traceback's last line: the exception's (qualified) name, then ``: message`` or nothing.
_EXCEPTION_LINE = re.compile(r"([A-Za-z_][\w.]*)(?::|$)")


def tracebacks(text: str) -> list[tuple[str, str]]:
    """``(exception name, traceback text)`` for each traceback (or chain of them) in ``text``.

    A chain (``During handling of the above exception ...``) counts once, by the
    exception raised last; an exception group once, by the group's name. A traceback
    whose exception line cannot be found (cut off, or interleaved with other output) is
    named ``"?"``, which no allowance covers.
    """
    lines = text.splitlines()
    found: list[tuple[str, str]] = []
    start: int | None = None  # where the chain being read began
    i = 0
    while i < len(lines):
        line = lines[i]
        at = line.find(TRACEBACK)
        if at < 0 or "|" in line[:at]:
            i += 1  # not one, or a sub-exception of a group: the group counts, by its name
            continue
        if start is None:
            start = i
        # The exception line starts where the traceback's own prefix ends (nothing, or an
        # exception group's "  | "), and unlike the frames it is not indented past it.
        prefix = line[:at].replace("+ Exception Group ", "| ").replace("Exception Group ", "")
        name, j = "?", i + 1
        while j < len(lines):
            rest = lines[j][len(prefix) :] if lines[j].startswith(prefix) else None
            if rest is not None and rest[:1] not in ("", " "):
                match = _EXCEPTION_LINE.match(rest)
                if match is not None and TRACEBACK not in rest:
                    name = match.group(1)
                break
            j += 1
        following = next((t.strip() for t in lines[j + 1 :] if t.strip()), "")
        if any(following.endswith(c) for c in _CHAINED):
            i = j + 1  # the chain goes on: judged by its last exception
            continue
        found.append((name, "\n".join(lines[start : j + 1])))
        start = None
        i = j + 1
    return found


def _allowed(name: str, allowed: Mapping[str, str]) -> bool:
    """Whether ``name`` (maybe qualified) is one of ``allowed`` (by its last part)."""
    short = name.rsplit(".", 1)[-1]
    return any(short == a.rsplit(".", 1)[-1] for a in allowed)


def _refuse_tracebacks(
    found: Sequence[tuple[str, str]], allowed: Mapping[str, str], where: str
) -> None:
    """AssertionError naming every traceback of ``found`` that ``allowed`` does not cover."""
    bad = [(name, text) for name, text in found if not _allowed(name, allowed)]
    if not bad:
        return
    names = ", ".join(sorted({name for name, _ in bad}))
    raise AssertionError(
        f"{where} logged {len(bad)} traceback(s) ({names}); a server logs none in normal "
        "operation (a test that provokes one calls allow_tracebacks(NAME, reason=...)). "
        f"The first:\n{_shortened(bad[0][1])}"
    )


def _shortened(text: str, lines: int = 40) -> str:
    """``text``'s first and last lines (a traceback's start says who logged it, its end what)."""
    every = text.splitlines()
    if len(every) <= 2 * lines:
        return text
    return "\n".join([*every[:lines], f"... ({len(every) - 2 * lines} lines) ...", *every[-lines:]])


class _TracebackRecords(logging.Handler):
    """The records of this process that carry a traceback: an ERROR with exc_info, or text with one."""

    def __init__(self) -> None:
        super().__init__(logging.NOTSET)
        self.records: list[logging.LogRecord] = []
        #: Records a server's check allowed: no other server's check counts them.
        self.excused: set[int] = set()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
        except Exception:  # a bad format string is the logger's bug, not a traceback
            message = str(record.msg)
        logged = record.exc_info is not None and record.exc_info[0] is not None
        if (logged and record.levelno >= logging.ERROR) or TRACEBACK in message:
            self.records.append(record)

    def listen(self) -> int:
        """Attach to the root and to uvicorn's loggers (again: each ``uvicorn.Config``
        reconfigures those); how many records were kept before now."""
        for name in ("", "uvicorn", "uvicorn.access"):
            logger = logging.getLogger(name)
            if self not in logger.handlers:
                logger.addHandler(self)
        return len(self.records)

    def judge(
        self, first: int, loop_thread: str, allowed: Mapping[str, str]
    ) -> list[tuple[str, str]]:
        """``(exception name, text)`` of each record since ``first`` that may be a server's,
        those ``allowed`` left out (and excused for every other server's check too).

        A record logged on another server's event-loop thread (named by
        :data:`_LOOP_THREAD`) is that server's; ``loop_thread`` is the asker's. A record
        of any other thread (an executor's, the audit writer's) may be anyone's.
        """
        found: list[tuple[str, str]] = []
        formatter = logging.Formatter("%(levelname)s %(name)s: %(message)s")
        for index in range(first, len(self.records)):
            record = self.records[index]
            name = record.threadName or ""
            if index in self.excused or (
                name.startswith(_LOOP_THREAD.format(port="")) and name != loop_thread
            ):
                continue
            text = formatter.format(record)
            parsed = tracebacks(text)
            if record.exc_info and record.exc_info[0] is not None:
                # The logged exception names the record whatever its text shows.
                parsed = [(record.exc_info[0].__name__, text)]
            parsed = parsed or [("?", text)]
            if all(_allowed(exception, allowed) for exception, _ in parsed):
                self.excused.add(index)
            found.extend(parsed)
        return found


_RECORDS = _TracebackRecords()
#: The name of a :class:`ServerThread`'s event-loop thread (its port makes it unique
#: among the servers running at one time).
_LOOP_THREAD = "kcache-test-server-{port}"


@contextlib.contextmanager
def _allowing(
    server: ServerThread | ServerProcess, names: Sequence[str], reason: str
) -> Iterator[None]:
    """``server.allowed`` widened by ``names`` for what is logged within the block.

    What was logged before is judged first, without them; what the block logged is
    judged at its end, with them (a server logs a request's traceback before answering).
    """
    server.check_log()
    saved = dict(server.allowed)
    server.allowed.update(dict.fromkeys(names, reason))
    try:
        yield
    finally:
        try:
            server.check_log()
        finally:
            server.allowed = saved


# ------------------------------------------------------------------------------ servers
#: The nginx the tests start (Debian's, installed by scripts/ensure-services).
NGINX = os.environ.get("KCACHE_TEST_NGINX") or shutil.which("nginx") or "/usr/sbin/nginx"


class NginxProcess:
    """nginx in the foreground on a free loopback port, with ``root/nginx.conf``.

    A subclass writes its configuration (listening on :attr:`port`, answering
    ``/healthz``), then calls :meth:`start`, which returns once nginx answers.
    """

    def __init__(self, root: Path) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.root = root
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config = root / "nginx.conf"

    def start(self) -> None:
        """Run nginx on :attr:`config`; RuntimeError with its stderr if it exits instead."""
        # -e: the compiled-in error log (/var/log/nginx) is opened before the config is read.
        argv = [
            NGINX,
            "-p",
            str(self.root),
            "-e",
            str(self.root / "error.log"),
            "-c",
            str(self.config),
        ]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        wait_until(
            lambda: self.proc.poll() is not None or answers_200(f"{self.url}/healthz"),
            "nginx to answer",
            timeout=30,
        )
        if self.proc.poll() is not None:
            raise RuntimeError(f"nginx exited: {self.proc.communicate()[1].decode()}")

    def stop(self) -> None:
        """Stop nginx (it was started)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(15)


class ServerThread:
    """``create_app(settings)`` served by a real uvicorn on an ephemeral loopback port, in a thread.

    For tests that look inside the server (its state, its settings); :class:`ServerProcess`
    runs the real ``kcache serve`` command instead.
    """

    def __init__(self, settings: Any) -> None:
        import uvicorn
        from kcache_server import create_app
        from kcache_server.serving.app import serving_app

        self.settings = settings
        self.app = create_app(settings)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = int(sock.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            serving_app(self.app),
            log_level="warning",
            lifespan="on",
            timeout_graceful_shutdown=10,
            http="httptools",  # as `kcache serve` runs it
            access_log=settings.access_log,
        )
        self.server = uvicorn.Server(config)
        #: Exceptions this server may log with a traceback: name -> why (allow_tracebacks).
        self.allowed: dict[str, str] = {}
        self._records_from = _RECORDS.listen()  # after the Config: it reconfigures logging
        self.thread = threading.Thread(
            target=self.server.run,
            kwargs={"sockets": [sock]},
            daemon=True,
            name=_LOOP_THREAD.format(port=self.port),  # whose records are whose (check_log)
        )
        self.thread.start()
        try:
            wait_until(
                lambda: self.server.started or not self.thread.is_alive(),
                "the test server to start",
            )
        except AssertionError:
            self.stop()
            raise
        if not self.server.started:
            raise RuntimeError("the test server did not start (its thread ended)")

    @property
    def state(self) -> Any:
        """The app's ServerState."""
        return self.app.state.kcache

    def client(self, token: str | None = None, **kwargs: Any) -> httpx.Client:
        """A client for this server."""
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=120, **kwargs)

    def allow_tracebacks(self, *names: str, reason: str) -> None:
        """Let this server log tracebacks of these exceptions from now on (``reason``: why)."""
        self.allowed.update(dict.fromkeys(names, reason))

    @contextlib.contextmanager
    def tracebacks_allowed(self, *names: str, reason: str) -> Iterator[None]:
        """Let this server log tracebacks of these exceptions within the block only (``reason``: why)."""
        with _allowing(self, names, reason):
            yield

    def check_log(self) -> None:
        """AssertionError for each traceback not allowed, logged since the last check.

        What this server's event loop logged is checked, and what other threads of the
        process logged meanwhile (its executor's and writers', or anyone's: a record
        says its thread, not its server); not what another server's loop logged.
        """
        first, self._records_from = self._records_from, len(_RECORDS.records)
        _refuse_tracebacks(
            _RECORDS.judge(first, self.thread.name, self.allowed),
            self.allowed,
            f"the test server at {self.url}",
        )

    def stop(self) -> None:
        """Graceful shutdown (workers stopped, audit flushed); AssertionError if it logged a traceback."""
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.check_log()


class ServerProcess:
    """``kcache serve`` in its own process on a free loopback port; its output goes to ``log``.

    ``env`` replaces the environment (default: this process's); ``args`` are further
    ``serve`` flags. Where how the server is started is what a test checks (a script, an
    image's CMD), ``command`` gives that command line for the port it is to listen on, in
    place of ``python -m kcache.cli serve ...`` and its flags; it must serve ``data_dir``
    (through ``KCACHE_DATA_DIR`` in ``env``, say) and answer on 127.0.0.1 at that port.
    Use it as a context manager, or call :meth:`start` and :meth:`stop`.
    :meth:`stop` reads what the process wrote to ``log`` since it was launched, and
    fails on a traceback there that :meth:`allow_tracebacks` did not allow.
    """

    def __init__(
        self,
        data_dir: Path,
        *,
        db_url: str | None = None,
        workers: int | None = None,
        env: Mapping[str, str] | None = None,
        args: Sequence[str] = (),
        log: Path | None = None,
        cwd: Path | None = None,
        command: Callable[[int], Sequence[str]] | None = None,
    ) -> None:
        if command is not None and (db_url or workers is not None or args):
            raise ValueError("command replaces serve's flags: put db_url, workers, args in it")
        self.data_dir = data_dir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log or data_dir / f"serve-{self.port}.log"
        self.argv = [
            sys.executable,
            "-m",
            "kcache.cli",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--data-dir",
            str(data_dir),
            *(["--db-url", db_url] if db_url else []),
            *(["--workers", str(workers)] if workers is not None else []),
            *args,
        ]
        if command is not None:
            self.argv = list(command(self.port))
        self.env = dict(os.environ if env is None else env)
        self.cwd = cwd
        self.proc: subprocess.Popen[bytes] | None = None
        #: Exceptions this server may log with a traceback: name -> why (allow_tracebacks).
        self.allowed: dict[str, str] = {}
        #: Where the log not yet checked for tracebacks starts (it is appended to).
        self._unchecked: int | None = None

    def start(self, timeout: float = 60.0, ready: str = "/healthz") -> ServerProcess:
        """:meth:`launch`, then :meth:`wait_ready`."""
        self.launch()
        self.wait_ready(timeout, ready)
        return self

    def launch(self) -> None:
        """Start the process and return at once (start several, then wait for each)."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as log:
            if self._unchecked is None:  # a relaunch after a stop that checked keeps going
                self._unchecked = log.tell()
            self.proc = subprocess.Popen(
                self.argv, env=self.env, cwd=self.cwd, stdout=log, stderr=subprocess.STDOUT
            )

    def wait_ready(self, timeout: float = 60.0, ready: str = "/healthz") -> None:
        """Until ``ready`` answers 200; RuntimeError with the log's end if it exits or never does."""
        proc = self.proc
        assert proc is not None, "launch() first"
        try:
            wait_until(
                lambda: proc.poll() is not None or answers_200(self.url + ready),
                f"{self.url}{ready} to answer 200",
                timeout,
                interval=0.1,
            )
        except AssertionError as exc:
            self._terminate()
            self._unchecked = None  # the error shows the log; a caller may skip on it
            raise RuntimeError(f"{exc}; the server's log ends:\n{self.log_tail()}") from None
        if proc.poll() is not None:
            self._unchecked = None
            raise RuntimeError(
                f"kcache serve exited {proc.returncode}; its log ends:\n{self.log_tail()}"
            )

    def log_tail(self, chars: int = 3000) -> str:
        """The end of the server's output."""
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except FileNotFoundError:
            return ""

    def allow_tracebacks(self, *names: str, reason: str) -> None:
        """Let this server log tracebacks of these exceptions from now on (``reason``: why)."""
        self.allowed.update(dict.fromkeys(names, reason))

    @contextlib.contextmanager
    def tracebacks_allowed(self, *names: str, reason: str) -> Iterator[None]:
        """Let this server log tracebacks of these exceptions within the block only (``reason``: why)."""
        with _allowing(self, names, reason):
            yield

    def stop(self) -> None:
        """SIGTERM (a graceful shutdown: the audit is flushed), then SIGKILL if it lingers;
        then AssertionError if its log has a traceback :meth:`allow_tracebacks` did not allow."""
        self._terminate()
        self.check_log()

    def check_log(self) -> None:
        """AssertionError for each traceback not allowed in the log written since the last check."""
        if self._unchecked is None:
            return
        try:
            with self.log.open("rb") as log:
                log.seek(self._unchecked)
                text = log.read().decode(errors="replace")
                self._unchecked = log.tell()
        except FileNotFoundError:
            return
        _refuse_tracebacks(
            tracebacks(text), self.allowed, f"kcache serve at {self.url} ({self.log})"
        )

    def _terminate(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(15)

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


# ------------------------------------------------------------------------------ databases
def upgrade(url: str) -> None:
    """Bring a database to the head revision with the real command."""
    result = subprocess.run(
        [KCACHE, "db", "upgrade", "--db-url", url], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr


@contextlib.contextmanager
def pg_database(prefix: str = "kcache_test") -> Iterator[str]:
    """The URL of a new, empty PostgreSQL database, dropped afterwards.

    Skips the test where PostgreSQL is not reachable at :data:`PG_ADMIN_URL`.
    """
    import pytest
    import sqlalchemy as sa

    admin = sa.create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
    name = f"{prefix}_{uuid.uuid4().hex[:16]}"
    try:
        with admin.connect() as conn:
            conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    except sa.exc.OperationalError as exc:
        admin.dispose()
        pytest.skip(f"PostgreSQL is not reachable at {PG_ADMIN_URL}: {exc}")
    url = sa.engine.make_url(PG_ADMIN_URL).set(database=name).render_as_string(hide_password=False)
    try:
        yield url
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def audit_rows(url: str, **where: Any) -> list[Any]:
    """Rows of ``audit_events`` in the database at ``url`` matching ``where`` (column = value)."""
    import sqlalchemy as sa

    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            query = "SELECT * FROM audit_events"
            if where:
                query += " WHERE " + " AND ".join(f"{k} = :{k}" for k in where)
            return list(conn.execute(sa.text(query), where).all())
    finally:
        engine.dispose()


# ------------------------------------------------------------------------------ client settings
if TYPE_CHECKING:
    from kcache_client import ClientSettings, RetryPolicy

    FAST: RetryPolicy
    QUIET: ClientSettings


def __getattr__(name: str) -> Any:
    """``FAST`` and ``QUIET``, made when a test first imports them (and the same ones after).

    ``FAST`` is the retry policy of a client whose server fails on purpose, or is gone:
    three quick tries (milliseconds apart) within 3 s, not a training job's minute.
    ``QUIET`` is the client settings of the environment that send no audit events and
    retry by ``FAST``.

    Made on first import, not when this module loads: ``tests/conftest.py`` imports this
    module before it sets the run's trusted key and pin file, which ``QUIET`` reads from
    the environment; and the module level keeps to the standard library and httpx.
    """
    made = globals()
    if name == "FAST":
        from kcache_client import RetryPolicy

        made[name] = RetryPolicy(attempts=3, base_s=0.01, cap_s=0.05, budget_s=3.0)
    elif name == "QUIET":
        from kcache_client import ClientSettings

        fast = made["FAST"] if "FAST" in made else __getattr__("FAST")
        made[name] = ClientSettings.from_env(send_events=False, retry=fast)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return made[name]


#: What a clone of the project holds that its builds read: the three packages' trees,
#: the top-level migrations/ the server's package links to, and the files at the root.
SOURCE_TREES = ("kcache", "client", "server", "migrations")
SOURCE_FILES = ("pyproject.toml", "README.md", "LICENSE", "MANIFEST.in")


def copy_sources(dest: Path, *more: str) -> None:
    """Copy what a build of the project reads (and the trees ``more`` names) to ``dest``.

    Links stay links (``symlinks=True``): the client's and server's ``_version.py`` and
    LICENSE and the server's ``migrations/`` are links, and the builds must turn them into
    files. Caches and earlier builds are left behind.
    """
    for name in SOURCE_FILES:
        shutil.copy2(ROOT / name, dest / name)
    skip = shutil.ignore_patterns("__pycache__", "build", "dist", "*.egg-info", ".kcache")
    for name in (*SOURCE_TREES, *more):
        shutil.copytree(ROOT / name, dest / name, symlinks=True, ignore=skip)
