"""SQLAlchemy models: one ``metadata``, one ``DeclarativeBase``.

Tables: ``artifacts`` (metadata by digest), ``recipe_aliases`` (recipe_key ->
digest), ``manifests`` (base_key -> dependency list -> digest), ``negative_entries``
(failed recipes with their log), ``audit_events`` (one row per lookup outcome),
``tokens`` (sha256 of bearer tokens with scopes), ``audit_report_windows`` (what each
token reported per minute, for its bound), and for bounded storage ``pins``
(recipe keys eviction keeps), ``evictions`` (what was evicted, when),
``compile_charges`` (who caused each compile, for quotas), ``quota_accounts`` and
``quota_reservations`` (bytes promised to compiles in progress, per caller), and
``withdrawals`` (bindings verification found wrong, read by every replica and client), and
``signing_keys`` (the keys the servers sharing the database sign with, checked at start-up), and
``foreign_bindings`` with ``foreign_files`` (artifacts a library's own cache hook published
under the library's key, docs/design.md section 10). Alembic
migrations under ``kcache_server/migrations/`` must agree with these; a test checks it
on SQLite and PostgreSQL.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Annotated, Any, cast

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Dialect,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
    false,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

__all__ = [
    "Artifact",
    "AuditCount",
    "AuditDigest",
    "AuditDivergence",
    "AuditEvent",
    "AuditJobBuild",
    "AuditLookup",
    "AuditReportWindow",
    "Base",
    "CompileCharge",
    "EvictionLogEntry",
    "ForeignBinding",
    "ForeignFile",
    "ManifestRow",
    "NegativeEntry",
    "Pin",
    "QuotaAccount",
    "QuotaReservation",
    "RecipeAlias",
    "RecipeRecord",
    "SigningKeyRow",
    "Token",
    "UTCDateTime",
    "VerificationEvent",
    "Withdrawal",
    "artifacts_table",
    "audit_counts_table",
    "audit_digests_table",
    "audit_divergences_table",
    "audit_events_table",
    "audit_job_builds_table",
    "audit_lookups_table",
    "audit_report_windows_table",
    "audit_rollups_table",
    "compile_charges_table",
    "evictions_table",
    "foreign_bindings_table",
    "foreign_files_table",
    "manifests_table",
    "metadata",
    "negative_entries_table",
    "pins_table",
    "quota_accounts_table",
    "quota_reservations_table",
    "recipe_aliases_table",
    "recipe_records_table",
    "signing_keys_table",
    "tokens_table",
    "utcnow",
    "verification_events_table",
    "withdrawals_table",
]


def utcnow() -> datetime:
    """Now, timezone-aware UTC."""
    return datetime.now(timezone.utc)


class UTCDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC timestamps on every backend (SQLite stores them naive)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        """Store UTC."""
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime; use kcache_server.models.utcnow()")
        return value.astimezone(timezone.utc)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        """Read back aware UTC."""
        if value is not None and value.tzinfo is None:
            return value.replace(tzinfo=timezone.utc)
        return value


#: ``"token:"`` or ``"client:"`` and a token name (at most 256 characters) or an address.
REPORTER_LENGTH = 270

# Autoincrement needs INTEGER PRIMARY KEY (the rowid) on SQLite, BIGINT elsewhere.
_BigId = BigInteger().with_variant(Integer(), "sqlite")

Hex64 = Annotated[str, mapped_column(String(64))]
Name = Annotated[str, mapped_column(String(256))]
Stamp = Annotated[datetime, mapped_column(UTCDateTime())]
OptStamp = Annotated[datetime | None, mapped_column(UTCDateTime(), nullable=True)]

metadata = MetaData(
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_N_name)s",
        "uq": "uq_%(table_name)s_%(column_0_N_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
        "pk": "pk_%(table_name)s",
    }
)


class Base(DeclarativeBase):
    """The declarative base of every model."""

    metadata = metadata


class Artifact(Base):
    """A published blob's metadata (the ``artifact`` object of API responses)."""

    __tablename__ = "artifacts"

    digest: Mapped[Hex64] = mapped_column(primary_key=True)
    size: Mapped[int] = mapped_column(BigInteger)
    kind: Mapped[str] = mapped_column(String(16))
    target: Mapped[str] = mapped_column(String(32))
    toolchain: Mapped[str] = mapped_column(String(128))
    kernel: Mapped[str] = mapped_column(String(1024), default="")
    lowered_names: Mapped[dict[str, str]] = mapped_column(JSON)
    compile_seconds: Mapped[float] = mapped_column(Float)
    log: Mapped[str] = mapped_column(Text, default="")
    dependencies: Mapped[list[dict[str, str]]] = mapped_column(JSON)
    dependencies_exact: Mapped[bool]
    created_at: Mapped[Stamp]
    last_used_at: Mapped[OptStamp]
    # kcache.deps.DEPENDENCY_CHECK of the compile that recorded `dependencies`; 0 for rows
    # older than read markers (migration 0008).
    dependency_check: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # True for a row `kcache serve --recreate-index` rebuilt from a blob alone (after the
    # database was lost): only digest, size, kind and target are known; the next compile
    # that produces these bytes replaces the rest.
    recovered: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())


