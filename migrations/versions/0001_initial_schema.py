"""Initial schema: artifacts, recipe aliases, manifests, negative entries, audit events, tokens.

Revision ID: 0001
Revises: (none)
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Apply this revision."""
    op.create_table(
        "artifacts",
        sa.Column("digest", sa.String(length=64), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("target", sa.String(length=32), nullable=False),
        sa.Column("toolchain", sa.String(length=128), nullable=False),
        sa.Column("kernel", sa.String(length=1024), nullable=False),
        sa.Column("lowered_names", sa.JSON(), nullable=False),
        sa.Column("compile_seconds", sa.Float(), nullable=False),
        sa.Column("log", sa.Text(), nullable=False),
        sa.Column("dependencies", sa.JSON(), nullable=False),
        sa.Column("dependencies_exact", sa.Boolean(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_used_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("digest", name=op.f("pk_artifacts")),
    )
    op.create_table(
        "audit_events",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("outcome", sa.String(length=16), nullable=False),
        sa.Column("tier", sa.String(length=16), nullable=False),
        sa.Column("route", sa.String(length=32), nullable=False),
        sa.Column("recipe_key", sa.String(length=64), nullable=True),
        sa.Column("base_key", sa.String(length=64), nullable=True),
        sa.Column("digest", sa.String(length=64), nullable=True),
        sa.Column("kernel", sa.String(length=1024), nullable=True),
        sa.Column("target", sa.String(length=32), nullable=True),
        sa.Column("toolchain", sa.String(length=128), nullable=True),
        sa.Column("error", sa.String(length=64), nullable=True),
        sa.Column("client_id", sa.String(length=256), nullable=True),
        sa.Column("host", sa.String(length=256), nullable=True),
        sa.Column("pid", sa.Integer(), nullable=True),
        sa.Column("job_id", sa.String(length=256), nullable=True),
        sa.Column("rank", sa.Integer(), nullable=True),
        sa.Column("world_size", sa.Integer(), nullable=True),
        sa.Column("latency_ms", sa.Double(), nullable=False),
        sa.Column("compile_seconds_saved", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_audit_events")),
    )
    with op.batch_alter_table("audit_events", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_audit_events_at"), ["at"], unique=False)
        batch_op.create_index(batch_op.f("ix_audit_events_client_id"), ["client_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_audit_events_job_id"), ["job_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_audit_events_kernel"), ["kernel"], unique=False)
        batch_op.create_index(
            batch_op.f("ix_audit_events_outcome_at"), ["outcome", "at"], unique=False
        )
        batch_op.create_index(
            batch_op.f("ix_audit_events_recipe_key"), ["recipe_key"], unique=False
        )

    op.create_table(
        "negative_entries",
        sa.Column("recipe_key", sa.String(length=64), nullable=False),
        sa.Column("log", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("recipe_key", name=op.f("pk_negative_entries")),
    )
    op.create_table(
        "tokens",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("name", sa.String(length=256), nullable=False),
        sa.Column("token_hash", sa.String(length=64), nullable=False),
        sa.Column("scopes", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_used_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tokens")),
        sa.UniqueConstraint("name", name=op.f("uq_tokens_name")),
        sa.UniqueConstraint("token_hash", name=op.f("uq_tokens_token_hash")),
    )
    op.create_table(
        "manifests",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("base_key", sa.String(length=64), nullable=False),
        sa.Column("dependencies_hash", sa.String(length=64), nullable=False),
        sa.Column("digest", sa.String(length=64), nullable=False),
        sa.Column("dependencies", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["digest"],
            ["artifacts.digest"],
            name=op.f("fk_manifests_digest_artifacts"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_manifests")),
        sa.UniqueConstraint(
            "base_key", "dependencies_hash", name=op.f("uq_manifests_base_key_dependencies_hash")
        ),
    )
    with op.batch_alter_table("manifests", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_manifests_base_key"), ["base_key"], unique=False)
        batch_op.create_index(batch_op.f("ix_manifests_digest"), ["digest"], unique=False)

    op.create_table(
        "recipe_aliases",
        sa.Column("recipe_key", sa.String(length=64), nullable=False),
        sa.Column("digest", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["digest"],
            ["artifacts.digest"],
            name=op.f("fk_recipe_aliases_digest_artifacts"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("recipe_key", name=op.f("pk_recipe_aliases")),
    )
    with op.batch_alter_table("recipe_aliases", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_recipe_aliases_digest"), ["digest"], unique=False)


def downgrade() -> None:
    """Revert this revision."""
    with op.batch_alter_table("recipe_aliases", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_recipe_aliases_digest"))

    op.drop_table("recipe_aliases")
    with op.batch_alter_table("manifests", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_manifests_digest"))
        batch_op.drop_index(batch_op.f("ix_manifests_base_key"))

    op.drop_table("manifests")
    op.drop_table("tokens")
    op.drop_table("negative_entries")
    with op.batch_alter_table("audit_events", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_audit_events_recipe_key"))
        batch_op.drop_index(batch_op.f("ix_audit_events_outcome_at"))
        batch_op.drop_index(batch_op.f("ix_audit_events_kernel"))
        batch_op.drop_index(batch_op.f("ix_audit_events_job_id"))
        batch_op.drop_index(batch_op.f("ix_audit_events_client_id"))
        batch_op.drop_index(batch_op.f("ix_audit_events_at"))

    op.drop_table("audit_events")
    op.drop_table("artifacts")
