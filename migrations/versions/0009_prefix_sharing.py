"""Prefix sharing within a trust boundary, and cached tokens counted: tenants.cache_group (tenants of
one group share cached prompt prefixes), requests.cache_salt (a line's own salt, which shares across
tenants that give the same one), results.cached_tokens and jobs.cached_tokens (prompt tokens taken from
a prefix cache: OpenAI's cached_tokens)

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-02
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # plain ADD COLUMNs (SQLite too): no table is rebuilt, so the jobs table's triggers and view stay
    op.add_column("tenants", sa.Column("cache_group", sa.String(64), nullable=True))
    op.add_column("requests", sa.Column("cache_salt", sa.String(300), nullable=True))
    op.add_column("results", sa.Column("cached_tokens", sa.Integer(), nullable=False, server_default="0"))
    op.add_column("jobs", sa.Column("cached_tokens", sa.BigInteger(), nullable=False, server_default="0"))


def downgrade() -> None:
    op.drop_column("jobs", "cached_tokens")  # a plain DROP COLUMN (SQLite 3.35+): the triggers stay
    with op.batch_alter_table("results") as t:
        t.drop_column("cached_tokens")
    with op.batch_alter_table("requests") as t:
        t.drop_column("cache_salt")
    with op.batch_alter_table("tenants") as t:
        t.drop_column("cache_group")
