"""Token budgets: tenants.enqueued_token_limit (a tenant's enqueued tokens per model at most; None: the
setting's default, 0: no limit), jobs.enqueued_tokens (the prompt tokens and max_tokens of a job's lines
not yet done, given back as each ends and wholly when the job ends), requests.tokens (what one line
holds of it), and jobs.error_code (OpenAI's code for why a whole job failed: token_limit_exceeded).
Storage counted whole: jobs.input_bytes, output_bytes and errors_bytes, what a job's copy of its input
and its output and errors files hold in the store (counted in its tenant's storage quota, 0 once
deleted).

Jobs and requests from before hold no enqueued tokens and count no bytes: a job already running when
berth is upgraded is not counted against its tenant's limits, and its input is not expired.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-04
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # plain ADD COLUMNs (SQLite too): no table is rebuilt, so the jobs table's triggers and view stay
    op.add_column("tenants", sa.Column("enqueued_token_limit", sa.BigInteger(), nullable=True))
    op.add_column("jobs", sa.Column("enqueued_tokens", sa.BigInteger(), nullable=False, server_default="0"))
    op.add_column("jobs", sa.Column("error_code", sa.String(64), nullable=True))
    op.add_column("requests", sa.Column("tokens", sa.BigInteger(), nullable=False, server_default="0"))
    for column in ("input_bytes", "output_bytes", "errors_bytes"):
        op.add_column("jobs", sa.Column(column, sa.BigInteger(), nullable=False, server_default="0"))


def downgrade() -> None:
    for column in ("errors_bytes", "output_bytes", "input_bytes"):
        op.drop_column("jobs", column)  # plain DROP COLUMNs (SQLite 3.35+): the triggers stay
    op.drop_column("jobs", "error_code")
    op.drop_column("jobs", "enqueued_tokens")
    with op.batch_alter_table("requests") as t:
        t.drop_column("tokens")
    with op.batch_alter_table("tenants") as t:
        t.drop_column("enqueued_token_limit")
