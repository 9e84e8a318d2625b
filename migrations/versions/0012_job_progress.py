"""Progress from work done: jobs.output_budget (the output tokens its good lines may make: n x max_tokens
each, added as they are stored), jobs.finished_budget (the part of it its finished requests held) and
job_progress (each engine worker's tokens made so far by the requests of a job it is running, replaced at
its heartbeat). A job's ETA counts tokens made against
tokens expected, not finished requests, which with continuous batching mostly finish at the end.

Jobs from before have a budget of 0: their ETA counts requests, as it did.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-05
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("output_budget", sa.BigInteger(), nullable=False, server_default="0"))
    op.add_column("jobs", sa.Column("finished_budget", sa.BigInteger(), nullable=False, server_default="0"))
    op.create_table(
        "job_progress",
        sa.Column("worker_id", sa.String(200), primary_key=True),
        sa.Column("job_id", sa.String(40), primary_key=True),  # no foreign key: a heartbeat never fails on a job gone
        sa.Column("tokens", sa.BigInteger(), nullable=False),
        sa.Column("at", sa.Float(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("job_progress")
    with op.batch_alter_table("jobs") as t:
        t.drop_column("finished_budget")
        t.drop_column("output_budget")
