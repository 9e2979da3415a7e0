"""Audit roll-ups: hourly counts that replace audit events older than the retention window.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Apply this revision."""
    op.create_table(
        "audit_rollups",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("bucket", sa.DateTime(timezone=True), nullable=False),
        sa.Column("outcome", sa.String(length=16), nullable=False),
        sa.Column("tier", sa.String(length=16), nullable=False),
        sa.Column("kernel", sa.String(length=1024), nullable=True),
        sa.Column("target", sa.String(length=32), nullable=True),
        sa.Column("client_id", sa.String(length=256), nullable=True),
        sa.Column("job_id", sa.String(length=256), nullable=True),
        sa.Column("rank", sa.Integer(), nullable=True),
        sa.Column("count", sa.BigInteger(), nullable=False),
        sa.Column("latency_ms_sum", sa.Double(), nullable=False),
        sa.Column("compile_seconds_saved", sa.Double(), nullable=False),
        sa.Column("last_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_error", sa.String(length=64), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_audit_rollups")),
    )
    with op.batch_alter_table("audit_rollups", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_audit_rollups_bucket"), ["bucket"], unique=False)
        batch_op.create_index(batch_op.f("ix_audit_rollups_job_id"), ["job_id"], unique=False)


def downgrade() -> None:
    """Revert this revision."""
    with op.batch_alter_table("audit_rollups", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_audit_rollups_job_id"))
        batch_op.drop_index(batch_op.f("ix_audit_rollups_bucket"))
    op.drop_table("audit_rollups")
