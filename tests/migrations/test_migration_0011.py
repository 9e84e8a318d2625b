"""Migration 0011 (interactive limits per tenant: requests running at once, tokens per minute) on a
database made at 0010 holding two tenants, one with its own enqueued-token limit: every row and value
is kept, both take the settings' defaults, and a limit set afterwards reads back, then goes back to the
default."""

from __future__ import annotations

import pytest

from jobs.records.budgets import set_interactive_limits
from jobs.records.db import close_database, open_database
from jobs.records.status import InteractiveLimits, budgets, interactive_limits
from tests.support.migration_db import upgraded

T = 1_790_000_000.0
ROWS = {"tenants": [{"id": 1, "name": "alice", "weight": 1.0, "created_at": T, "cache_group": None,
                     "enqueued_token_limit": 5000},
                    {"id": 2, "name": "bob", "weight": 2.0, "created_at": T, "cache_group": "g",
                     "enqueued_token_limit": None}]}


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_0011_keeps_every_tenant_and_each_takes_the_default_limits(backend, tmp_path, request):
    url = f"sqlite:///{tmp_path / 'old.db'}" if backend == "sqlite" else request.getfixturevalue("pg_url")
    after = upgraded(url, "0010", ROWS)
    assert [(r["live_request_limit"], r["tokens_per_minute_limit"]) for r in after["tenants"]] == [(None, None)] * 2
    try:
        db = open_database(url)
        assert interactive_limits(db, "alice", 32, 1000) == InteractiveLimits(32, 1000)
        set_interactive_limits(db, "alice", live_requests=3, tokens_per_minute=0)
        assert interactive_limits(db, "alice", 32, 1000) == InteractiveLimits(3, 0, True, True)
        set_interactive_limits(db, "alice", live_requests=None)
        [alice] = budgets(db, 7, "alice", (32, 1000))
        assert (alice.limit, alice.interactive) == (5000, InteractiveLimits(32, 0, False, True))
        assert interactive_limits(db, "nobody-yet", 32, 1000) == InteractiveLimits(32, 1000)
    finally:
        close_database(url)
