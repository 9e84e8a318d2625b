"""requests.checkpoint: where a request's latest checkpointed state is (a segment of the checkpoint
store and the byte range of the state in it), so that its next delivery reads it in one ranged GET

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-02
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("requests") as batch:
        batch.add_column(sa.Column("checkpoint", sa.String(300), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("requests") as batch:
        batch.drop_column("checkpoint")
