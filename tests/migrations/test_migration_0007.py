"""Migration 0007 (``requests.checkpoint``: where a request's latest checkpointed state is) on a
database made at 0005 holding a job whose requests are mid-run: every row and value is kept, the new
column is empty (those requests resume as they would have without a checkpoint: from the start), and
a worker's ledger then records refs and claims read them back."""

from __future__ import annotations

import pytest
from sqlalchemy import MetaData, insert

from jobs.hosting.database_ledger import JobsLedger
from jobs.records.db import close_database, make_engine, open_database, upgrade
from tests.support.jobs_env import TINY_NAME
from tests.support.migration_db import dump
from worker.config import Settings

T = 1_790_000_000.0
JOB = "batch_0123456789abcdef01234567"
ROWS = {
    "tenants": [{"id": 1, "name": "alice", "weight": 1.0, "created_at": T}],
    "jobs": [{"id": JOB, "tenant_id": 1, "model": TINY_NAME, "status": "in_progress", "priority": 0,
              "completion_window": "24h", "metadata": None, "input_name": "in.jsonl",
              "input_key": f"jobs/{JOB}/input.jsonl", "output_key": None, "errors_key": None, "error": None,
              "total": 2, "completed": 0, "failed": 0, "prompt_tokens": 0, "completion_tokens": 0, "created_at": T,
              "in_progress_at": T + 1, "finalizing_at": None, "completed_at": None, "failed_at": None,
              "cancelling_at": None, "cancelled_at": None, "expired_at": None, "expires_at": T + 86400,
              "ingest_seen_at": T + 1}],
    "requests": [{"id": i, "job_id": JOB, "line": i, "custom_id": f"q{i}", "url": "/v1/completions",
                  "prompt_token_ids": [1, 2, 3], "params": {"max_tokens": 40}, "attempts": 1, "published_at": T,
                  "delivered_at": T, "last_error": None, "created_at": T, "holder": "host:1", "started": True,
                  "progress": 16, "strikes": 0} for i in (1, 2)],
}


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_0007_keeps_every_row_of_a_0005_database_and_refs_round_trip(backend, tmp_path, request):
    url = f"sqlite:///{tmp_path / 'old.db'}" if backend == "sqlite" else request.getfixturevalue("pg_url")
    assert upgrade(url, "0005") == "0005"
    engine = make_engine(url)
    meta = MetaData()
    meta.reflect(engine)
    assert "checkpoint" not in meta.tables["requests"].c
    with engine.begin() as conn:
        for name, rows in ROWS.items():
            conn.execute(insert(meta.tables[name]), rows)
    before = dump(engine, ROWS)

    assert upgrade(url, "0007") == "0007"
    after = dump(engine, ROWS)
    engine.dispose()
    for name, rows in before.items():
        assert [{k: r[k] for k in rows[0]} for r in after[name]] == rows, name
    assert [r["checkpoint"] for r in after["requests"]] == [None, None]

    upgrade(url)  # to the head, wherever later migrations took it: the ledger needs it
    open_database(url)
    try:
        ledger = JobsLedger(Settings(database_url=url), tokenizer=None, model_name=TINY_NAME, eager_tasks=True)
        ref = "checkpoints/v2/states/0123456789abcdef/0000000003.seg@17+410"
        ledger.checkpointed({1: ref, 2: ref.replace("@17", "@427")}, "host:2")  # not the holder: not written
        assert {c.checkpoint for c in ledger.claim([1, 2], "host:2").values()} == {None}
        ledger.checkpointed({1: ref}, "host:2")  # now it holds them
        claims = ledger.claim([1, 2], "host:3")
        assert (claims[1].checkpoint, claims[2].checkpoint) == (ref, None)
    finally:
        close_database(url)