class RecipeAlias(Base):
    """recipe_key -> the artifact it resolves to (exactly, or through a manifest match)."""

    __tablename__ = "recipe_aliases"

    recipe_key: Mapped[Hex64] = mapped_column(primary_key=True)
    digest: Mapped[Hex64] = mapped_column(
        ForeignKey("artifacts.digest", ondelete="CASCADE"), index=True
    )
    created_at: Mapped[Stamp]


class ManifestRow(Base):
    """Under a base key: the headers one compile read (with hashes) -> its artifact."""

    __tablename__ = "manifests"
    __table_args__ = (UniqueConstraint("base_key", "dependencies_hash"),)

    id: Mapped[int] = mapped_column(_BigId, primary_key=True, autoincrement=True)
    base_key: Mapped[Hex64] = mapped_column(index=True)
    dependencies_hash: Mapped[Hex64]
    digest: Mapped[Hex64] = mapped_column(
        ForeignKey("artifacts.digest", ondelete="CASCADE"), index=True
    )
    dependencies: Mapped[list[dict[str, str]]] = mapped_column(JSON)
    created_at: Mapped[Stamp]
    dependency_check: Mapped[int] = mapped_column(Integer, default=0, server_default="0")


class NegativeEntry(Base):
    """A recipe that failed to compile, with the compiler's log.

    ``kind`` is ``error`` (kept for good), ``timeout`` or ``too_large``; the last two
    carry ``expires_at``, after which the entry is ignored.
    """

    __tablename__ = "negative_entries"

    recipe_key: Mapped[Hex64] = mapped_column(primary_key=True)
    log: Mapped[str] = mapped_column(Text)
    created_at: Mapped[Stamp]
    kind: Mapped[str] = mapped_column(String(16), default="error", server_default="error")
    expires_at: Mapped[OptStamp]


class AuditEvent(Base):
    """One lookup outcome: ``hit``, ``local_hit``, ``compiled``, ``waited``, ``miss`` or ``error``."""

    __tablename__ = "audit_events"
    __table_args__ = (
        Index(None, "outcome", "at"),
        # /v1/stats' rank divergence, by index probes (0007): whether a digest of a
        # recipe was seen in a window (and by the server's own tier), and each rank's
        # last digest. The first also serves, by its prefix, every lookup by job.
        Index(None, "job_id", "base_key", "target", "digest", "tier", "at"),
        Index(None, "job_id", "base_key", "target", "rank", "at", "id"),
        # The last miss's reason: was a sibling recipe (other headers) built before it?
        Index(None, "base_key", "target", "recipe_key", "id"),
        # The last miss of a top missed kernel: one backward probe per kernel (0007).
        Index(None, "kernel", "at", "id"),
    )

    id: Mapped[int] = mapped_column(_BigId, primary_key=True, autoincrement=True)
    at: Mapped[Stamp] = mapped_column(index=True)
    outcome: Mapped[str] = mapped_column(String(16))
    tier: Mapped[str] = mapped_column(String(16))
    route: Mapped[str] = mapped_column(String(32))
    recipe_key: Mapped[str | None] = mapped_column(String(64), index=True)
    base_key: Mapped[str | None] = mapped_column(String(64))
    digest: Mapped[str | None] = mapped_column(String(64))
    kernel: Mapped[str | None] = mapped_column(String(1024))
    target: Mapped[str | None] = mapped_column(String(32))
    toolchain: Mapped[str | None] = mapped_column(String(128))
    error: Mapped[str | None] = mapped_column(String(64))
    client_id: Mapped[str | None] = mapped_column(String(256), index=True)
    host: Mapped[str | None] = mapped_column(String(256))
    pid: Mapped[int | None]
    job_id: Mapped[str | None] = mapped_column(String(256))
    rank: Mapped[int | None]
    world_size: Mapped[int | None]
    latency_ms: Mapped[float]  # the mean, when the row stands for several lookups
    compile_seconds_saved: Mapped[float]  # the sum over the row's lookups
    # How many identical lookups this row stands for: warm fetches are tallied per flush.
    count: Mapped[int] = mapped_column(BigInteger, default=1, server_default="1")
    # A miss's explanation (kcache.recipe_diff): the nearest recorded recipe of the
    # kernel and what differs from it, or "never seen" (0011).
    miss_reason: Mapped[str | None] = mapped_column(String(1024), nullable=True)
    # Who posted a client-reported event (POST /v1/events): "token:<name>", or
    # "client:<address>" on an open server; NULL for the server's own events and for
    # reports from before 0013.
    reporter: Mapped[str | None] = mapped_column(String(REPORTER_LENGTH), nullable=True)


