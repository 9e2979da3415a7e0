"""``Settings``: the server's whole configuration, read from ``KCACHE_*`` environment variables.

One object, built in :func:`kcache_server.create_app` (never at import), so tests
and the ``kcache serve`` flags inject every value, the auditing ones included:
``Settings(audit=AuditSettings(retention_days=7))`` or ``KCACHE_AUDIT_RETENTION_DAYS=7``.

Every number a setting gives is checked against what the code that uses it can take,
whatever the field's own bounds (:class:`_Checked`): a number is finite (``inf`` and
``nan`` are refused), a duration in seconds (``*_s``) is at most :data:`MAX_SECONDS` (a
year), one in days (``*_days``) at most :data:`MAX_DAYS`, and a whole number at most
:data:`MAX_INT` (what SQLite and PostgreSQL store). A variable set to the empty string
is unset (its default), as an empty ``KCACHE_DB_URL`` always was.
"""

from __future__ import annotations

import difflib
import ipaddress
import json
import math
import re
import textwrap
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import ByteSize, Field, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = [
    "KNOWN_OTHER_VARIABLES",
    "MAX_DAYS",
    "MAX_INT",
    "MAX_SECONDS",
    "AuditSettings",
    "Settings",
    "VerificationSettings",
    "is_loopback",
    "settings_help",
    "settings_variables",
    "unknown_variables",
]

#: The longest duration a ``*_s`` setting may give: a year. Longer is a mistake (``1e12``),
#: and the code that waits with one (threading's and subprocess's timeouts, ``now +`` it
#: as a time) cannot take much more.
MAX_SECONDS = 365 * 86_400
#: The longest a ``*_days`` setting may give: 100 years (``now -`` it is still a date).
MAX_DAYS = 36_500
#: The largest whole number a setting may give (bytes, counts): a signed 64-bit integer,
#: what SQLite, PostgreSQL's BIGINT and the C calls they reach hold.
MAX_INT = (1 << 63) - 1
#: What ``kcache serve --help`` says of those bounds.
_BOUNDS = (
    f"numbers must be finite; *_S durations are at most {MAX_SECONDS} (a year), *_DAYS at most "
    f"{MAX_DAYS}, whole numbers at most {MAX_INT}; an empty variable is unset"
)

#: ``KCACHE_*`` variables that are not server settings but are known, so ``kcache serve``
#: does not warn of them (:func:`unknown_variables`): the client's (its ``ENVIRONMENT``,
#: kept in step by tests/server/test_settings_mistakes.py, since the server never imports
#: the client), the core's, the server's internal ones and the deploy files' (nginx's
#: template, install-systemd).
KNOWN_OTHER_VARIABLES = frozenset(
    {
        # the client (kcache_client._settings.ENVIRONMENT)
        "KCACHE_URL",
        "KCACHE_OFFLINE",
        "KCACHE_TOKEN",
        "KCACHE_CACHE_DIR",
        "KCACHE_CACHE_MAX_BYTES",
        "KCACHE_LOCAL_COMPILE",
        "KCACHE_CLIENT_INCLUDE_SETS",
        "KCACHE_JOB_ID",
        "KCACHE_CLIENT_ID",
        "KCACHE_CLIENT_HOST",
        "KCACHE_AUTO_TARGET",
        "KCACHE_DEVICE",
        "KCACHE_SEND_EVENTS",
        "KCACHE_BYPASS",
        "KCACHE_MEMORY_ENTRIES",
        "KCACHE_CLIENT_LOCK_TIMEOUT_S",
        "KCACHE_WITHDRAWAL_CHECK_S",
        "KCACHE_RETRY_ATTEMPTS",
        "KCACHE_RETRY_BASE_S",
        "KCACHE_RETRY_CAP_S",
        "KCACHE_RETRY_BUDGET_S",
        "KCACHE_MAX_RETRY_AFTER_S",
        "KCACHE_REQUEST_DEADLINE_S",
        "KCACHE_COMPILE_DEADLINE_S",
        "KCACHE_CONNECT_TIMEOUT_S",
        "KCACHE_READ_TIMEOUT_S",
        "KCACHE_CLIENT_MAX_ARTIFACT_BYTES",
        "KCACHE_TRUSTED_KEYS",
        "KCACHE_KNOWN_SERVERS",
        "KCACHE_AFTER_WARMUP",
        "KCACHE_CACHE_LAYERS",
        # the core (kcache.cli, kcache._waiting)
        "KCACHE_DEBUG",
        "KCACHE_PROGRESS_S",
        # the server's own, not settings
        "KCACHE_MIGRATIONS_DIR",
        "KCACHE_SERVER_SETTINGS_JSON",
        # a section as one JSON value (pydantic-settings reads them as such)
        "KCACHE_AUDIT",
        "KCACHE_VERIFY",
        # the deploy files: nginx's template, install-systemd, the image build
        "KCACHE_LISTEN",
        "KCACHE_REPLICA",
        "KCACHE_BLOBS",
        "KCACHE_EDGE_CACHE",
        "KCACHE_FLEET_KEY",
        "KCACHE_PREFIX",
        "KCACHE_USER",
        "KCACHE_UNIT_DIR",
        "KCACHE_CONFIG_DIR",
        "KCACHE_STATE_DIR",
        "KCACHE_NO_START",
        # the tests' PostgreSQL
        "KCACHE_TEST_PG_URL",
    }
)


