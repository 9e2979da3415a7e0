"""Negative entries get a kind and an expiry (timeouts, oversized output); artifacts a recovered flag.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Apply this revision."""
    with op.batch_alter_table("negative_entries") as batch:
        batch.add_column(
            sa.Column("kind", sa.String(length=16), server_default="error", nullable=False)
        )
        batch.add_column(sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True))
    with op.batch_alter_table("artifacts") as batch:
        batch.add_column(
            sa.Column("recovered", sa.Boolean(), server_default=sa.false(), nullable=False)
        )


def downgrade() -> None:
    """Revert this revision."""
    with op.batch_alter_table("artifacts") as batch:
        batch.drop_column("recovered")
    with op.batch_alter_table("negative_entries") as batch:
        batch.drop_column("expires_at")
        batch.drop_column("kind")
