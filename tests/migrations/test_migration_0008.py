"""Migration 0008 (crash suspects: a request's suspect class and its holder's life, the worker deaths
table) on a database made at 0005 holding a job mid-run: every row and value is kept, the new
columns start innocent, and a request its old worker was running when it died (a row claimed before
lives were recorded) is claimed as crashed, its death recorded once with what that worker ran."""

from __future__ import annotations

import pytest
from sqlalchemy import MetaData, insert, select

from jobs.hosting.database_ledger import JobsLedger
from jobs.records.db import close_database, head_revision, make_engine, upgrade
from tests.support.jobs_env import tiny_settings

T = 1_790_000_000.0
JOB = "batch_0123456789abcdef01234567"
REQUEST = {"job_id": JOB, "url": "/v1/completions", "prompt_token_ids": [1, 2, 3], "params": {"max_tokens": 4},
           "published_at": T, "last_error": None, "created_at": T, "progress": 0, "strikes": 0}
ROWS = {
    "tenants": [{"id": 1, "name": "alice", "weight": 1.0, "created_at": T}],
    "jobs": [{"id": JOB, "tenant_id": 1, "model": "tiny-llama", "status": "in_progress", "priority": 0,
              "completion_window": "24h", "metadata": {}, "input_name": "in.jsonl", "input_key": f"jobs/{JOB}/in",
              "total": 3, "completed": 1, "failed": 0, "prompt_tokens": 3, "completion_tokens": 4, "created_at": T,
              "in_progress_at": T + 1, "expires_at": T + 86400}],
    "requests": [  # done; running on old-host:7 when it died; waiting in its window, never run
        {**REQUEST, "id": 1, "line": 1, "custom_id": "q1", "attempts": 1, "delivered_at": T, "holder": "old-host:7",
         "started": True},
        {**REQUEST, "id": 2, "line": 2, "custom_id": "q2", "attempts": 1, "delivered_at": T, "holder": "old-host:7",
         "started": True},
        {**REQUEST, "id": 3, "line": 3, "custom_id": "q3", "attempts": 1, "delivered_at": T, "holder": "old-host:7",
         "started": False},
        {**REQUEST, "id": 4, "line": 4, "custom_id": "q4", "attempts": 1, "delivered_at": T, "holder": "old-host:7",
         "started": True}],
    "results": [{"id": 1, "request_id": 1, "job_id": JOB, "status": "completed", "response": {"status_code": 200},
                 "error": None, "prompt_tokens": 3, "completion_tokens": 4, "worker": "old-host:7", "created_at": T}],
    "workers": [{"id": "old-host:7", "host": "old-host", "model": "tiny-llama", "device": "cpu", "running": 2,
                 "waiting": 1, "kv_blocks_used": 3, "kv_blocks_free": 9, "output_tokens_per_second": 5.0,
                 "started_at": T, "seen_at": T + 2}],
}


def _dump(engine) -> dict:
    meta = MetaData()
    meta.reflect(engine)
    with engine.connect() as conn:
        return {name: [dict(r._mapping) for r in conn.execute(select(meta.tables[name]).order_by(
            meta.tables[name].c.id))] for name in ROWS}


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_0008_keeps_every_row_of_a_0005_database_and_claims_its_crashed_requests(backend, tmp_path, request,
                                                                                   tiny_llama_dir):
    url = f"sqlite:///{tmp_path / 'old.db'}" if backend == "sqlite" else request.getfixturevalue("pg_url")
    assert upgrade(url, "0005") == "0005"
    engine = make_engine(url)
    meta = MetaData()
    meta.reflect(engine)
    with engine.begin() as conn:
        for name, rows in ROWS.items():
            conn.execute(insert(meta.tables[name]), rows)

    assert upgrade(url) == head_revision()
    after = _dump(engine)
    engine.dispose()
    for name, rows in ROWS.items():
        assert [{k: r[k] for k in rows[0]} for r in after[name]] == rows, name
    assert [(r["suspect"], r["holder_life"]) for r in after["requests"]] == [(0, None)] * 4

    ledger = JobsLedger(tiny_settings(tiny_llama_dir, database_url=url), None, "tiny-llama", eager_tasks=True)
    try:
        claims = ledger.claim([2, 3], "new-host:9")
        assert claims[2].crashed and claims[2].death.worker == "old-host:7"
        assert claims[2].death.running == 2  # 2 and 4: request 1 has its result, request 3 never ran
        assert not claims[3].crashed and claims[3].death is None and claims[3].suspect == 0
        ever = 3600 * 24 * 365 * 100
        assert ledger.worker_deaths(ever) == {"old-host": 1}
        later = ledger.claim([4], "other-host:1")  # the same death, found again by a later claim
        assert later[4].crashed and later[4].death == claims[2].death
        assert ledger.worker_deaths(ever) == {"old-host": 1}
    finally:
        close_database(url)