class Token(Base):
    """A bearer token, stored as its sha256 (the token itself is shown once, at creation)."""

    __tablename__ = "tokens"

    id: Mapped[int] = mapped_column(_BigId, primary_key=True, autoincrement=True)
    name: Mapped[Name] = mapped_column(unique=True)
    token_hash: Mapped[Hex64] = mapped_column(unique=True)
    scopes: Mapped[str] = mapped_column(String(64))  # space-separated
    created_at: Mapped[Stamp]
    last_used_at: Mapped[OptStamp]
    revoked_at: Mapped[OptStamp]


class AuditRollup(Base):
    """Audit events older than the retention window, counted per hour instead of kept one by one.

    Rows are only ever inserted (never merged), so several roll-ups of the same hour
    simply add up in queries; that keeps concurrent roll-ups on several replicas safe
    without a unique constraint over nullable columns.
    """

    __tablename__ = "audit_rollups"

    id: Mapped[int] = mapped_column(_BigId, primary_key=True, autoincrement=True)
    bucket: Mapped[Stamp] = mapped_column(index=True)
    outcome: Mapped[str] = mapped_column(String(16))
    tier: Mapped[str] = mapped_column(String(16))
    kernel: Mapped[str | None] = mapped_column(String(1024))
    target: Mapped[str | None] = mapped_column(String(32))
    client_id: Mapped[str | None] = mapped_column(String(256))
    job_id: Mapped[str | None] = mapped_column(String(256), index=True)
    rank: Mapped[int | None]
    count: Mapped[int] = mapped_column(BigInteger)
    latency_ms_sum: Mapped[float]
    compile_seconds_saved: Mapped[float]
    last_at: Mapped[Stamp]
    last_error: Mapped[str | None] = mapped_column(String(64))
    reporter: Mapped[str | None] = mapped_column(String(REPORTER_LENGTH), nullable=True)  # 0013


class AuditReportWindow(Base):
    """Lookups one reporter (a token) posted in one minute of arrival: its bound, kept exact.

    ``POST /v1/events`` adds a batch here in the batch's own transaction and reads the
    sum back (``INSERT ... ON CONFLICT DO UPDATE ... RETURNING``), so replicas share one
    count and concurrent batches of one token queue on its row; a batch that takes the
    sum past ``audit.max_reported_per_minute`` rolls back with everything it wrote.
    Only the current minute matters: a reporter's older rows go with its next batch.
    """

    __tablename__ = "audit_report_windows"

    reporter: Mapped[str] = mapped_column(String(REPORTER_LENGTH), primary_key=True)
    minute: Mapped[Stamp] = mapped_column(primary_key=True)  # its start
    lookups: Mapped[int] = mapped_column(BigInteger)
    events: Mapped[int] = mapped_column(BigInteger)


