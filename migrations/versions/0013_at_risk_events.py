"""At-risk events: jobs.at_risk_at (when a live job was first found expected to finish after its window:
``jobs.records.outbox.raise_at_risk``), job_events.kind ('status', the triggers' rows, or 'at_risk') and
job_events.expected_finish_at (an at-risk event's expected finish, as it was when raised).

Columns are only added (plain ADD COLUMN on SQLite too): ``jobs`` is not rebuilt, so the triggers that
fill ``job_events`` and the view ``berth_jobs`` (migration 0004) stay as they are. The triggers name the
columns they insert and leave ``kind`` out: its server default makes their rows 'status' events.
The downgrade drops the columns the same way (SQLite 3.35+ drops a column in place).

Jobs and events from before are status events, never raised at risk.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-06
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("at_risk_at", sa.Float(), nullable=True))
    op.add_column("job_events", sa.Column("kind", sa.String(16), nullable=False, server_default="status"))
    op.add_column("job_events", sa.Column("expected_finish_at", sa.Float(), nullable=True))


def downgrade() -> None:
    op.drop_column("job_events", "expected_finish_at")
    op.drop_column("job_events", "kind")
    op.drop_column("jobs", "at_risk_at")
