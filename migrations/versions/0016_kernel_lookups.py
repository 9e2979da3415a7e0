"""``audit_lookups`` and ``audit_job_builds``: kernel lookups, what every hit rate counts.

A kernel lookup is a process's first lookup of a recipe, decided when it is written: a
hit when it needed no compile anywhere (its first lookup found the kernel, and no rank of
its job had compiled it), with the compile time it avoided and a miss's reason
(:mod:`kcache_server.auditing.lookups`). ``audit_job_builds`` lists the recipes each job
compiled or joined a compile of. The upgrade records the kernel lookups of the raw events
already there, with the writer's own code, oldest first; events already rolled up into
hourly counts start none.

Revision ID: 0016
Revises: 0015
Create Date: 2027-03-12
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_REASON = 96  # models.LOOKUP_REASON_LENGTH when this revision was written
_REPORTER = 270  # models.REPORTER_LENGTH


def upgrade() -> None:
    """Apply this revision."""
    op.create_table(
        "audit_lookups",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("process", sa.String(length=64), nullable=True),
        sa.Column("identity", sa.String(length=64), nullable=False),
        sa.Column("outcome", sa.String(length=16), nullable=False),
        sa.Column("tier", sa.String(length=16), nullable=False),
        sa.Column("hit", sa.Boolean(), nullable=False),
        sa.Column("reason", sa.String(length=_REASON), nullable=True),
        sa.Column("count", sa.BigInteger(), nullable=False),
        sa.Column("saved", sa.Double(), nullable=False),
        sa.Column("recipe_key", sa.String(length=64), nullable=True),
        sa.Column("base_key", sa.String(length=64), nullable=True),
        sa.Column("digest", sa.String(length=64), nullable=True),
        sa.Column("kernel", sa.String(length=1024), nullable=True),
        sa.Column("target", sa.String(length=32), nullable=True),
        sa.Column("client_id", sa.String(length=256), nullable=True),
        sa.Column("job_id", sa.String(length=256), nullable=True),
        sa.Column("rank", sa.Integer(), nullable=True),
        sa.Column("reporter", sa.String(length=_REPORTER), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_audit_lookups")),
    )
    with op.batch_alter_table("audit_lookups", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_audit_lookups_at"), ["at"], unique=False)
        batch_op.create_index(
            batch_op.f("ix_audit_lookups_process_identity"), ["process", "identity"], unique=True
        )
        batch_op.create_index(
            batch_op.f("ix_audit_lookups_job_id_at"), ["job_id", "at"], unique=False
        )
        batch_op.create_index(
            batch_op.f("ix_audit_lookups_kernel_at"), ["kernel", "at"], unique=False
        )
    op.create_table(
        "audit_job_builds",
        sa.Column("job_id", sa.String(length=256), nullable=False),
        sa.Column("identity", sa.String(length=64), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("job_id", "identity", name=op.f("pk_audit_job_builds")),
    )
    with op.batch_alter_table("audit_job_builds", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_audit_job_builds_at"), ["at"], unique=False)

    # The backfill is the writer's own code, so an upgraded database holds what the writer
    # would have recorded. It reads only columns that exist at this revision; should it
    # ever read a later one, freeze a copy of it here.
    from kcache_server.auditing.lookups import backfill

    backfill(op.get_bind())


def downgrade() -> None:
    """Revert this revision."""
    with op.batch_alter_table("audit_job_builds", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_audit_job_builds_at"))
    op.drop_table("audit_job_builds")
    with op.batch_alter_table("audit_lookups", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_audit_lookups_kernel_at"))
        batch_op.drop_index(batch_op.f("ix_audit_lookups_job_id_at"))
        batch_op.drop_index(batch_op.f("ix_audit_lookups_process_identity"))
        batch_op.drop_index(batch_op.f("ix_audit_lookups_at"))
    op.drop_table("audit_lookups")