#: What ``accel_redirect`` may be: a path nginx's internal location is named by.
_LOCATION = re.compile(r"/(?:[A-Za-z0-9_-]+/)*")


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name other than localhost may resolve to anything


def _usable_number(name: str, value: object) -> object:
    """``value`` if the code that uses setting ``name`` can take it; a ValueError saying why not."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return value
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("is not a finite number: give a number (inf and nan are refused)")
    if name.endswith("_s") and value > MAX_SECONDS:
        raise ValueError(f"is more than a year: give at most {MAX_SECONDS} seconds")
    if name.endswith("_days") and value > MAX_DAYS:
        raise ValueError(f"is more than 100 years: give at most {MAX_DAYS} days")
    if isinstance(value, int) and value > MAX_INT:
        raise ValueError(f"is too large: give at most {MAX_INT}")
    return value


class _Checked(BaseSettings):
    """What every settings model checks beyond its fields' own bounds (the module docstring)."""

    @field_validator("*", mode="after")
    @classmethod
    def _usable(cls, value: Any, info: ValidationInfo) -> Any:
        return _usable_number(info.field_name or "", value)


class AuditSettings(_Checked):
    """``Settings.audit``: the audit writer, retention and client-event limits.

    Each field is ``KCACHE_AUDIT_<NAME>`` in the environment. A section of
    :class:`Settings` (not a settings object of its own): fields not given are read
    from the environment whether the section is built alone or with ``Settings``.
    """

    model_config = SettingsConfigDict(
        env_prefix="KCACHE_AUDIT_", extra="ignore", env_ignore_empty=True
    )

    flush_s: float = Field(
        default=0.5, gt=0, description="audit events are written in batches this often"
    )
    retention_days: float = Field(
        default=30.0,
        ge=0,
        description="raw events older than this are rolled up into hourly counts; 0 keeps all",
    )
    rollup_interval_s: float = Field(default=3600.0, gt=0, description="how often the roll-up runs")
    max_events_per_batch: int = Field(
        default=10_000, ge=1, description="events per POST /v1/events"
    )
    max_clock_skew_s: float = Field(
        default=86_400.0,
        ge=0,
        description="client event times further in the future are recorded as the batch's "
        "arrival (a client's clock is ahead)",
    )
    max_reported_per_minute: int = Field(
        default=100_000_000,
        ge=1,
        description="lookups one token may report through POST /v1/events per minute of "
        "arrival (the sum of its events' count), across replicas; past it a batch is refused "
        "with 429 and Retry-After. The default is 1,000 processes each reporting about 1,700 "
        "local hits a second; raise it for larger fleets sharing one token",
    )


class VerificationSettings(_Checked):
    """``Settings.verify``: verified hits (:mod:`kcache_server.verification`).

    Each field is ``KCACHE_VERIFY_<NAME>`` in the environment. On by default, at a
    small rate: every manifest match and one exact-key hit in twenty are compiled again,
    each at most once a day, by one low-priority worker busy at most 5 % of the time.
    """

    model_config = SettingsConfigDict(
        env_prefix="KCACHE_VERIFY_", extra="ignore", env_ignore_empty=True
    )

    enabled: bool = Field(default=True, description="compile a sample of served artifacts again")
    sample_rate: float = Field(
        default=0.05,
        ge=0,
        le=1,
        description="share of exact-key hits verified (manifest matches always are)",
    )
    period_s: float = Field(
        default=86_400.0, gt=0, description="an artifact is verified at most once this often"
    )
    cpu_share: float = Field(
        default=0.05, gt=0, le=1, description="most of the time the verification worker is busy"
    )
    max_candidates: int = Field(
        default=10_000, ge=1, description="served recipes remembered as candidates"
    )


