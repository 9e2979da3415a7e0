"""Bounded storage: pins, the eviction log, and compile charges for per-token quotas.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-08
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    """Apply this revision."""
    op.create_table(
        "pins",
        sa.Column("id", _ID, autoincrement=True, nullable=False),
        sa.Column("recipe_key", sa.String(length=64), nullable=False),
        sa.Column("group_name", sa.String(length=256), server_default="", nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("created_by", sa.String(length=300), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_pins")),
        sa.UniqueConstraint("recipe_key", "group_name", name=op.f("uq_pins_recipe_key_group_name")),
    )
    with op.batch_alter_table("pins", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_pins_group_name"), ["group_name"], unique=False)
    op.create_table(
        "evictions",
        sa.Column("id", _ID, autoincrement=True, nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("digest", sa.String(length=64), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("recipe_keys", sa.JSON(), nullable=False),
        sa.Column("reason", sa.String(length=16), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_evictions")),
    )
    with op.batch_alter_table("evictions", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_evictions_at"), ["at"], unique=False)
    op.create_table(
        "compile_charges",
        sa.Column("digest", sa.String(length=64), nullable=False),
        sa.Column("caller", sa.String(length=300), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("digest", name=op.f("pk_compile_charges")),
    )
    with op.batch_alter_table("compile_charges", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_compile_charges_caller"), ["caller"], unique=False)


def downgrade() -> None:
    """Revert this revision."""
    with op.batch_alter_table("compile_charges", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_compile_charges_caller"))
    op.drop_table("compile_charges")
    with op.batch_alter_table("evictions", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_evictions_at"))
    op.drop_table("evictions")
    with op.batch_alter_table("pins", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_pins_group_name"))
    op.drop_table("pins")
