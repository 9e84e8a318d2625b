"""requests: a suspect's size class (it was running when a worker died: it runs again only apart
from other work, in a group of at most that many suspects) and the life of the worker process
holding it; worker_deaths: one row per worker found dead while running requests (how many it ran),
whose rate tells an operator that a worker is crash-looping

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-02
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    with op.batch_alter_table("requests") as t:
        t.add_column(sa.Column("suspect", sa.Integer(), nullable=False, server_default="0"))
        t.add_column(sa.Column("holder_life", sa.String(32), nullable=True))
        t.create_index("ix_requests_holder_life", ["holder_life"])
    op.create_table(
        "worker_deaths",
        sa.Column("id", BIG_ID, primary_key=True, autoincrement=True),
        sa.Column("life", sa.String(32), nullable=False),
        sa.Column("worker", sa.String(200), nullable=False),
        sa.Column("host", sa.String(200), nullable=False),
        sa.Column("at", sa.Float(), nullable=False),
        sa.Column("running", sa.Integer(), nullable=False),
    )
    op.create_index("ix_worker_deaths_life", "worker_deaths", ["life"], unique=True)
    op.create_index("ix_worker_deaths_at", "worker_deaths", ["at"])


def downgrade() -> None:
    op.drop_index("ix_worker_deaths_at", "worker_deaths")
    op.drop_index("ix_worker_deaths_life", "worker_deaths")
    op.drop_table("worker_deaths")
    with op.batch_alter_table("requests") as t:
        t.drop_index("ix_requests_holder_life")
        t.drop_column("holder_life")
        t.drop_column("suspect")
