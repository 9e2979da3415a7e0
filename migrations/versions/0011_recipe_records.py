"""Recipe records and explained misses: ``recipe_records`` and ``audit_events.miss_reason``.

``recipe_records`` keeps each recipe the server compiled or served through a manifest
match: its fingerprint (what tells recipes of one kernel apart, headers by hash) and,
where it is small enough, the whole recipe compressed. A miss is explained against
the nearest of them (same program name and source, or same base key), and the
explanation is kept with the audit row as ``miss_reason``.

Revision ID: 0011
Revises: 0010
Create Date: 2027-01-20
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Apply this revision."""
    op.create_table(
        "recipe_records",
        sa.Column("recipe_key", sa.String(length=64), nullable=False),
        sa.Column("base_key", sa.String(length=64), nullable=False),
        sa.Column("name", sa.String(length=300), nullable=False),
        sa.Column("source_sha256", sa.String(length=64), nullable=False),
        sa.Column("fingerprint", sa.JSON(), nullable=False),
        sa.Column("recipe_zlib", sa.LargeBinary(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_seen_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("recipe_key", name=op.f("pk_recipe_records")),
    )
    with op.batch_alter_table("recipe_records", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_recipe_records_base_key_last_seen_at"),
            ["base_key", "last_seen_at"],
            unique=False,
        )
        batch_op.create_index(
            batch_op.f("ix_recipe_records_source_sha256_name_last_seen_at"),
            ["source_sha256", "name", "last_seen_at"],
            unique=False,
        )
    with op.batch_alter_table("audit_events", schema=None) as batch_op:
        batch_op.add_column(sa.Column("miss_reason", sa.String(length=1024), nullable=True))


def downgrade() -> None:
    """Revert this revision."""
    with op.batch_alter_table("audit_events", schema=None) as batch_op:
        batch_op.drop_column("miss_reason")
    with op.batch_alter_table("recipe_records", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_recipe_records_source_sha256_name_last_seen_at"))
        batch_op.drop_index(batch_op.f("ix_recipe_records_base_key_last_seen_at"))
    op.drop_table("recipe_records")
