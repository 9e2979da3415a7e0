"""Everything a ``KernelCache`` can be told, in one object: :class:`ClientSettings`.

Read from the environment (design §7) by :meth:`ClientSettings.from_env`, whose
arguments override it; or built directly. A plain dataclass rather than
pydantic-settings: the client is installed into training images and keeps its
dependencies to filelock, tqdm and httpx (only for a caller's own ``httpx.Client``).

Local compiles default to on when no server is configured (nothing else could
compile a miss) and to off when one is: a worker that silently compiled for itself
while its server is down would hide the outage and key with its own NVRTC.
``KCACHE_LOCAL_COMPILE`` or ``local_compile=`` decide either way.

Every call to the server is bounded (:class:`RetryPolicy`): each try by a deadline
over connect, headers and body (``KCACHE_REQUEST_DEADLINE_S``, 60 s; a resolve, which
may wait for a compile, ``KCACHE_COMPILE_DEADLINE_S``, 900 s), the tries and the waits
between them by the retry budget (``KCACHE_RETRY_BUDGET_S``, 60 s), and an artifact's
bytes by ``max_artifact_bytes`` (``KCACHE_CLIENT_MAX_ARTIFACT_BYTES``, 256 MiB).
"""

from __future__ import annotations

import json
import math
import os
import random
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal
from urllib.parse import urlsplit

from kcache._env import env_flag
from kcache.dirs import absolute_path
from kcache.dirs import cache_dir as default_cache_dir
from kcache.errors import KCacheError, RecipeError
from kcache.eviction import parse_size
from kcache.targets import parse_target
from kcache_client._trust import default_known_servers
from kcache_client._waits import Timeouts, Waits

__all__ = [
    "DEFAULT_MAX_ARTIFACT_BYTES",
    "DEFAULT_TIMEOUT",
    "ENVIRONMENT",
    "ClientSettings",
    "RetryPolicy",
    "max_artifact_bytes_from_env",
    "timeout_from_env",
]

#: A compile can take minutes on a cold server; connecting should not. (Each read waits
#: at most this long for the next bytes; a try as a whole is bounded by RetryPolicy.)
DEFAULT_TIMEOUT = Waits(connect=5.0, read=600.0, write=600.0)

#: The largest artifact a client accepts: 8 times the server's default cap on compiler
#: output (32 MiB), so a server that raised its own cap is still served, while a
#: server's claim of more is refused before a byte of the body is read.
DEFAULT_MAX_ARTIFACT_BYTES = 256 << 20


def _env_seconds(name: str, default: float) -> float:
    """A positive number of seconds from the environment variable ``name``, else ``default``."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (value > 0 and math.isfinite(value)):
        raise KCacheError(f"{name}={raw!r}: give a positive number of seconds")
    return value


def _env_int(name: str, default: int, minimum: int) -> int:
    """A whole number of at least ``minimum`` from the environment variable ``name``."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise KCacheError(f"{name}={raw!r}: give a whole number of at least {minimum}")
    return value


