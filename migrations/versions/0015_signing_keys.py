"""``signing_keys``: the keys the servers sharing a database sign with, checked at start-up.

Replicas behind one URL must sign with one key (clients are given its public half, or pin
it); each server records its key here at start-up and refuses to start when another one
is in use. ``active`` is true for the key in use and NULL for the others: a unique
column, so the database itself keeps two replicas that start at once with different keys
from both recording theirs. A database upgraded to this revision names no key: the first
server to start records its own.

Revision ID: 0015
Revises: 0014
Create Date: 2027-03-08
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_NOTE = 256  # models.SIGNING_KEY_NOTE_LENGTH when this revision was written


def upgrade() -> None:
    """Apply this revision."""
    op.create_table(
        "signing_keys",
        sa.Column("key_id", sa.String(length=16), nullable=False),
        sa.Column("public_key", sa.String(length=64), nullable=False),
        sa.Column("active", sa.Boolean(), nullable=True),
        sa.Column("recorded_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("retired_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("retired_by", sa.String(length=16), nullable=True),
        sa.Column("note", sa.String(length=_NOTE), nullable=True),
        sa.PrimaryKeyConstraint("key_id", name=op.f("pk_signing_keys")),
        sa.UniqueConstraint("active", name=op.f("uq_signing_keys_active")),
    )


def downgrade() -> None:
    """Revert this revision."""
    op.drop_table("signing_keys")
