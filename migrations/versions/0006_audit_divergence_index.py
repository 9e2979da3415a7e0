"""An index for ``/v1/stats``' rank divergence over many audit events.

``audit_events (job_id, base_key, target, digest, tier)`` lets the divergence query
group and count distinct digests from the index alone (bench/b10_stats_scale.py: 3 to
7 x faster at 300k events on SQLite and PostgreSQL). It starts with ``job_id``, so it
replaces the single-column ``job_id`` index, and an audit insert updates as many
indexes as before.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Apply this revision."""
    with op.batch_alter_table("audit_events", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_audit_events_job_id_base_key_target_digest_tier"),
            ["job_id", "base_key", "target", "digest", "tier"],
            unique=False,
        )
        batch_op.drop_index(batch_op.f("ix_audit_events_job_id"))


def downgrade() -> None:
    """Revert this revision."""
    with op.batch_alter_table("audit_events", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_audit_events_job_id"), ["job_id"], unique=False)
        batch_op.drop_index(batch_op.f("ix_audit_events_job_id_base_key_target_digest_tier"))