#: Every setting a client reads from the environment: the field (``retry.`` and
#: ``timeout.`` for the parts of those) -> its variable. ``kcache config`` shows each
#: with where its value came from; ``from_env`` reads them.
ENVIRONMENT: Mapping[str, str] = MappingProxyType(
    {
        "url": "KCACHE_URL",
        "offline": "KCACHE_OFFLINE",
        "token": "KCACHE_TOKEN",
        "cache_dir": "KCACHE_CACHE_DIR",
        "cache_max_bytes": "KCACHE_CACHE_MAX_BYTES",
        "local_compile": "KCACHE_LOCAL_COMPILE",
        "include_sets": "KCACHE_CLIENT_INCLUDE_SETS",
        "job_id": "KCACHE_JOB_ID",
        "client_id": "KCACHE_CLIENT_ID",
        "host": "KCACHE_CLIENT_HOST",
        "auto_target": "KCACHE_AUTO_TARGET",
        "device": "KCACHE_DEVICE",
        "send_events": "KCACHE_SEND_EVENTS",
        "bypass": "KCACHE_BYPASS",
        "memory_entries": "KCACHE_MEMORY_ENTRIES",
        "lock_timeout_s": "KCACHE_CLIENT_LOCK_TIMEOUT_S",
        "withdrawal_check_s": "KCACHE_WITHDRAWAL_CHECK_S",
        "retry.attempts": "KCACHE_RETRY_ATTEMPTS",
        "retry.base_s": "KCACHE_RETRY_BASE_S",
        "retry.cap_s": "KCACHE_RETRY_CAP_S",
        "retry.budget_s": "KCACHE_RETRY_BUDGET_S",
        "retry.max_retry_after_s": "KCACHE_MAX_RETRY_AFTER_S",
        "retry.deadline_s": "KCACHE_REQUEST_DEADLINE_S",
        "retry.compile_deadline_s": "KCACHE_COMPILE_DEADLINE_S",
        "timeout.connect": "KCACHE_CONNECT_TIMEOUT_S",
        "timeout.read": "KCACHE_READ_TIMEOUT_S",
        "max_artifact_bytes": "KCACHE_CLIENT_MAX_ARTIFACT_BYTES",
        "trusted_keys": "KCACHE_TRUSTED_KEYS",
        "known_servers": "KCACHE_KNOWN_SERVERS",
        "after_warmup": "KCACHE_AFTER_WARMUP",
        "layers": "KCACHE_CACHE_LAYERS",
    }
)