class AuditCount(Base):
    """Lookups per time bucket, dimension, group value and outcome, kept as events are written.

    See :mod:`kcache_server.auditing.counts`: ``key``/``key2`` hold the group value
    encoded (``""`` for NULL), so the primary key has no NULL and concurrent writers
    merge with ``ON CONFLICT DO UPDATE``. ``tier`` is set for dimension ``all`` only,
    ``world_size`` (the largest seen) for dimension ``job`` only.
    """

    __tablename__ = "audit_counts"

    dim: Mapped[str] = mapped_column(String(16), primary_key=True)
    level: Mapped[int] = mapped_column(Integer, primary_key=True)  # bucket width, seconds
    bucket: Mapped[Stamp] = mapped_column(primary_key=True)
    key: Mapped[str] = mapped_column(Text, primary_key=True)
    key2: Mapped[str] = mapped_column(Text, primary_key=True)
    outcome: Mapped[str] = mapped_column(String(16), primary_key=True)
    tier: Mapped[str] = mapped_column(String(16), primary_key=True)
    count: Mapped[int] = mapped_column(BigInteger)
    saved: Mapped[float]  # compile seconds saved
    world_size: Mapped[int | None]


class AuditDigest(Base):
    """A digest one job got for one recipe (base key and target), first and last seen.

    Two rows under one (job, base key, target) make it a divergence candidate for
    ``/v1/stats``, which confirms it from the raw events. ``target`` is encoded like
    :class:`AuditCount` keys.
    """

    __tablename__ = "audit_digests"

    job_id: Mapped[str] = mapped_column(String(256), primary_key=True)
    base_key: Mapped[str] = mapped_column(String(64), primary_key=True)
    target: Mapped[str] = mapped_column(String(33), primary_key=True)
    digest: Mapped[str] = mapped_column(String(64), primary_key=True)
    first_at: Mapped[Stamp]
    last_at: Mapped[Stamp] = mapped_column(index=True)


class AuditDivergence(Base):
    """A recipe (base key and target) that one job got two or more digests for, ever.

    The few rows :class:`AuditDigest` groups with two digests, kept as they appear
    (:mod:`kcache_server.auditing.counts`), so ``/v1/stats`` starts from them
    instead of grouping every (job, recipe) pair ever seen. ``target`` is encoded
    like :class:`AuditCount` keys.
    """

    __tablename__ = "audit_divergences"

    job_id: Mapped[str] = mapped_column(String(256), primary_key=True)
    base_key: Mapped[str] = mapped_column(String(64), primary_key=True)
    target: Mapped[str] = mapped_column(String(33), primary_key=True)


#: Characters of a kernel lookup's miss reason (``audit_lookups.reason``).
LOOKUP_REASON_LENGTH = 96


class AuditLookup(Base):
    """A kernel lookup: one process's first lookup of one recipe, what it needed (0016).

    What the hit rate and the compile time saved count everywhere
    (:mod:`kcache_server.auditing.lookups`): a process's later lookups of the recipe
    (memory re-reads, repeated fetches) are repeats, in ``audit_events`` only.
    ``process`` is a hash of the lookup's job, rank, host, pid and client id (NULL when
    it named none: each such row is its own lookup, ``count`` of them); ``identity`` the
    recipe key (else a hash of what names the kernel). ``hit``: it needed no compile
    anywhere (the first lookup found the kernel, and no rank of its job compiled it);
    ``saved``: the compile time it avoided (its process got the kernel without compiling
    or waiting for a compile). Both are decided when the lookup is recorded.
    """

    __tablename__ = "audit_lookups"
    __table_args__ = (
        Index(None, "process", "identity", unique=True),
        Index(None, "job_id", "at"),
        Index(None, "kernel", "at"),
    )

    id: Mapped[int] = mapped_column(_BigId, primary_key=True, autoincrement=True)
    at: Mapped[Stamp] = mapped_column(index=True)
    process: Mapped[str | None] = mapped_column(String(64), nullable=True)
    identity: Mapped[str] = mapped_column(String(64))
    outcome: Mapped[str] = mapped_column(String(16))
    tier: Mapped[str] = mapped_column(String(16))
    hit: Mapped[bool] = mapped_column(Boolean)
    reason: Mapped[str | None] = mapped_column(String(LOOKUP_REASON_LENGTH), nullable=True)
    count: Mapped[int] = mapped_column(BigInteger)
    saved: Mapped[float]
    recipe_key: Mapped[str | None] = mapped_column(String(64), nullable=True)
    base_key: Mapped[str | None] = mapped_column(String(64), nullable=True)
    digest: Mapped[str | None] = mapped_column(String(64), nullable=True)
    kernel: Mapped[str | None] = mapped_column(String(1024), nullable=True)
    target: Mapped[str | None] = mapped_column(String(32), nullable=True)
    client_id: Mapped[str | None] = mapped_column(String(256), nullable=True)
    job_id: Mapped[str | None] = mapped_column(String(256), nullable=True)
    rank: Mapped[int | None]
    reporter: Mapped[str | None] = mapped_column(String(REPORTER_LENGTH), nullable=True)


