"""files expire: files.expires_at (OpenAI's expires_after of an upload, or its batch's
output_expires_after) and jobs.output_expires_after (seconds after a job's output is written that its
output and errors files are deleted); both empty for the rows there are, which never expire

Revision ID: 0006
Revises: 0005
Create Date: 2027-01-15
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("files") as batch:
        batch.add_column(sa.Column("expires_at", sa.Float(), nullable=True))
    op.create_index("ix_files_expires_at", "files", ["expires_at"])
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("output_expires_after", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("output_expires_after")
    op.drop_index("ix_files_expires_at", "files")
    with op.batch_alter_table("files") as batch:
        batch.drop_column("expires_at")
