"""Audit events carry a count: identical warm fetches within one flush become one row.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Apply this revision."""
    with op.batch_alter_table("audit_events") as batch:
        batch.add_column(sa.Column("count", sa.BigInteger(), server_default="1", nullable=False))


def downgrade() -> None:
    """Revert this revision."""
    with op.batch_alter_table("audit_events") as batch:
        batch.drop_column("count")