class Settings(_Checked):
    """Everything ``kcache serve`` can be told; each field is ``KCACHE_<NAME>`` in the environment.

    An unknown keyword is refused rather than ignored: a misspelt setting injected by
    code would otherwise silently keep its default. (Unknown ``KCACHE_*`` variables are
    never read, so the client's ``KCACHE_URL`` does not bother the server; ``kcache serve``
    warns of those that are nobody's, :func:`unknown_variables`.)
    """

    model_config = SettingsConfigDict(env_prefix="KCACHE_", extra="forbid", env_ignore_empty=True)

    data_dir: Path = Field(
        default=Path(".kcache"), description="blob store, SQLite database, locks, compile scratch"
    )
    db_url: str | None = Field(
        default=None, description="SQLAlchemy URL; default SQLite in the data dir"
    )
    store_url: str | None = Field(
        default=None,
        description="s3://BUCKET/PREFIX: blobs in an S3-compatible bucket, the data dir keeping a "
        "bounded local cache of them (endpoint and credentials: AWS_ENDPOINT_URL, AWS_REGION, "
        "AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY); unset: blobs in the data dir",
    )
    store_cache_bytes: ByteSize | None = Field(
        default=None,
        description="cap on the local copies of bucket blobs, e.g. 20GiB; unset: 10 GiB or 10% of "
        "the data dir's filesystem, whichever is smaller",
    )
    store_timeout_s: float = Field(
        default=5.0,
        gt=0,
        le=600,
        description="a bucket request (its body included) taking longer fails; retries happen "
        "within this time, so a fetch the bucket must answer gets 503 + Retry-After in about "
        "twice this at most",
    )
    store_connect_timeout_s: float = Field(
        default=1.0,
        gt=0,
        le=600,
        description="opening a connection to the bucket taking longer fails",
    )
    store_retries: int = Field(
        default=2,
        ge=0,
        le=10,
        description="quick retries of a bucket request that failed (refused, reset, 5xx)",
    )
    readiness_timeout_s: float = Field(
        default=3.0,
        gt=0,
        le=60,
        description="a /readyz check of a backend (the database, the bucket) taking longer fails",
    )
    host: str = Field(default="127.0.0.1", description="address to bind")
    port: int = Field(
        default=8470, ge=0, le=65535, description="port to listen on (0: one the system picks)"
    )
    workers: int = Field(default=1, ge=1, description="uvicorn worker processes")
    force_insecure: bool = Field(
        default=False, description="allow a non-loopback bind with no tokens"
    )
    access_log: bool = Field(
        default=False, description="uvicorn's per-request log (audit events record every lookup)"
    )
    include_sets: dict[str, Path] = Field(
        default_factory=dict,
        description='include sets recipes may name, as JSON: {"NAME": "DIRECTORY", ...}',
    )
    toolchain_dir: Path | None = Field(
        default=None, description="where NVRTC's bundled headers are extracted"
    )
    compiler: Literal["auto", "required", "off"] = Field(
        default="auto",
        description="auto: compile where NVRTC >= 13.3 and nvJitLink load, else start anyway and "
        "serve fetches only (one warning says why; compiles answer 501 cannot_compile); "
        "required: refuse to start without them; off: never compile (a read-only edge)",
    )
    compile_workers: int = Field(
        default=2, ge=1, description="NVRTC worker processes per server process"
    )
    compile_timeout_s: float = Field(
        default=120.0, gt=0, description="a compile past this is killed"
    )
    compile_memory_mb: int = Field(
        default=8192,
        ge=256,
        le=1 << 24,
        description="address-space limit of a compile worker (at most 16777216: 16 TiB)",
    )
    compile_sandbox: Literal["auto", "required", "best-effort", "off"] = Field(
        default="auto",
        description="Landlock confinement of compile workers: required (refuse to start without it), "
        "best-effort (run unconfined, loudly, where the kernel lacks it), off (never confine: tests, "
        "debugging); auto is required on a non-loopback bind and best-effort on loopback",
    )
    compile_queue_limit: int = Field(
        default=64, ge=0, description="compiles waiting for a worker before 503"
    )
    compile_caller_limit: int = Field(
        default=0,
        ge=0,
        description="compiles one caller (a token, or a client address on an open server) runs at once; "
        "0: all compile workers but one where there are 3 or more (another caller always finds one "
        "free), all of them with fewer (a lone developer's warmup keeps both default workers busy)",
    )
    compile_caller_queue_limit: int = Field(
        default=16,
        ge=0,
        description="compiles one caller may have waiting for a worker before its next gets 503",
    )
    compile_queue_timeout_s: float = Field(
        default=300.0, gt=0, description="longest wait for a compile worker before 503"
    )
    failure_ttl_s: float = Field(
        default=300.0,
        ge=0,
        description="a recipe whose compile timed out or whose output was too large is answered with that "
        "error, without compiling, for this long (0: never remembered)",
    )
    max_artifact_bytes: int = Field(
        default=32 << 20,
        ge=1024,
        description="compiler output above this is refused (422), never stored",
    )
    foreign_max_bytes: int = Field(
        default=32 << 20,
        ge=1024,
        description="the largest file a library cache hook may publish (PUT /v1/blobs/{digest}, 413 "
        "past it; max_request_bytes bounds every body too)",
    )
    min_free_bytes: int = Field(
        default=256 << 20,
        ge=0,
        description="below this much free disk under the data directory, compiles get 507 and /readyz fails",
    )
    recreate_index: bool = Field(
        default=False,
        description="start even though the database was lost: create it afresh and index the stored blobs",
    )
    lock_timeout_s: float = Field(
        default=900.0, gt=0, description="how long to wait for another's compile"
    )
    request_threads: int = Field(default=64, ge=1, description="engine calls running at once")
    caller_threads: int = Field(
        default=0,
        ge=0,
        description="engine calls one caller runs at once; 0: half of request_threads",
    )
    max_request_bytes: int = Field(
        default=32 << 20, ge=1024, description="request bodies above this get 413"
    )
    max_request_values: int = Field(
        default=200_000,
        ge=1000,
        description="request bodies holding more JSON values than this (members' values and array "
        "elements, counted as the body arrives) get 413 before they are parsed: parsing holds the "
        "GIL, and a body's values are what it costs (200k: under 0.1 s on a current server core; "
        "a full batch of audit.max_events_per_batch events with every field holds about 18 per event)",
    )
    max_batch: int = Field(default=1024, ge=1, description="recipes per /v1/resolve/batch")
    blob_cache_bytes: int = Field(default=256 << 20, ge=0, description="hot blobs kept in memory")
    auth_cache_s: float = Field(default=2.0, ge=0, description="how long token checks are cached")
    accel_redirect: str | None = Field(
        default=None,
        description="behind the deploy's nginx (deploy/nginx/kcache.conf.template): a fetch by key or by "
        "digest is answered with its headers and X-Accel-Redirect to this internal location plus "
        "ab/cd/<digest>, and nginx sends the bytes from the data directory's blobs/; a request "
        "carrying X-KCache-Accel: off (nginx's fallback) gets the bytes. Unset: the bytes are sent "
        "here. Set it only where every client comes through that nginx",
    )
    edge_log: Path | None = Field(
        default=None,
        description="behind the deploy's nginx with its cache (deploy/nginx/kcache.conf.template): "
        "the file nginx writes a kcache_edge line to per fetch by key it answered from its cache; "
        "one process of this server follows it and audits each as a fetch (the file lock and "
        "where it got to are in <data_dir>/locks). Unset: nothing is read",
    )
    db_pool_size: int = Field(default=16, ge=1, description="PostgreSQL connections kept open")
    db_max_overflow: int = Field(
        default=64, ge=0, description="further PostgreSQL connections under load"
    )
    retry_after_s: int = Field(default=5, ge=1, description="the Retry-After sent with 503")
    max_store_bytes: ByteSize | None = Field(
        default=None,
        description="cap on the bytes of stored artifacts (pinned ones included), e.g. 500GiB; "
        "least recently used ones are evicted past it; unset or 0: unbounded",
    )
    store_high_water: float = Field(
        default=0.9,
        gt=0,
        le=1,
        description="eviction starts above this fraction of max_store_bytes",
    )
    store_low_water: float = Field(
        default=0.8, gt=0, lt=1, description="and evicts down to this fraction"
    )
    eviction_interval_s: float = Field(
        default=30.0,
        gt=0,
        description="how often the store's size is checked (compiles also check)",
    )
    eviction_blob_grace_s: float = Field(
        default=60.0,
        ge=0,
        description="an evicted artifact's blob written or reused more recently than this is deleted "
        "by a later pass (a compile publishes its blob before the row that names it)",
    )
    token_quota_bytes: ByteSize | None = Field(
        default=None,
        description="cap on the stored bytes of artifacts one token (or, on an open server, one "
        "client address) caused to be compiled; over it, its compiles get 507; unset or 0: none",
    )
    signing_key_file: Path | None = Field(
        default=None,
        description="the Ed25519 private key (PEM, mode 0600) that signs artifact metadata; unset: "
        "<data_dir>/signing-key.pem, made at first start. Replicas behind one URL: give every one "
        "the same key (a secret file; `kcache signing-key create` makes one), whose public half "
        "clients are given; a server refuses to start when its database names another key in use",
    )
    signing_previous_key_file: Path | None = Field(
        default=None,
        description="after a key rotation, the key signed with before: it endorses the current key "
        "in GET /v1/keys, so clients that pinned it follow the rotation; drop it once they have",
    )
    audit: AuditSettings = Field(
        default_factory=AuditSettings,
        description="auditing: KCACHE_AUDIT_<NAME>, see AuditSettings",
    )
    verify: VerificationSettings = Field(
        default_factory=VerificationSettings,
        description="verified hits: KCACHE_VERIFY_<NAME>, see VerificationSettings",
    )

    @field_validator(
        "data_dir",
        "toolchain_dir",
        "edge_log",
        "signing_key_file",
        "signing_previous_key_file",
        mode="before",
    )
    @classmethod
    def _named_path(cls, value: Any) -> Any:
        """An empty path (a flag given as ``''``) is refused: ``Path('')`` is the current directory."""
        if isinstance(value, str) and not value.strip():
            raise ValueError("is empty: name a path, or leave it unset for the default")
        return value

    @field_validator("data_dir")
    @classmethod
    def _a_directory(cls, value: Path) -> Path:
        """Refuse a data directory that is a file, or lies under one (it is made when missing)."""
        place = value
        while not (place.exists() or place.is_symlink()) and place.parent != place:
            place = place.parent
        if place.exists() and not place.is_dir():
            where = "is" if place == value else f"lies under {place}, which is"
            raise ValueError(
                f"{where} a file, not a directory: name the server's data directory "
                "(made when missing)"
            )
        return value

    @field_validator("include_sets")
    @classmethod
    def _set_directories(cls, value: dict[str, Path]) -> dict[str, Path]:
        """Each include set names a directory (a compile that names the set would otherwise
        be refused for every header it includes, as if the set were empty)."""
        for name, root in value.items():
            if not root.is_dir():
                what = "is not a directory" if root.exists() else "does not exist"
                raise ValueError(
                    f"include set {name!r}: {root} {what}: name its headers' directory"
                )
        return value

    @field_validator("store_low_water")
    @classmethod
    def _below_high_water(cls, value: float, info: ValidationInfo) -> float:
        """The low water mark is below the high one (eviction goes from the high down to the low)."""
        high = info.data.get("store_high_water")
        if high is not None and not value < high:
            raise ValueError(
                f"must be below KCACHE_STORE_HIGH_WATER={high:g} (eviction starts above the "
                "high mark and evicts down to the low one): lower KCACHE_STORE_LOW_WATER or raise "
                "KCACHE_STORE_HIGH_WATER, e.g. 0.8 and 0.9"
            )
        return value

    @field_validator("db_url")
    @classmethod
    def _openable_db_url(cls, value: str | None) -> str | None:
        """Refuse the URL spellings SQLAlchemy cannot open with the drivers kcache installs."""
        if not value:
            return None
        scheme = value.split("://", 1)[0].lower() if "://" in value else ""
        if scheme and scheme.split("+", 1)[0] not in ("sqlite", "postgresql", "postgres"):
            raise ValueError(
                f"{scheme}:// is not a database kcache can use (it keeps its index in SQLite or "
                "PostgreSQL): write sqlite:////ABSOLUTE/PATH/kcache.db or "
                "postgresql+psycopg://USER:PASSWORD@HOST:5432/DB"
            )
        if scheme in ("postgres", "postgresql", "postgresql+psycopg2"):
            raise ValueError(
                f"{scheme}:// cannot be opened here (SQLAlchemy has no postgres:// dialect, and "
                "postgresql:// means the psycopg2 driver): write postgresql+psycopg://USER:PASSWORD@HOST:5432/DB"
            )
        if not scheme:
            raise ValueError(
                "is not a database URL: write sqlite:////ABSOLUTE/PATH/kcache.db or "
                "postgresql+psycopg://USER:PASSWORD@HOST:5432/DB"
            )
        return value

    @field_validator("accel_redirect")
    @classmethod
    def _internal_location(cls, value: str | None) -> str | None:
        """An nginx location path: ``/`` + letters, digits, ``_``, ``-`` and ``/``, ending in ``/``."""
        if value is None or _LOCATION.fullmatch(value):
            return value
        raise ValueError(
            f"{value!r} is not an nginx location path like /_kcache_blobs/ (letters, digits, "
            "_, - and /, starting and ending with /)"
        )

    @field_validator("store_url")
    @classmethod
    def _known_store_url(cls, value: str | None) -> str | None:
        """Refuse a store URL no backend reads (``s3://BUCKET[/PREFIX]``), saying which part is wrong."""
        if not value:
            return None
        from kcache.store.urls import check_store_url

        check_store_url(value)  # its ValueError names the bad part
        return value

    @property
    def signing_key_path(self) -> Path:
        """``signing_key_file``, or ``<data_dir>/signing-key.pem``."""
        return self.signing_key_file or self.data_dir / "signing-key.pem"

    @property
    def database_url(self) -> str:
        """``db_url``, or SQLite at ``<data_dir>/kcache.db``."""
        if self.db_url:
            return self.db_url
        return f"sqlite:///{(self.data_dir / 'kcache.db').resolve()}"

    @property
    def compile_sandbox_mode(self) -> Literal["required", "best-effort", "off"]:
        """``compile_sandbox`` with ``auto`` decided by the bind address."""
        if self.compile_sandbox != "auto":
            return self.compile_sandbox
        return "best-effort" if self.loopback else "required"

    @property
    def loopback(self) -> bool:
        """True when ``host`` is a loopback address."""
        return is_loopback(self.host)