def timeout_from_env(default: Timeouts = DEFAULT_TIMEOUT) -> Waits:
    """``default``, its connect and read waits replaced by ``KCACHE_CONNECT_TIMEOUT_S`` and
    ``KCACHE_READ_TIMEOUT_S`` where they are set (the read wait also bounds writes)."""
    read = _env_seconds(ENVIRONMENT["timeout.read"], default.read or DEFAULT_TIMEOUT.read or 600.0)
    connect = _env_seconds(
        ENVIRONMENT["timeout.connect"], default.connect or DEFAULT_TIMEOUT.connect or 5.0
    )
    return Waits(connect=connect, read=read, write=read)


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded calls: each try within its deadline, retries within the budget.

    A try (connect, send, the status line and headers, the whole body) ends within
    ``deadline_s`` seconds (``KCACHE_REQUEST_DEADLINE_S``), or ``compile_deadline_s``
    (``KCACHE_COMPILE_DEADLINE_S``) for a request that may wait for a compile on the
    server (a resolve, a batch). A failed try is retried, up to ``attempts`` tries in
    all, as long as the wait before it ends within ``budget_s`` seconds
    (``KCACHE_RETRY_BUDGET_S``) of the call's start; and the whole call, tries and
    waits, ends within :meth:`call_bound`: the budget, or one try's deadline where
    that is longer (a lone try keeps its whole deadline; a budget shorter than it only
    forbids retries).

    The wait before try ``n`` is uniform in ``[0, min(cap_s, base_s * 2**n)]`` ("full
    jitter", so a thousand ranks retrying at once spread out), or the server's
    ``Retry-After`` when it gave one (capped by ``max_retry_after_s``).

    Defaults a training job can live with: a fetch of a kernel takes milliseconds and
    a 256 MiB artifact a few seconds, so a minute is a server or proxy that has stopped
    serving (the rank then falls back to its tier, or fails); a compile may queue on the
    server for its ``compile_queue_timeout_s`` (300 s) and run for its
    ``compile_timeout_s`` (120 s), a batch of them longer, so 15 minutes (the client's
    and the server's lock timeout for waiting on another's compile).
    """

    attempts: int = 6
    base_s: float = 0.2
    cap_s: float = 10.0
    budget_s: float = 60.0
    max_retry_after_s: float = 30.0
    deadline_s: float = 60.0
    compile_deadline_s: float = 900.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise KCacheError(f"attempts must be at least 1, not {self.attempts}")
        for name in ("deadline_s", "compile_deadline_s"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise KCacheError(f"{name} must be a positive number of seconds, not {value}")
        if not self.budget_s >= 0:
            raise KCacheError(f"budget_s must not be negative, not {self.budget_s}")

    @classmethod
    def from_env(cls, **defaults: Any) -> RetryPolicy:
        """The defaults (the fields' own, or ``defaults``: what a command runs with), each
        replaced by its environment variable where it is set: ``KCACHE_RETRY_ATTEMPTS``,
        ``KCACHE_RETRY_BASE_S``, ``KCACHE_RETRY_CAP_S``, ``KCACHE_RETRY_BUDGET_S``,
        ``KCACHE_MAX_RETRY_AFTER_S``, ``KCACHE_REQUEST_DEADLINE_S``,
        ``KCACHE_COMPILE_DEADLINE_S`` (see :data:`ENVIRONMENT`)."""
        default = replace(cls(), **defaults) if defaults else cls()
        seconds = {
            name: _env_seconds(ENVIRONMENT[f"retry.{name}"], getattr(default, name))
            for name in (
                "base_s",
                "cap_s",
                "budget_s",
                "max_retry_after_s",
                "deadline_s",
                "compile_deadline_s",
            )
        }
        attempts = _env_int(ENVIRONMENT["retry.attempts"], default.attempts, 1)
        return cls(attempts=attempts, **seconds)

    def try_deadline(self, *, compiles: bool) -> float:
        """How long one try may take: ``compile_deadline_s`` if it may compile, else ``deadline_s``."""
        return self.compile_deadline_s if compiles else self.deadline_s

    def call_bound(self, *, compiles: bool) -> float:
        """How long a whole call may take, tries and waits: the budget, or one try's deadline."""
        return max(self.budget_s, self.try_deadline(compiles=compiles))

    def backoff(self, attempt: int) -> float:
        """The jittered wait before retry number ``attempt`` (0-based)."""
        return random.uniform(0.0, min(self.cap_s, self.base_s * (2.0**attempt)))


def max_artifact_bytes_from_env() -> int:
    """``KCACHE_CLIENT_MAX_ARTIFACT_BYTES`` (a size such as ``512MiB``), else the default."""
    return _artifact_cap(None)


def _artifact_cap(explicit: int | str | None) -> int:
    size = _size(explicit, "max_artifact_bytes", minimum=1)
    return DEFAULT_MAX_ARTIFACT_BYTES if size is None else size


def _size(explicit: int | str | None, field: str, *, minimum: int = 0) -> int | None:
    """A size setting (``10GiB``, or bytes): ``explicit``, else its variable, else None."""
    name = ENVIRONMENT[field]
    value = explicit if explicit is not None else os.environ.get(name, "").strip() or None
    if value is None:
        return None
    what = field if explicit is not None else name
    try:
        size = parse_size(value, what, zero_means="no cap" if minimum == 0 else None)
    except ValueError as exc:
        raise KCacheError(str(exc)) from None
    if size < minimum:
        raise KCacheError(f"{what} must be at least {minimum} byte, not {value!r}")
    return size


def _job_id_from_env() -> str | None:
    # The launcher's own job id when kcache's is not set: audit rows then group by job.
    for name in ("KCACHE_JOB_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID"):
        value = os.environ.get(name)
        if value:
            return _label(value, name)
    return None


#: The longest ``job_id``, ``client_id`` or ``host`` a server records (its audit's columns):
#: each is sent with every request (``X-KCache-Context``), so a longer one failed them all.
MAX_LABEL_CHARS = 256


def _label(value: str | None, what: str) -> str | None:
    """``value``, a name the audit records (a job, a client, a host), or a KCacheError naming
    ``what`` when the server could not record it: too long, or with a control character."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise KCacheError(f"{what}: give a string, not {type(value).__name__}")
    if len(value) > MAX_LABEL_CHARS:
        raise KCacheError(
            f"{what} is {len(value)} characters long; the server records at most "
            f"{MAX_LABEL_CHARS}: give a shorter one"
        )
    if any(c < " " or c == "\x7f" for c in value):
        raise KCacheError(
            f"{what}={value[:40]!r} holds a control character: give one without (the server "
            "records printable names only)"
        )
    return value


def _path(value: str | os.PathLike[str], what: str, fix: str = "give another path") -> Path:
    """``value`` as an absolute path, ``~`` expanded (:func:`kcache.dirs.absolute_path`): fixed
    when the settings are made, so a later ``os.chdir`` moves nothing; a KCacheError naming
    ``what`` (and saying ``fix``) for what is no path at all."""
    if isinstance(value, Path) and value.is_absolute() and "\0" not in str(value):
        return value  # made here already (from_env's, then __post_init__'s look)
    if not isinstance(value, str | os.PathLike):
        raise KCacheError(
            f"{what}: give a path (a str or os.PathLike), not {type(value).__name__}: {fix}"
        )
    try:
        path = absolute_path(value)
    except (TypeError, ValueError) as exc:
        raise KCacheError(f"{what}: {value!r} is not a path ({exc}): {fix}") from None
    if "\0" in str(path):
        raise KCacheError(f"{what}: {str(value)!r} holds a NUL character, which no path can: {fix}")
    return path


#: The ways to name another cache directory.
_CACHE_DIR_FIX = "give another with cache_dir= in Python, KCACHE_CACHE_DIR, or --cache-dir"


def _cache_dir(explicit: str | os.PathLike[str] | None) -> Path:
    """The cache directory: ``explicit``, else ``KCACHE_CACHE_DIR``, else the default; absolute."""
    if explicit is not None and not isinstance(explicit, str | os.PathLike):
        return _path(explicit, "cache_dir", _CACHE_DIR_FIX)  # refused, naming the argument
    what = "cache_dir" if explicit else ENVIRONMENT["cache_dir"]
    if not explicit and not os.environ.get(what):
        what = "the default cache directory"
    try:
        chosen = default_cache_dir(explicit)
    except (TypeError, ValueError) as exc:
        raise KCacheError(f"{what}: not a path ({exc}): {_CACHE_DIR_FIX}") from None
    return _path(chosen, what, _CACHE_DIR_FIX)


def _include_sets(
    sets: Mapping[str, str | os.PathLike[str]] | None, what: str = "include_sets"
) -> Mapping[str, Path]:
    out: dict[str, Path] = {}
    for name, root in (sets or {}).items():
        path = _path(root, f"{what}[{name!r}]", "give the include set's directory")
        if not path.is_dir():
            raise KCacheError(f"include set {name!r}: {path} is not a directory")
        out[name] = path
    return MappingProxyType(out)


def _known_servers(explicit: str | os.PathLike[str] | None) -> Path:
    if explicit is not None:
        return _path(explicit, "known_servers", "give the pin file's path")
    return _path(default_known_servers(), ENVIRONMENT["known_servers"], "give the pin file's path")


def _layers(
    layers: Sequence[str | os.PathLike[str]] | None, what: str = "layers"
) -> tuple[Path, ...]:
    """The read-only layers (``KCACHE_CACHE_LAYERS``, or ``layers``), each absolute."""
    if layers is None:
        what = ENVIRONMENT["layers"]
        layers = os.environ.get(what, "").split(os.pathsep)
    elif isinstance(layers, str | os.PathLike):
        layers = [layers]  # one layer given as it is, not its characters
    fix = "give tier directories or .kcb bundle files"
    return tuple(_path(p, f"{what}[{i}]", fix) for i, p in enumerate(layers) if str(p).strip())


def _token(value: str | None, what: str) -> str | None:
    """``value``, a token the ``Authorization`` header can carry (printable ASCII), or a
    KCacheError naming ``what`` and the character's kind, never the token: it is a secret."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise KCacheError(
            f"{what}: give the server's token as a string, not {type(value).__name__}"
        )
    for i, c in enumerate(value):
        if not " " <= c <= "~":
            kind = "a control character" if c < " " or c == "\x7f" else "a non-ASCII character"
            raise KCacheError(
                f"{what} holds {kind} (character {i + 1} of {len(value)}; the token is not "
                "shown): an HTTP header carries printable ASCII only. Set it again as the "
                "server gave it (kcache token create), without line breaks or other characters"
            )
    return value


def _auto_target(value: str | None, what: str) -> str | None:
    """``value``, a target ``target="auto"`` can stand for, or a KCacheError naming ``what``."""
    if value is None:
        return None
    try:
        parse_target(value, what)
    except RecipeError as exc:
        raise KCacheError(f'{exc} ({what} says what target="auto" means here)') from None
    return value


def _env_device() -> int | None:
    name = ENVIRONMENT["device"]
    return _env_int(name, 0, 0) if os.environ.get(name, "").strip() else None


def _env_send_events() -> bool:
    flag = env_flag(ENVIRONMENT["send_events"])
    return True if flag is None else flag


def _env_include_sets() -> dict[str, str]:
    """``KCACHE_CLIENT_INCLUDE_SETS``: a JSON object of include set name -> directory."""
    name = ENVIRONMENT["include_sets"]
    raw = os.environ.get(name, "").strip()
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except ValueError as exc:
        raise KCacheError(f'{name} is not JSON ({exc}): write {{"name": "/dir"}}') from None
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise KCacheError(f'{name} must be a JSON object of name -> directory: {{"name": "/dir"}}')
    return value


def _bypass(value: str | None) -> Literal["allow", "error"]:
    """``KCACHE_BYPASS``: ``allow`` (the default) or ``error``."""
    text = (value or "allow").strip().lower()
    if text == "allow":
        return "allow"
    if text == "error":
        return "error"
    raise KCacheError(f"KCACHE_BYPASS={value!r}: give allow (the default) or error")


#: The ways to give a server's URL, and what one looks like.
_URL_FIX = (
    "give the server's URL, such as http://kcache.example:8080 or https://kcache.example (url= "
    "in Python, KCACHE_URL, or --server)"
)


def _url(value: str | None, what: str = "url") -> str | None:
    """``value`` stripped (None for none), checked to be a server's URL now rather than at
    the first request: ``http`` or ``https``, a host, a port that can be one. A
    KCacheError names ``what`` and shows the URL without its credentials."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise KCacheError(f"{what}={value!r} is a {type(value).__name__}, not a URL: {_URL_FIX}")
    text = value.strip()
    if not text:
        return None
    problem = None
    try:
        parts = urlsplit(text)
        parts.port  # noqa: B018  (raises ValueError for a port that is no port)
    except ValueError as exc:
        problem = str(exc)
    else:
        if parts.scheme not in ("http", "https"):
            problem = (
                "it has no http:// or https:// in front"
                if "://" not in text
                else f"the scheme {parts.scheme!r} is not http or https"
            )
        elif not parts.hostname:
            problem = "it names no host"
        elif parts.path.rstrip("/").endswith("/v1"):  # every request would be /v1/v1/...: 404
            problem = "it ends in /v1, which kcache adds itself: give the server's root"
    if problem is None:
        return text
    scheme, sep, rest = text.rpartition("://") if "://" in text else ("", "", text)
    authority, slash, path = rest.partition("/")
    if "@" in authority:  # user:password@host: the credentials are not shown
        rest = f"***@{authority.rpartition('@')[2]}{slash}{path}"
    shown = f"{scheme}{sep}{rest}"
    if not sep:
        problem += f" (did you mean http://{shown}?)"
    raise KCacheError(f"{what}={shown!r} is not a server URL: {problem}; {_URL_FIX}")


@dataclass(frozen=True)
class ClientSettings:
    """How a ``KernelCache`` reaches its server, where its node tier is, and how it behaves.

    Server: ``url`` (``KCACHE_URL``; None: no server), ``token`` (``KCACHE_TOKEN``),
    ``retry`` (a :class:`RetryPolicy`: attempts, each try's deadline, the whole call's
    budget; ``KCACHE_REQUEST_DEADLINE_S``, ``KCACHE_COMPILE_DEADLINE_S``,
    ``KCACHE_RETRY_BUDGET_S``), ``timeout`` (a :class:`~kcache_client._waits.Waits`, or an
    ``httpx.Timeout`` or anything with ``connect``, ``read`` and ``write``: the longest
    wait for the next bytes; default 600 s to read, for compiles, and 5 s to connect),
    ``max_artifact_bytes`` (the largest artifact accepted from the server,
    ``KCACHE_CLIENT_MAX_ARTIFACT_BYTES``, default 256 MiB). Node tier: ``cache_dir``
    (``KCACHE_CACHE_DIR``, else ``~/.cache/kcache/client``), ``cache_max_bytes`` (its
    cap, ``KCACHE_CACHE_MAX_BYTES``: None for the default of 10 GiB or 10 % of its
    filesystem, 0 for none), ``lock_timeout_s`` (how long a process waits for another
    one's download of the same kernel). This process: ``memory_entries`` (artifacts kept
    in memory), ``auto_target`` (what ``target="auto"`` means; default the device's
    ``sm_XY``), ``device`` (the CUDA device asked for it), ``host``, ``client_id``
    (``KCACHE_CLIENT_ID``) and ``job_id`` (``KCACHE_JOB_ID`` or the launcher's) for
    the audit, ``send_events`` (report node-local hits to the server),
    ``withdrawal_check_s`` (``KCACHE_WITHDRAWAL_CHECK_S``, 60: how often the server's
    withdrawals are read again, :mod:`~kcache_client._withdrawals`). Local compiles:
    ``local_compile`` (``KCACHE_LOCAL_COMPILE``; None: on exactly when there is no
    server, see :attr:`compiles_locally`) and ``include_sets`` (name -> directory they
    may read for the include sets a recipe names; a server has its own). Adapters:
    ``bypass`` (``KCACHE_BYPASS``): ``allow`` lets the CuPy and cuda.core adapters hand
    a compile kcache cannot key to the library itself (warned once, audited as
    ``bypass``), ``error`` raises :class:`~kcache_client.errors.BypassRefusedError` instead.

    Checked when made, each refusal a KCacheError naming the argument or variable: the URL
    (``http``/``https``, a host, a port), the token (printable ASCII, never shown), the auto
    target, the audit's names (at most 256 printable characters, as the server records
    them). Paths (``cache_dir``, ``include_sets``, ``layers``, ``known_servers``) are made
    absolute, ``~`` expanded, then: a later ``os.chdir`` moves none of them.
    """

    url: str | None = None
    token: str | None = None
    cache_dir: Path = field(default_factory=default_cache_dir)
    cache_max_bytes: int | None = None
    local_compile: bool | None = None
    include_sets: Mapping[str, Path] = field(default_factory=lambda: MappingProxyType({}))
    job_id: str | None = None
    client_id: str | None = None
    host: str | None = None
    auto_target: str | None = None
    device: int | None = None
    send_events: bool = True
    bypass: Literal["allow", "error"] = "allow"
    memory_entries: int = 4096
    lock_timeout_s: float = 900.0
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    timeout: Timeouts = DEFAULT_TIMEOUT
    max_artifact_bytes: int = DEFAULT_MAX_ARTIFACT_BYTES
    #: Public keys whose signatures are accepted (``KCACHE_TRUSTED_KEYS``: keys, or ``@FILE``);
    #: None: each server's keys pinned on first contact in ``known_servers`` (kcache_client._trust).
    trusted_keys: str | None = None
    #: The pin file (``KCACHE_KNOWN_SERVERS``, default ``~/.config/kcache/known_servers.json``).
    known_servers: Path = field(default_factory=lambda: _known_servers(None))
    #: What a warmup leaves the cache in (``KCACHE_AFTER_WARMUP``: warn, error, allow;
    #: None: what the code asks; kcache_client._freeze).
    after_warmup: str | None = None
    #: Read-only layers under the node tier, looked up in order (``KCACHE_CACHE_LAYERS``,
    #: paths separated by ``os.pathsep``): tier directories or ``.kcb`` bundle files.
    layers: tuple[Path, ...] = ()
    #: The longest a tier or memory answer rests on withdrawals read from the server this
    #: many seconds ago (``KCACHE_WITHDRAWAL_CHECK_S``; kcache_client._withdrawals).
    withdrawal_check_s: float = 60.0
    #: Send nothing to the server (``KCACHE_OFFLINE=1``, as ``HF_HUB_OFFLINE``): every
    #: request fails at once as an unreachable server's would, so the cache answers from
    #: its node tier and layers (keyed as the server keys, from the facts the tier kept)
    #: and compiles locally where that is on; no retries, no events.
    offline: bool = False

    def __post_init__(self) -> None:
        # Paths absolute and ``~`` expanded once, here: a later os.chdir moves nothing (what
        # from_env made is kept as it is), and each is checked to be a path at all.
        fixed = {
            "cache_dir": _path(self.cache_dir, "cache_dir", _CACHE_DIR_FIX),
            "include_sets": (
                self.include_sets
                if all(isinstance(p, Path) and p.is_absolute() for p in self.include_sets.values())
                else _include_sets(self.include_sets)
            ),
            "known_servers": _path(self.known_servers, "known_servers", "give the pin file's path"),
            "layers": _layers(self.layers),
        }
        for name, value in fixed.items():
            if value is not getattr(self, name):
                object.__setattr__(self, name, value)
        url = _url(self.url)
        if url != self.url:
            object.__setattr__(self, "url", url)
        _token(self.token, "token")
        _auto_target(self.auto_target, "auto_target")
        for name in ("job_id", "client_id", "host"):
            _label(getattr(self, name), name)
        if self.after_warmup not in (None, "warn", "error", "allow"):
            raise KCacheError(
                f"KCACHE_AFTER_WARMUP={self.after_warmup!r}: give warn, error or allow"
            )
        if self.max_artifact_bytes < 1:
            raise KCacheError(
                f"max_artifact_bytes must be at least 1 byte, not {self.max_artifact_bytes}"
            )
        if self.memory_entries < 1:
            raise KCacheError(f"memory_entries must be at least 1, not {self.memory_entries}")
        if not self.lock_timeout_s > 0:
            raise KCacheError(f"lock_timeout_s must be positive, not {self.lock_timeout_s}")
        if not (self.withdrawal_check_s > 0 and math.isfinite(self.withdrawal_check_s)):
            raise KCacheError(
                f"withdrawal_check_s must be a positive number of seconds, not "
                f"{self.withdrawal_check_s}"
            )
        if self.cache_max_bytes is not None and self.cache_max_bytes < 0:
            raise KCacheError(f"cache_max_bytes must not be negative, not {self.cache_max_bytes}")

    @property
    def compiles_locally(self) -> bool:
        """Whether a miss the server cannot answer is compiled here (given NVRTC)."""
        return self.url is None if self.local_compile is None else self.local_compile

    @property
    def hostname(self) -> str:
        """``host``, else this machine's name."""
        return self.host or socket.gethostname()

    @classmethod
    def from_env(
        cls,
        *,
        url: str | None = None,
        token: str | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_max_bytes: int | str | None = None,
        local_compile: bool | None = None,
        include_sets: Mapping[str, str | os.PathLike[str]] | None = None,
        job_id: str | None = None,
        client_id: str | None = None,
        host: str | None = None,
        auto_target: str | None = None,
        device: int | None = None,
        send_events: bool | None = None,
        bypass: str | None = None,
        memory_entries: int | None = None,
        lock_timeout_s: float | None = None,
        retry: RetryPolicy | None = None,
        timeout: Timeouts | None = None,
        max_artifact_bytes: int | str | None = None,
        trusted_keys: str | None = None,
        known_servers: str | os.PathLike[str] | None = None,
        after_warmup: str | None = None,
        layers: Sequence[str | os.PathLike[str]] | None = None,
        withdrawal_check_s: float | None = None,
        offline: bool | None = None,
    ) -> ClientSettings:
        """Arguments first, then the environment, then the defaults.

        ``cache_max_bytes`` and ``max_artifact_bytes`` also take sizes such as ``"10GiB"``;
        a ``retry`` given is used as it is (the environment's retry variables are read
        only for the default one, :meth:`RetryPolicy.from_env`), and so is a ``timeout``
        (else :func:`timeout_from_env`). Every variable is in :data:`ENVIRONMENT`.
        """
        if local_compile is None:
            local_compile = env_flag("KCACHE_LOCAL_COMPILE")
        env = os.environ
        return cls(
            url=_url(url, "url") if url else _url(env.get("KCACHE_URL"), "KCACHE_URL"),
            token=_token(token, "token")
            if token
            else _token(env.get("KCACHE_TOKEN") or None, "KCACHE_TOKEN"),
            cache_dir=_cache_dir(cache_dir),
            cache_max_bytes=_size(cache_max_bytes, "cache_max_bytes"),
            local_compile=local_compile,
            include_sets=(
                _include_sets(include_sets)
                if include_sets
                else _include_sets(_env_include_sets(), ENVIRONMENT["include_sets"])
            ),
            job_id=_label(job_id, "job_id") if job_id else _job_id_from_env(),
            client_id=_label(client_id, "client_id")
            if client_id
            else _label(env.get("KCACHE_CLIENT_ID") or None, "KCACHE_CLIENT_ID"),
            host=_label(host, "host")
            if host
            else _label(env.get(ENVIRONMENT["host"], "").strip() or None, ENVIRONMENT["host"]),
            auto_target=_auto_target(auto_target, "auto_target")
            if auto_target
            else _auto_target(
                env.get(ENVIRONMENT["auto_target"], "").strip() or None, ENVIRONMENT["auto_target"]
            ),
            device=device if device is not None else _env_device(),
            send_events=send_events if send_events is not None else _env_send_events(),
            bypass=_bypass(bypass or os.environ.get(ENVIRONMENT["bypass"])),
            memory_entries=memory_entries or _env_int(ENVIRONMENT["memory_entries"], 4096, 1),
            lock_timeout_s=lock_timeout_s or _env_seconds(ENVIRONMENT["lock_timeout_s"], 900.0),
            retry=retry or RetryPolicy.from_env(),
            timeout=timeout or timeout_from_env(),
            max_artifact_bytes=_artifact_cap(max_artifact_bytes),
            trusted_keys=trusted_keys
            or os.environ.get(ENVIRONMENT["trusted_keys"], "").strip()
            or None,
            known_servers=_known_servers(known_servers),
            after_warmup=after_warmup
            or os.environ.get(ENVIRONMENT["after_warmup"], "").strip().lower()
            or None,
            layers=_layers(layers),
            withdrawal_check_s=withdrawal_check_s
            or _env_seconds(ENVIRONMENT["withdrawal_check_s"], 60.0),
            offline=offline if offline is not None else bool(env_flag(ENVIRONMENT["offline"])),
        )

    def located(
        self,
        url: str | None = None,
        token: str | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
    ) -> ClientSettings:
        """A copy with the server and cache directory given (what is None is kept)."""
        if url is None and token is None and cache_dir is None:
            return self
        # A copy of the fields, three replaced (each checked here as __post_init__ would), and
        # the rest were checked when this object was made (``replace`` would check all again: every
        # process's ``KernelCache(cache_dir=..., settings=...)`` comes here).
        located = object.__new__(type(self))
        located.__dict__.update(
            self.__dict__,
            url=self.url if url is None else _url(url, "url"),
            token=self.token if token is None else _token(token or None, "token"),
            cache_dir=self.cache_dir if cache_dir is None else _cache_dir(cache_dir),
        )
        return located
