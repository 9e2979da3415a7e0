"""How each dependency list was proven: ``dependency_check`` on artifacts and manifests.

Releases before this one recorded NVRTC's dependency trace as it came, and that trace
is short in a process that saw a failed compile: a compile worker that had answered
one typo recorded lists missing headers, and a manifest match on such a list answered
a header edit with the old kernel. Every row already here gets 0 ("trusted the trace
alone"): a manifest entry with 0 is never matched again, and an artifact with 0 is
served by exact key only while the server has no include sets (the key covers the
source and every in-memory header; include-set files are checked against the list).
A new compile that produces the same bytes replaces the artifact's metadata with its
proven list (``kcache.deps.proven``).

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Apply this revision."""
    for table in ("artifacts", "manifests"):
        with op.batch_alter_table(table) as batch:
            batch.add_column(
                sa.Column("dependency_check", sa.Integer(), nullable=False, server_default="0")
            )


def downgrade() -> None:
    """Revert this revision."""
    for table in ("manifests", "artifacts"):
        with op.batch_alter_table(table) as batch:
            batch.drop_column("dependency_check")
