"""Audit counts kept as events are written, divergence candidates, and a last-miss index.

``audit_counts`` (per minute/hour/day bucket, dimension, group value and outcome) and
``audit_digests`` (job, base key, target, digest, first and last seen) are maintained
by every audit write (:mod:`kcache_server.auditing.counts`), with ``audit_divergences``
(the recipes one job got two digests for); ``/v1/stats`` sums them instead of
scanning ``audit_events``. The upgrade backfills both from the events and
roll-ups already there, with the bulk statements of ``kcache_server.auditing.counts.rebuild``, frozen
here as they were when this revision was written (commit 13177d1), for a database
at 0006 (no ``reporter`` column, 0013). ``audit_events (kernel, at, id)``
replaces the ``kernel`` index: the last miss of a kernel is one backward probe.
Divergence is decided by probes too: ``(job_id, base_key, target, digest, tier, at)``
replaces 0006's index without ``at`` (was a digest seen in the window, by the
server?), and ``(job_id, base_key, target, rank, at, id)`` finds a rank's last digest;
``(base_key, target, recipe_key, id)`` tells whether a sibling recipe (other headers)
was built before a kernel's last miss.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql, sqlite

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Apply this revision."""
    op.create_table(
        "audit_counts",
        sa.Column("dim", sa.String(length=16), nullable=False),
        sa.Column("level", sa.Integer(), nullable=False),
        sa.Column("bucket", sa.DateTime(timezone=True), nullable=False),
        sa.Column("key", sa.Text(), nullable=False),
        sa.Column("key2", sa.Text(), nullable=False),
        sa.Column("outcome", sa.String(length=16), nullable=False),
        sa.Column("tier", sa.String(length=16), nullable=False),
        sa.Column("count", sa.BigInteger(), nullable=False),
        sa.Column("saved", sa.Double(), nullable=False),
        sa.Column("world_size", sa.Integer(), nullable=True),
        sa.PrimaryKeyConstraint(
            "dim", "level", "bucket", "key", "key2", "outcome", "tier", name=op.f("pk_audit_counts")
        ),
    )
    op.create_table(
        "audit_digests",
        sa.Column("job_id", sa.String(length=256), nullable=False),
        sa.Column("base_key", sa.String(length=64), nullable=False),
        sa.Column("target", sa.String(length=33), nullable=False),
        sa.Column("digest", sa.String(length=64), nullable=False),
        sa.Column("first_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint(
            "job_id", "base_key", "target", "digest", name=op.f("pk_audit_digests")
        ),
    )
    op.create_table(
        "audit_divergences",
        sa.Column("job_id", sa.String(length=256), nullable=False),
        sa.Column("base_key", sa.String(length=64), nullable=False),
        sa.Column("target", sa.String(length=33), nullable=False),
        sa.PrimaryKeyConstraint("job_id", "base_key", "target", name=op.f("pk_audit_divergences")),
    )
    with op.batch_alter_table("audit_digests", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_audit_digests_last_at"), ["last_at"], unique=False)
    with op.batch_alter_table("audit_events", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_audit_events_kernel_at_id"), ["kernel", "at", "id"], unique=False
        )
        batch_op.drop_index(batch_op.f("ix_audit_events_kernel"))
        batch_op.create_index(
            batch_op.f("ix_audit_events_job_id_base_key_target_digest_tier_at"),
            ["job_id", "base_key", "target", "digest", "tier", "at"],
            unique=False,
        )
        batch_op.drop_index(batch_op.f("ix_audit_events_job_id_base_key_target_digest_tier"))
        batch_op.create_index(
            batch_op.f("ix_audit_events_job_id_base_key_target_rank_at_id"),
            ["job_id", "base_key", "target", "rank", "at", "id"],
            unique=False,
        )
        batch_op.create_index(
            batch_op.f("ix_audit_events_base_key_target_recipe_key_id"),
            ["base_key", "target", "recipe_key", "id"],
            unique=False,
        )

    # The backfill: the counts a 0006 database gets are what the writer would have kept.
    _rebuild(op.get_bind())


def downgrade() -> None:
    """Revert this revision."""
    with op.batch_alter_table("audit_events", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_audit_events_base_key_target_recipe_key_id"))
        batch_op.drop_index(batch_op.f("ix_audit_events_job_id_base_key_target_rank_at_id"))
        batch_op.create_index(
            batch_op.f("ix_audit_events_job_id_base_key_target_digest_tier"),
            ["job_id", "base_key", "target", "digest", "tier"],
            unique=False,
        )
        batch_op.drop_index(batch_op.f("ix_audit_events_job_id_base_key_target_digest_tier_at"))
        batch_op.create_index(batch_op.f("ix_audit_events_kernel"), ["kernel"], unique=False)
        batch_op.drop_index(batch_op.f("ix_audit_events_kernel_at_id"))
    with op.batch_alter_table("audit_digests", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_audit_digests_last_at"))
    op.drop_table("audit_divergences")
    op.drop_table("audit_digests")
    op.drop_table("audit_counts")


# ------------------------------------------------------------------ the frozen backfill
# kcache_server.auditing.counts.rebuild as at 13177d1, trimmed to a 0006 database: no
# ``reporter`` column, so no ``reporter`` dimension. The tables as they are at 0007.
_events = sa.table(
    "audit_events",
    *(sa.column(c, sa.DateTime(timezone=True)) for c in ("at",)),
    *(sa.column(c, sa.String()) for c in ("outcome", "tier", "kernel", "target", "client_id")),
    *(sa.column(c, sa.String()) for c in ("job_id", "base_key", "digest")),
    *(sa.column(c, sa.Integer()) for c in ("rank", "world_size")),
    sa.column("count", sa.BigInteger()),
    sa.column("compile_seconds_saved", sa.Float()),
)
_rollups = sa.table(
    "audit_rollups",
    sa.column("bucket", sa.DateTime(timezone=True)),
    *(sa.column(c, sa.String()) for c in ("outcome", "tier", "kernel", "target", "client_id")),
    sa.column("job_id", sa.String()),
    sa.column("rank", sa.Integer()),
    sa.column("count", sa.BigInteger()),
    sa.column("compile_seconds_saved", sa.Float()),
)
_counts = sa.table(
    "audit_counts",
    *(sa.column(c, sa.String()) for c in ("dim", "key", "key2", "outcome", "tier")),
    sa.column("level", sa.Integer()),
    sa.column("bucket", sa.DateTime(timezone=True)),
    sa.column("count", sa.BigInteger()),
    sa.column("saved", sa.Float()),
    sa.column("world_size", sa.Integer()),
)
_digests = sa.table(
    "audit_digests",
    *(sa.column(c, sa.String()) for c in ("job_id", "base_key", "target", "digest")),
    *(sa.column(c, sa.DateTime(timezone=True)) for c in ("first_at", "last_at")),
)
_divergences = sa.table(
    "audit_divergences", *(sa.column(c, sa.String()) for c in ("job_id", "base_key", "target"))
)

MINUTE, HOUR, DAY = 60, 3600, 86400
#: dimension -> (first key column, second key column) of ``audit_events`` ("" for none).
DIMENSIONS: dict[str, tuple[str, str]] = {
    "all": ("", ""),
    "kernel": ("kernel", ""),
    "target": ("target", ""),
    "client": ("client_id", ""),
    "job": ("job_id", ""),
    "rank": ("rank", ""),
    "job_rank": ("job_id", "rank"),
}
#: dimension -> bucket widths (seconds) it is counted at, coarsest first.
LEVELS: dict[str, tuple[int, ...]] = {
    dim: (DAY, HOUR, MINUTE) if dim == "all" else (DAY, HOUR) for dim in DIMENSIONS
}
_COUNT_KEY = ("dim", "level", "bucket", "key", "key2", "outcome", "tier")
_DIGEST_KEY = ("job_id", "base_key", "target", "digest")
_RECIPE_KEY = ("job_id", "base_key", "target")


def _bucket_sql(conn: sa.Connection, column: Any, level: int) -> sa.ColumnElement[Any]:
    """``column`` floored to ``level`` seconds in UTC, stored as ``UTCDateTime`` stores it."""
    if conn.dialect.name == "postgresql":
        unit = {MINUTE: "minute", HOUR: "hour", DAY: "day"}[level]
        return sa.func.date_trunc(unit, column, "UTC")
    # SQLite keeps "YYYY-MM-DD HH:MM:SS.ffffff" text: cutting it is several times
    # cheaper than strftime, which parses every row.
    keep, pad = {MINUTE: (16, ":00.000000"), HOUR: (13, ":00:00.000000")}.get(
        level, (10, " 00:00:00.000000")
    )
    return sa.func.substr(column, 1, keep, type_=sa.String()).concat(pad)


def _encode_sql(column: Any) -> sa.ColumnElement[Any]:
    """A group value as the writer stores it: ``""`` for NULL, ``"=" + value`` otherwise."""
    text = sa.cast(column, sa.Text) if isinstance(column.type, sa.Integer) else column
    return sa.case((column.is_(None), ""), else_=sa.literal("=") + text)


def _rebuild(conn: sa.Connection) -> None:
    """Compute ``audit_counts``, ``audit_digests`` and ``audit_divergences`` from events and roll-ups.

    Each dimension's finest level is read from the events, its coarser ones from that
    level's rows; a roll-up keeps only the hour, so its minute counts fall at the hour.
    """
    conn.execute(sa.delete(_counts))
    conn.execute(sa.delete(_digests))
    conn.execute(sa.delete(_divergences))
    ev, ru = _events.c, _rollups.c
    columns = ("outcome", "tier", "kernel", "target", "client_id", "job_id", "rank")
    src = sa.union_all(
        sa.select(
            ev.at.label("at"),
            *(ev[c] for c in columns),
            ev["count"].label("n"),
            ev.compile_seconds_saved.label("saved"),
            ev.world_size.label("world_size"),
        ),
        sa.select(
            ru.bucket.label("at"),
            *(ru[c] for c in columns),
            ru["count"].label("n"),
            ru.compile_seconds_saved.label("saved"),
            sa.cast(sa.null(), sa.Integer).label("world_size"),
        ),
    ).subquery("src")
    target = [*_COUNT_KEY, "count", "saved", "world_size"]
    for dim, (first, second) in DIMENSIONS.items():
        finest, *coarser = LEVELS[dim][::-1]
        bucket = _bucket_sql(conn, src.c.at, finest)
        key = _encode_sql(src.c[first]) if first else sa.literal("")
        key2 = _encode_sql(src.c[second]) if second else sa.literal("")
        tier = src.c.tier if dim == "all" else sa.literal("")
        size = sa.func.max(src.c.world_size) if dim == "job" else sa.cast(sa.null(), sa.Integer)
        group = (bucket, key, key2, src.c.outcome, tier)
        conn.execute(
            sa.insert(_counts).from_select(
                target,
                sa.select(
                    sa.literal(dim),
                    sa.literal(finest),
                    *group,
                    sa.func.sum(src.c.n),
                    sa.func.sum(src.c.saved),
                    size,
                )
                .group_by(*group)
                # In primary-key order: the index grows at its end instead of at random.
                .order_by(*group),
            )
        )
        co = _counts.c
        for level in coarser:
            bucket = _bucket_sql(conn, co.bucket, level)
            group = (bucket, co.key, co.key2, co.outcome, co.tier)
            conn.execute(
                sa.insert(_counts).from_select(
                    target,
                    sa.select(
                        sa.literal(dim),
                        sa.literal(level),
                        *group,
                        sa.func.sum(co["count"]),
                        sa.func.sum(co.saved),
                        sa.func.max(co.world_size),
                    )
                    .where(co.dim == dim, co.level == finest)
                    .group_by(*group)
                    .order_by(*group),
                )
            )
    recipe = (ev.job_id, ev.base_key, _encode_sql(ev.target), ev.digest)
    conn.execute(
        sa.insert(_digests).from_select(
            [*_DIGEST_KEY, "first_at", "last_at"],
            sa.select(*recipe, sa.func.min(ev.at), sa.func.max(ev.at))
            .where(ev.job_id.is_not(None), ev.base_key.is_not(None), ev.digest.is_not(None))
            .group_by(*recipe),
        )
    )
    # Every recipe with two digests is a divergence (mark_divergences(conn, None)).
    dg = _digests.c
    pick = sa.select(dg.job_id, dg.base_key, dg.target)
    dialect = postgresql if conn.dialect.name == "postgresql" else sqlite
    stmt = dialect.insert(_divergences).from_select(
        list(_RECIPE_KEY),
        pick.group_by(dg.job_id, dg.base_key, dg.target).having(sa.func.count() > 1),
    )
    conn.execute(stmt.on_conflict_do_nothing())