class AuditJobBuild(Base):
    """A recipe (by its lookup ``identity``) that some rank of a job compiled or joined a compile of.

    A later lookup of it by the same job needed that compile: it is no hit, whatever tier
    answered it (:mod:`kcache_server.auditing.lookups`). Kept as the compiles are recorded.
    """

    __tablename__ = "audit_job_builds"

    job_id: Mapped[str] = mapped_column(String(256), primary_key=True)
    identity: Mapped[str] = mapped_column(String(64), primary_key=True)
    at: Mapped[Stamp] = mapped_column(index=True)


class Pin(Base):
    """A recipe key whose artifact eviction never removes (a release's kernels, a job's warmup set).

    ``group_name`` labels pins made together ("" for none), so they can be listed
    and removed together. A pin may name a key that has no artifact yet: it
    protects the artifact from the moment one is compiled.
    """

    __tablename__ = "pins"
    __table_args__ = (UniqueConstraint("recipe_key", "group_name"),)

    id: Mapped[int] = mapped_column(_BigId, primary_key=True, autoincrement=True)
    recipe_key: Mapped[Hex64]
    group_name: Mapped[str] = mapped_column(String(256), index=True, default="", server_default="")
    created_at: Mapped[Stamp]
    created_by: Mapped[str | None] = mapped_column(String(300))


class EvictionLogEntry(Base):
    """One artifact removed from the store (by the least-recently-used evictor or by an admin), logged.

    The log feeds ``/v1/stats`` (evictions, bytes freed) and tells every replica which
    recipe keys to drop from its in-memory caches (rows are read in ``id`` order; all
    inserts happen under the one-evictor lock, so ids commit in order).
    """

    __tablename__ = "evictions"

    id: Mapped[int] = mapped_column(_BigId, primary_key=True, autoincrement=True)
    at: Mapped[Stamp] = mapped_column(index=True)
    digest: Mapped[Hex64]
    size: Mapped[int] = mapped_column(BigInteger)
    recipe_keys: Mapped[list[str]] = mapped_column(JSON)
    reason: Mapped[str] = mapped_column(String(16))  # lru | removed | cleared


class CompileCharge(Base):
    """Who caused an artifact to be compiled, for per-token storage quotas.

    Written when the compile finishes, before the artifact row exists (hence no
    foreign key); a charge counts only while an artifact row with its digest does.
    """

    __tablename__ = "compile_charges"

    digest: Mapped[Hex64] = mapped_column(primary_key=True)
    caller: Mapped[str] = mapped_column(String(300), index=True)
    size: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[Stamp]


class QuotaAccount(Base):
    """One row per caller that compiled under a quota: the row its reservations lock.

    :mod:`kcache_server.quotas` upserts it as the first statement of every reserve
    and settle transaction, so one caller's reservations are decided one at a time
    across processes and replicas (a row lock on PostgreSQL, the write lock on SQLite).
    """

    __tablename__ = "quota_accounts"

    caller: Mapped[str] = mapped_column(String(300), primary_key=True)
    touched_at: Mapped[Stamp]


class QuotaReservation(Base):
    """Bytes of a caller's quota promised to one compile in progress.

    Deleted when the compile settles (its charge replaces it) or fails; one whose
    process died stops counting at ``expires_at`` and is deleted by the caller's
    next reservation.
    """

    __tablename__ = "quota_reservations"

    id: Mapped[int] = mapped_column(_BigId, primary_key=True, autoincrement=True)
    caller: Mapped[str] = mapped_column(String(300), index=True)
    size: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[Stamp]
    expires_at: Mapped[Stamp]


