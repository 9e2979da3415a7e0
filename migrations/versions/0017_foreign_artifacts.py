"""``foreign_bindings`` and ``foreign_files``: artifacts a library's own cache hook published.

CuPy's, cuda.core's and Triton's cache hooks publish bytes under the library's own key,
namespaced by library, version, target and toolchain (docs/design.md section 10). A
binding is a group of files (Triton's kernel groups; one file for CuPy and cuda.core),
written in one transaction; the blobs are in the content-addressed store like every
artifact's, and garbage collection keeps every digest a foreign file names.

Revision ID: 0017
Revises: 0016
Create Date: 2027-03-20
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# models.FOREIGN_* and REPORTER_LENGTH when this revision was written.
_LIBRARY, _LABEL, _KEY, _NAME, _WRITER = 32, 128, 256, 256, 270


def upgrade() -> None:
    """Apply this revision."""
    op.create_table(
        "foreign_bindings",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("binding_key", sa.String(length=64), nullable=False),
        sa.Column("library", sa.String(length=_LIBRARY), nullable=False),
        sa.Column("version", sa.String(length=_LABEL), nullable=False),
        sa.Column("target", sa.String(length=_LABEL), nullable=False),
        sa.Column("toolchain", sa.String(length=_LABEL), nullable=False),
        sa.Column("key", sa.String(length=_KEY), nullable=False),
        sa.Column("writer", sa.String(length=_WRITER), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("published_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_used_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_foreign_bindings")),
        sa.UniqueConstraint("binding_key", name=op.f("uq_foreign_bindings_binding_key")),
    )
    with op.batch_alter_table("foreign_bindings", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_foreign_bindings_last_used_at"), ["last_used_at"], unique=False
        )
    op.create_table(
        "foreign_files",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column(
            "binding_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False
        ),
        sa.Column("name", sa.String(length=_NAME), nullable=False),
        sa.Column("digest", sa.String(length=64), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(
            ["binding_id"],
            ["foreign_bindings.id"],
            name=op.f("fk_foreign_files_binding_id_foreign_bindings"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_foreign_files")),
        sa.UniqueConstraint("binding_id", "name", name=op.f("uq_foreign_files_binding_id_name")),
    )
    with op.batch_alter_table("foreign_files", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_foreign_files_digest"), ["digest"], unique=False)


def downgrade() -> None:
    """Revert this revision."""
    with op.batch_alter_table("foreign_files", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_foreign_files_digest"))
    op.drop_table("foreign_files")
    with op.batch_alter_table("foreign_bindings", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_foreign_bindings_last_used_at"))
    op.drop_table("foreign_bindings")
