"""Interactive limits per tenant: tenants.live_request_limit (chat and completions requests running at
once on one berth serve process) and tenants.tokens_per_minute_limit (their tokens in any 60 s). None:
the settings' defaults (BERTH_HTTP_TENANT_LIVE_REQUESTS, BERTH_HTTP_TENANT_TOKENS_PER_MINUTE), 0: no
limit. What a tenant uses is counted in the server's memory, not here: only the limits are rows.

Tenants from before take the defaults.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-05
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # plain ADD COLUMNs (SQLite too): no table is rebuilt
    op.add_column("tenants", sa.Column("live_request_limit", sa.Integer(), nullable=True))
    op.add_column("tenants", sa.Column("tokens_per_minute_limit", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("tenants") as t:
        t.drop_column("tokens_per_minute_limit")
        t.drop_column("live_request_limit")
