"""``Settings``: the server's whole configuration, read from ``KCACHE_*`` environment variables.

One object, built in :func:`kcache_server.create_app` (never at import), so tests
and the ``kcache serve`` flags inject every value, the auditing ones included:
``Settings(audit=AuditSettings(retention_days=7))`` or ``KCACHE_AUDIT_RETENTION_DAYS=7``.
"""

from __future__ import annotations

import ipaddress
import json
import re
import textwrap
from pathlib import Path
from typing import Literal

from pydantic import ByteSize, Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = [
    "AuditSettings",
    "Settings",
    "VerificationSettings",
    "is_loopback",
    "settings_help",
    "settings_variables",
]


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


class AuditSettings(BaseSettings):
    """``Settings.audit``: the audit writer, retention and client-event limits.

    Each field is ``KCACHE_AUDIT_<NAME>`` in the environment. A section of
    :class:`Settings` (not a settings object of its own): fields not given are read
    from the environment whether the section is built alone or with ``Settings``.
    """

    model_config = SettingsConfigDict(env_prefix="KCACHE_AUDIT_", extra="ignore")

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


class VerificationSettings(BaseSettings):
    """``Settings.verify``: verified hits (:mod:`kcache_server.verification`).

    Each field is ``KCACHE_VERIFY_<NAME>`` in the environment. On by default, at a
    small rate: every manifest match and one exact-key hit in twenty are compiled again,
    each at most once a day, by one low-priority worker busy at most 5 % of the time.
    """

    model_config = SettingsConfigDict(env_prefix="KCACHE_VERIFY_", extra="ignore")

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


class Settings(BaseSettings):
    """Everything ``kcache serve`` can be told; each field is ``KCACHE_<NAME>`` in the environment.

    An unknown keyword is refused rather than ignored: a misspelt setting injected by
    code would otherwise silently keep its default. (Unknown ``KCACHE_*`` variables are
    never read, so the client's ``KCACHE_URL`` does not bother the server.)
    """

    model_config = SettingsConfigDict(env_prefix="KCACHE_", extra="forbid")

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
        default=8192, ge=256, description="address-space limit of a compile worker"
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

    @field_validator("db_url")
    @classmethod
    def _openable_db_url(cls, value: str | None) -> str | None:
        """Refuse the URL spellings SQLAlchemy cannot open with the drivers kcache installs."""
        if not value:
            return None
        scheme = value.split("://", 1)[0].lower() if "://" in value else ""
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
    body = textwrap.TextWrapper(
        width=width, initial_indent=" " * 6, subsequent_indent=" " * 6, break_on_hyphens=False
    )
    for variable, default, description in settings_variables():
        lines.append(f"  {variable} (default {default})")
        if description:
            lines.extend(body.wrap(description))
    return "\n".join(lines) + "\n"
