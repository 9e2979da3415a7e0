"""``verification_events``: what the server found when it compiled served artifacts again.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Apply this revision."""
    op.create_table(
        "verification_events",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("recipe_key", sa.String(length=64), nullable=False),
        sa.Column("base_key", sa.String(length=64), nullable=False),
        sa.Column("via", sa.String(length=16), nullable=False),
        sa.Column("result", sa.String(length=16), nullable=False),
        sa.Column("stored_digest", sa.String(length=64), nullable=False),
        sa.Column("fresh_digest", sa.String(length=64), nullable=True),
        sa.Column("kernel", sa.String(length=1024), nullable=False),
        sa.Column("differences", sa.JSON(), nullable=False),
        sa.Column("seconds", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("verification_events") as batch:
        batch.create_index("ix_verification_events_at", ["at"])
        batch.create_index("ix_verification_events_recipe_key", ["recipe_key"])
        batch.create_index("ix_verification_events_result", ["result"])


def downgrade() -> None:
    """Revert this revision."""
    op.drop_table("verification_events")