class VerificationEvent(Base):
    """One artifact the server compiled again to check what it serves, and what it found.

    ``result`` is ``same_bytes``, ``same_code`` (equal after normalising NVRTC's random
    symbol tags), ``diverged``, ``inconclusive`` (LTO-IR differing in bytes only) or ``failed``; ``differences`` lists what differed (code, dependencies,
    lowered names), ``via`` how the artifact had been served (``key`` or ``manifest``).
    """

    __tablename__ = "verification_events"

    id: Mapped[int] = mapped_column(_BigId, primary_key=True, autoincrement=True)
    at: Mapped[Stamp] = mapped_column(index=True)
    recipe_key: Mapped[Hex64] = mapped_column(index=True)
    base_key: Mapped[Hex64]
    via: Mapped[str] = mapped_column(String(16))
    result: Mapped[str] = mapped_column(String(16), index=True)
    stored_digest: Mapped[Hex64]
    fresh_digest: Mapped[str | None] = mapped_column(String(64), nullable=True)
    kernel: Mapped[str] = mapped_column(String(1024), default="")
    differences: Mapped[list[str]] = mapped_column(JSON)
    seconds: Mapped[float] = mapped_column(Float)


class RecipeRecord(Base):
    """A recipe the server compiled or served through a manifest match, kept to explain misses.

    ``fingerprint`` is :func:`kcache.recipe_diff.fingerprint` (headers by hash, flags,
    target, toolchain, ...); ``recipe_zlib`` the whole recipe (``Recipe.to_dict()`` as
    JSON, zlib-compressed) where that is at most 256 KiB, else NULL. Written by
    :mod:`kcache_server.recipe_records`.
    """

    __tablename__ = "recipe_records"
    __table_args__ = (
        # A miss's candidates: the most recent recipes of the same base key, and of the
        # same program name and source, each a backward probe of its index.
        Index(None, "base_key", "last_seen_at"),
        Index(None, "source_sha256", "name", "last_seen_at"),
    )

    recipe_key: Mapped[Hex64] = mapped_column(primary_key=True)
    base_key: Mapped[Hex64]
    name: Mapped[str] = mapped_column(String(300))
    source_sha256: Mapped[Hex64]
    fingerprint: Mapped[dict[str, Any]] = mapped_column(JSON)
    recipe_zlib: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)
    created_at: Mapped[Stamp]
    last_seen_at: Mapped[Stamp]


#: Characters of a withdrawal's ``reason`` kept (what differed, cut short).
WITHDRAWAL_REASON_LENGTH = 256


class Withdrawal(Base):
    """A binding (recipe key -> digest) that stopped holding: the key no longer answers the digest.

    Written by :meth:`SqlIndex.withdraw_binding <kcache_server.index.SqlIndex.withdraw_binding>`
    in the transaction that removes the binding (its alias and its base key's manifest
    entries naming the digest), one at a time (ids commit in order). Every replica and
    worker process reads the rows after the last id it saw and drops the key from
    memory; clients read them from ``GET /v1/withdrawals``. Never pruned: a node tier
    that was offline for a month must still learn what it may not answer.
    """

    __tablename__ = "withdrawals"

    id: Mapped[int] = mapped_column(_BigId, primary_key=True, autoincrement=True)
    at: Mapped[Stamp]
    recipe_key: Mapped[Hex64]
    digest: Mapped[Hex64]
    reason: Mapped[str] = mapped_column(String(WITHDRAWAL_REASON_LENGTH))


#: Characters of a signing key's ``note`` kept (why it was retired).
SIGNING_KEY_NOTE_LENGTH = 256


class SigningKeyRow(Base):
    """A public key the servers sharing this database sign answers with, or once did.

    Written at start-up by :mod:`kcache_server.signing_keys`: a server records its own
    key, and refuses to start when another key is the one in use (``active``), since
    clients given the fleet's key would refuse its answers. ``active`` is true for the
    key in use and NULL for every other (a unique column: at most one key is in use,
    which the database itself holds to when two replicas start at once). A rotation
    (a server started with the key before it as ``signing_previous_key_file``) retires
    the previous key (``retired_by`` ``rotation``); ``kcache db signing-keys retire``
    retires one for good (``operator``: a lost or compromised key never signs again).
    """

    __tablename__ = "signing_keys"

    key_id: Mapped[str] = mapped_column(String(16), primary_key=True)
    public_key: Mapped[str] = mapped_column(String(64))  # base64url of the 32 raw bytes
    active: Mapped[bool | None] = mapped_column(Boolean, nullable=True, unique=True)
    recorded_at: Mapped[Stamp]
    last_started_at: Mapped[OptStamp]
    retired_at: Mapped[OptStamp]
    retired_by: Mapped[str | None] = mapped_column(String(16), nullable=True)
    note: Mapped[str | None] = mapped_column(String(SIGNING_KEY_NOTE_LENGTH), nullable=True)


