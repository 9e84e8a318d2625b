"""the HTTP API: API keys (their hashes), files, idempotency keys; jobs: their endpoint and files

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-02
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
JOB_COLUMNS = (("endpoint", 64), ("input_file_id", 40), ("output_file_id", 40), ("error_file_id", 40))


def upgrade() -> None:
    with op.batch_alter_table("jobs") as t:
        for name, length in JOB_COLUMNS:
            t.add_column(sa.Column(name, sa.String(length), nullable=True))
    op.create_table(
        "api_keys",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("tenant_id", sa.Integer(), sa.ForeignKey("tenants.id"), nullable=False),
        sa.Column("key_hash", sa.String(64), nullable=False, unique=True),
        sa.Column("prefix", sa.String(16), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("revoked_at", sa.Float()),
    )
    op.create_index("ix_api_keys_tenant_id", "api_keys", ["tenant_id"])
    op.create_table(
        "files",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("tenant_id", sa.Integer(), sa.ForeignKey("tenants.id"), nullable=False),
        sa.Column("purpose", sa.String(32), nullable=False),
        sa.Column("filename", sa.String(500), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("key", sa.Text(), nullable=False),
        sa.Column("job_id", sa.String(40)),
        sa.Column("created_at", sa.Float(), nullable=False),
    )
    op.create_index("ix_files_tenant_created", "files", ["tenant_id", "created_at"])
    op.create_table(
        "idempotency_keys",
        sa.Column("id", BIG_ID, primary_key=True, autoincrement=True),
        sa.Column("tenant_id", sa.Integer(), sa.ForeignKey("tenants.id"), nullable=False),
        sa.Column("route", sa.String(64), nullable=False),
        sa.Column("key", sa.String(255), nullable=False),
        sa.Column("fingerprint", sa.String(64), nullable=False),
        sa.Column("object_id", sa.String(40)),
        sa.Column("created_at", sa.Float(), nullable=False),
    )
    op.create_index("ix_idempotency_keys_scope", "idempotency_keys", ["tenant_id", "route", "key"], unique=True)


def downgrade() -> None:
    for table in ("idempotency_keys", "files", "api_keys"):
        op.drop_table(table)
    with op.batch_alter_table("jobs") as t:
        for name, _ in reversed(JOB_COLUMNS):
            t.drop_column(name)
