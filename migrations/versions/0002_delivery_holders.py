"""requests: who holds a delivery and whether it ran (poison counts crashes without progress);
jobs: the ingest's last sign of life (the reconciler resumes an ingest that stopped)

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("requests") as t:
        t.add_column(sa.Column("holder", sa.String(200), nullable=True))
        t.add_column(sa.Column("started", sa.Boolean(), nullable=False, server_default=sa.false()))
        t.add_column(sa.Column("progress", sa.Integer(), nullable=False, server_default="0"))
        t.add_column(sa.Column("strikes", sa.Integer(), nullable=False, server_default="0"))
    with op.batch_alter_table("jobs") as t:
        t.add_column(sa.Column("ingest_seen_at", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as t:
        t.drop_column("ingest_seen_at")
    with op.batch_alter_table("requests") as t:
        for name in ("strikes", "progress", "started", "holder"):
            t.drop_column(name)