#: Bounds of a foreign binding's names (docs/design.md section 10), as the routes check them.
FOREIGN_LIBRARY_LENGTH = 32
FOREIGN_LABEL_LENGTH = 128
FOREIGN_KEY_LENGTH = 256
FOREIGN_FILE_NAME_LENGTH = 256


class ForeignBinding(Base):
    """A group of files a library's own cache hook published under the library's key.

    Named by (library, version, target, toolchain, key) as the library reports them;
    ``binding_key`` is the sha256 of that name (:func:`kcache.foreign.binding_key`),
    unique. ``writer`` is who published it (``token:<name>``, ``client:<address>``): the
    server signs "published by <writer>", never "compiled by kcache". The first publish
    of a name wins; its files are ``foreign_files`` rows, written in the same transaction.
    """

    __tablename__ = "foreign_bindings"

    id: Mapped[int] = mapped_column(_BigId, primary_key=True, autoincrement=True)
    binding_key: Mapped[Hex64] = mapped_column(unique=True)
    library: Mapped[str] = mapped_column(String(FOREIGN_LIBRARY_LENGTH))
    version: Mapped[str] = mapped_column(String(FOREIGN_LABEL_LENGTH))
    target: Mapped[str] = mapped_column(String(FOREIGN_LABEL_LENGTH))
    toolchain: Mapped[str] = mapped_column(String(FOREIGN_LABEL_LENGTH))
    key: Mapped[str] = mapped_column(String(FOREIGN_KEY_LENGTH))
    writer: Mapped[str] = mapped_column(String(REPORTER_LENGTH))
    size: Mapped[int] = mapped_column(BigInteger)  # the group's bytes, all files
    published_at: Mapped[Stamp]
    last_used_at: Mapped[Stamp] = mapped_column(index=True)


class ForeignFile(Base):
    """One file of a foreign binding's group: its name in the group and its blob."""

    __tablename__ = "foreign_files"
    __table_args__ = (UniqueConstraint("binding_id", "name"),)

    id: Mapped[int] = mapped_column(_BigId, primary_key=True, autoincrement=True)
    binding_id: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer(), "sqlite"),
        ForeignKey("foreign_bindings.id", ondelete="CASCADE"),
    )
    name: Mapped[str] = mapped_column(String(FOREIGN_FILE_NAME_LENGTH))
    digest: Mapped[Hex64] = mapped_column(index=True)
    size: Mapped[int] = mapped_column(BigInteger)


# Each model's Core table, typed as sa.Table (a declarative class's ``__table__`` is typed
# as a FromClause), for the modules that query with Core: import these, do not cast again.

artifacts_table = cast(Table, Artifact.__table__)
recipe_aliases_table = cast(Table, RecipeAlias.__table__)
manifests_table = cast(Table, ManifestRow.__table__)
negative_entries_table = cast(Table, NegativeEntry.__table__)
audit_events_table = cast(Table, AuditEvent.__table__)
tokens_table = cast(Table, Token.__table__)
audit_rollups_table = cast(Table, AuditRollup.__table__)
audit_report_windows_table = cast(Table, AuditReportWindow.__table__)
audit_counts_table = cast(Table, AuditCount.__table__)
audit_digests_table = cast(Table, AuditDigest.__table__)
audit_divergences_table = cast(Table, AuditDivergence.__table__)
audit_lookups_table = cast(Table, AuditLookup.__table__)
audit_job_builds_table = cast(Table, AuditJobBuild.__table__)
pins_table = cast(Table, Pin.__table__)
evictions_table = cast(Table, EvictionLogEntry.__table__)
compile_charges_table = cast(Table, CompileCharge.__table__)
quota_accounts_table = cast(Table, QuotaAccount.__table__)
quota_reservations_table = cast(Table, QuotaReservation.__table__)
verification_events_table = cast(Table, VerificationEvent.__table__)
recipe_records_table = cast(Table, RecipeRecord.__table__)
withdrawals_table = cast(Table, Withdrawal.__table__)
signing_keys_table = cast(Table, SigningKeyRow.__table__)
foreign_bindings_table = cast(Table, ForeignBinding.__table__)
foreign_files_table = cast(Table, ForeignFile.__table__)
