"""``withdrawals``: bindings (recipe key -> digest) verification found wrong, a fact of the store.

A divergence withdraws the binding of the recipe that diverged, never the digest (other
recipes compiling to the same bytes keep theirs). The row is written in the transaction
that removes the binding; every replica and worker process reads the rows after the last
it saw and drops the key from memory, and clients read them (``GET /v1/withdrawals``).
Withdrawals made before this revision left no row: they removed the aliases, which is
all a replica or client could have learned from them.

Revision ID: 0014
Revises: 0013
Create Date: 2027-03-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_REASON = 256  # models.WITHDRAWAL_REASON_LENGTH when this revision was written


def upgrade() -> None:
    """Apply this revision."""
    op.create_table(
        "withdrawals",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("recipe_key", sa.String(length=64), nullable=False),
        sa.Column("digest", sa.String(length=64), nullable=False),
        sa.Column("reason", sa.String(length=_REASON), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_withdrawals")),
    )


def downgrade() -> None:
    """Revert this revision."""
    op.drop_table("withdrawals")