def _default(value: object) -> str:
    """A default as its variable would be written."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return json.dumps(value) if value else "none"
    if isinstance(value, int) and value >= 1 << 20 and value % (1 << 20) == 0:
        return f"{value} ({value >> 20} MiB)"
    return str(value)


def settings_variables() -> list[tuple[str, str, str]]:
    """Every setting as (environment variable, default, description), in :class:`Settings`' order.

    A section (``audit``, ``verify``) is its own fields under its prefix. What
    ``kcache serve --help`` lists (:func:`settings_help`), made from the fields, so it
    can neither miss one nor drift from them.
    """
    rows: list[tuple[str, str, str]] = []

    def walk(model: type[BaseSettings]) -> None:
        prefix = str(model.model_config.get("env_prefix") or "")
        for name, info in model.model_fields.items():
            section = info.annotation
            if isinstance(section, type) and issubclass(section, BaseSettings):
                walk(section)
                continue
            default = info.get_default(call_default_factory=True)
            rows.append((f"{prefix}{name}".upper(), _default(default), info.description or ""))

    walk(Settings)
    return rows


def settings_help(width: int = 100) -> str:
    """The ``KCACHE_*`` settings, one entry each: the variable and its default, then what it does."""
    lines = ["settings: each is a KCACHE_* environment variable (a flag above overrides its own):"]
    lines.extend(
        textwrap.wrap(f"({_BOUNDS})", width=width, initial_indent="  ", subsequent_indent="  ")
    )
    body = textwrap.TextWrapper(
        width=width, initial_indent=" " * 6, subsequent_indent=" " * 6, break_on_hyphens=False
    )
    for variable, default, description in settings_variables():
        lines.append(f"  {variable} (default {default})")
        if description:
            lines.extend(body.wrap(description))
    return "\n".join(lines) + "\n"


def unknown_variables(environ: Mapping[str, str]) -> list[tuple[str, str | None]]:
    """The ``KCACHE_*`` names in ``environ`` no one reads, each with the closest setting (or None).

    Known: every server setting (:func:`settings_variables`) and
    :data:`KNOWN_OTHER_VARIABLES`. Names are compared as pydantic-settings reads them,
    regardless of case. ``kcache serve`` warns of each: a misspelt setting would
    otherwise keep its default silently.
    """
    settings = [variable for variable, _, _ in settings_variables()]
    known = set(settings) | KNOWN_OTHER_VARIABLES
    found: list[tuple[str, str | None]] = []
    for name in sorted(n for n in environ if n.upper().startswith("KCACHE_")):
        if name.upper() in known:
            continue
        # Compared without the prefix all share, which would make any two names look alike.
        close = difflib.get_close_matches(name.upper()[7:], [v[7:] for v in settings], n=1)
        found.append((name, f"KCACHE_{close[0]}" if close else None))
    return found
