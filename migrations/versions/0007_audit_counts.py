"""Audit counts kept as events are written, divergence candidates, and a last-miss index.

``audit_counts`` (per minute/hour/day bucket, dimension, group value and outcome) and
``audit_digests`` (job, base key, target, digest, first and last seen) are maintained
by every audit write (:mod:`kcache_server.auditing.counts`), with ``audit_divergences``
(the recipes one job got two digests for); ``/v1/stats`` sums them instead of
scanning ``audit_events``. The upgrade backfills both from the events and
roll-ups already there, with the same bulk statements the B10 bench uses
(:func:`~kcache_server.auditing.counts.rebuild`). ``audit_events (kernel, at, id)``
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

import sqlalchemy as sa
from alembic import op

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

    # The backfill is the application's own bulk rebuild, so the counts a 0006 database
    # gets are exactly what the writer would have kept. It reads only columns that exist
    # at this revision; should it ever read a later one, freeze a copy of it here.
    from kcache_server.auditing.counts import rebuild

    rebuild(op.get_bind())


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
