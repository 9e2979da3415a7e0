"""Who reported client events, and each reporter's minute: ``reporter`` columns, ``audit_report_windows``.

``audit_events.reporter`` (and ``audit_rollups.reporter``, so a roll-up keeps it) names
the token that posted a client-reported event, for ``/v1/stats``' ``reported_by`` and the
reporters of a ``reported`` divergence; the counts gain a ``reporter`` dimension as the
events arrive. ``audit_report_windows`` counts what each token reported per minute of
arrival, which ``audit.max_reported_per_minute`` bounds.

Events reported before this revision have no reporter: ``/v1/stats`` shows their
lookups as unattributed (``reporter`` null) rather than guess one.

Revision ID: 0013
Revises: 0012
Create Date: 2027-02-10
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_REPORTER = 270  # models.REPORTER_LENGTH when this revision was written


def upgrade() -> None:
    """Apply this revision."""
    for table in ("audit_events", "audit_rollups"):
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.add_column(sa.Column("reporter", sa.String(length=_REPORTER), nullable=True))
    op.create_table(
        "audit_report_windows",
        sa.Column("reporter", sa.String(length=_REPORTER), nullable=False),
        sa.Column("minute", sa.DateTime(timezone=True), nullable=False),
        sa.Column("lookups", sa.BigInteger(), nullable=False),
        sa.Column("events", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("reporter", "minute", name=op.f("pk_audit_report_windows")),
    )


def downgrade() -> None:
    """Revert this revision."""
    op.execute("DELETE FROM audit_counts WHERE dim = 'reporter'")  # the dimension goes with it
    op.drop_table("audit_report_windows")
    for table in ("audit_rollups", "audit_events"):
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.drop_column("reporter")
