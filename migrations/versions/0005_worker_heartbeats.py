"""workers: each engine worker's heartbeat (what it runs, its KV use and throughput), and a short
history of them for the dashboard's charts

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "workers",
        sa.Column("id", sa.String(200), primary_key=True),
        sa.Column("host", sa.String(200), nullable=False),
        sa.Column("model", sa.String(200), nullable=False),
        sa.Column("device", sa.String(32), nullable=False),
        sa.Column("running", sa.Integer(), nullable=False),
        sa.Column("waiting", sa.Integer(), nullable=False),
        sa.Column("kv_blocks_used", sa.Integer(), nullable=False),
        sa.Column("kv_blocks_free", sa.Integer(), nullable=False),
        sa.Column("output_tokens_per_second", sa.Float(), nullable=False),
        sa.Column("started_at", sa.Float(), nullable=False),
        sa.Column("seen_at", sa.Float(), nullable=False),
    )
    op.create_index("ix_workers_seen_at", "workers", ["seen_at"])
    op.create_table(
        "worker_samples",
        sa.Column("id", BIG_ID, primary_key=True, autoincrement=True),
        sa.Column("worker_id", sa.String(200), nullable=False),
        sa.Column("at", sa.Float(), nullable=False),
        sa.Column("output_tokens_per_second", sa.Float(), nullable=False),
        sa.Column("kv_blocks_used", sa.Integer(), nullable=False),
        sa.Column("kv_blocks_free", sa.Integer(), nullable=False),
    )
    op.create_index("ix_worker_samples_worker_at", "worker_samples", ["worker_id", "at"])


def downgrade() -> None:
    op.drop_index("ix_worker_samples_worker_at", "worker_samples")
    op.drop_table("worker_samples")
    op.drop_index("ix_workers_seen_at", "workers")
    op.drop_table("workers")
