"""jobs schema: tenants, jobs, requests, results, line errors

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def _status(name: str, *values: str) -> sa.Enum:
    return sa.Enum(*values, name=name, native_enum=False, length=16)


def upgrade() -> None:
    op.create_table(
        "tenants",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("name", sa.String(64), nullable=False, unique=True),
        sa.Column("weight", sa.Float(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
    )
    op.create_table(
        "jobs",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("tenant_id", sa.Integer(), sa.ForeignKey("tenants.id"), nullable=False),
        sa.Column("model", sa.String(200), nullable=False),
        sa.Column("status", _status("jobstatus", "validating", "in_progress", "finalizing", "completed", "failed",
                                    "cancelling", "cancelled", "expired"), nullable=False),
        sa.Column("priority", sa.SmallInteger(), nullable=False),
        sa.Column("completion_window", sa.String(16), nullable=False),
        sa.Column("metadata", sa.JSON(), nullable=False),
        sa.Column("input_name", sa.String(500), nullable=False),
        sa.Column("input_key", sa.Text(), nullable=False),
        sa.Column("output_key", sa.Text()),
        sa.Column("errors_key", sa.Text()),
        sa.Column("error", sa.Text()),
        sa.Column("total", sa.Integer(), nullable=False),
        sa.Column("completed", sa.Integer(), nullable=False),
        sa.Column("failed", sa.Integer(), nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("completion_tokens", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("in_progress_at", sa.Float()),
        sa.Column("finalizing_at", sa.Float()),
        sa.Column("completed_at", sa.Float()),
        sa.Column("failed_at", sa.Float()),
        sa.Column("cancelling_at", sa.Float()),
        sa.Column("cancelled_at", sa.Float()),
        sa.Column("expired_at", sa.Float()),
        sa.Column("expires_at", sa.Float(), nullable=False),
    )
    op.create_index("ix_jobs_status", "jobs", ["status"])
    op.create_index("ix_jobs_tenant_id", "jobs", ["tenant_id"])
    op.create_table(
        "requests",
        sa.Column("id", BIG_ID, primary_key=True, autoincrement=True),
        sa.Column("job_id", sa.String(40), sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("line", sa.Integer(), nullable=False),
        sa.Column("custom_id", sa.String(512), nullable=False),
        sa.Column("url", sa.String(64), nullable=False),
        sa.Column("prompt_token_ids", sa.JSON(), nullable=False),
        sa.Column("params", sa.JSON(), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("published_at", sa.Float()),
        sa.Column("delivered_at", sa.Float()),
        sa.Column("last_error", sa.Text()),
        sa.Column("created_at", sa.Float(), nullable=False),
    )
    op.create_index("ix_requests_job_custom_id", "requests", ["job_id", "custom_id"], unique=True)
    op.create_index("ix_requests_job_line", "requests", ["job_id", "line"])
    op.create_index("ix_requests_published_at", "requests", ["published_at"])
    op.create_table(
        "results",
        sa.Column("id", BIG_ID, primary_key=True, autoincrement=True),
        sa.Column("request_id", BIG_ID, sa.ForeignKey("requests.id", ondelete="CASCADE"), nullable=False,
                  unique=True),
        sa.Column("job_id", sa.String(40), sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("status", _status("resultstatus", "completed", "failed"), nullable=False),
        sa.Column("response", sa.JSON()),
        sa.Column("error", sa.JSON()),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("completion_tokens", sa.Integer(), nullable=False),
        sa.Column("worker", sa.String(200)),
        sa.Column("created_at", sa.Float(), nullable=False),
    )
    op.create_index("ix_results_job_id", "results", ["job_id"])
    op.create_table(
        "line_errors",
        sa.Column("id", BIG_ID, primary_key=True, autoincrement=True),
        sa.Column("job_id", sa.String(40), sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("line", sa.Integer(), nullable=False),
        sa.Column("custom_id", sa.String(512)),
        sa.Column("param", sa.String(200)),
        sa.Column("code", sa.String(64), nullable=False),
        sa.Column("message", sa.Text(), nullable=False),
    )
    op.create_index("ix_line_errors_job_line", "line_errors", ["job_id", "line"])


def downgrade() -> None:
    for table in ("line_errors", "results", "requests", "jobs", "tenants"):
        op.drop_table(table)
