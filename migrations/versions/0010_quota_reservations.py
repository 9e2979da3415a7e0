"""Quota reservations: bytes promised to compiles in progress, and the per-caller row they lock.

``quota_accounts`` (one row per caller) is upserted first by every reserve and settle
transaction of :mod:`kcache_server.quotas`, which serializes one caller's decisions
across replicas; ``quota_reservations`` holds what each compile in progress was
promised, until it settles, fails or expires.

Revision ID: 0010
Revises: 0008
Create Date: 2027-01-12
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    """Apply this revision."""
    op.create_table(
        "quota_accounts",
        sa.Column("caller", sa.String(length=300), nullable=False),
        sa.Column("touched_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("caller", name=op.f("pk_quota_accounts")),
    )
    op.create_table(
        "quota_reservations",
        sa.Column("id", _ID, autoincrement=True, nullable=False),
        sa.Column("caller", sa.String(length=300), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_quota_reservations")),
    )
    with op.batch_alter_table("quota_reservations", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_quota_reservations_caller"), ["caller"], unique=False)


def downgrade() -> None:
    """Revert this revision."""
    with op.batch_alter_table("quota_reservations", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_quota_reservations_caller"))
    op.drop_table("quota_reservations")
    op.drop_table("quota_accounts")
