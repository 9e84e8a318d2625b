"""Migration 0010 (token budgets: tenants' enqueued-token limits, the tokens a job and a line hold, a
job's error code; the bytes a job stores) on a database made at 0009 holding a job mid-run: every row
and value is kept, the tenant takes the default limit, the job and its lines from before hold no
tokens and count no bytes (an old job is not counted against its tenant), and a later outcome of an
old line leaves its job at none."""

from __future__ import annotations

import pytest

from jobs.records.budgets import budgets
from jobs.records.db import close_database, open_database
from jobs.records.models import Job, ResultStatus
from jobs.records.results import ResultRecord, record_outcomes
from tests.support.migration_db import upgraded

T = 1_790_000_000.0
JOB = "batch_0123456789abcdef01234567"
REQUEST = {"job_id": JOB, "url": "/v1/completions", "prompt_token_ids": [1, 2, 3], "params": {"max_tokens": 4},
           "published_at": T, "created_at": T, "attempts": 1, "progress": 0, "strikes": 0, "suspect": 0}
ROWS = {
    "tenants": [{"id": 1, "name": "alice", "weight": 1.0, "created_at": T, "cache_group": None}],
    "jobs": [{"id": JOB, "tenant_id": 1, "model": "tiny-llama", "status": "in_progress", "priority": 0,
              "completion_window": "24h", "metadata": {}, "input_name": "in.jsonl", "input_key": f"jobs/{JOB}/in",
              "total": 2, "completed": 1, "failed": 0, "prompt_tokens": 3, "completion_tokens": 4, "created_at": T,
              "in_progress_at": T + 1, "expires_at": T + 86400, "cached_tokens": 0}],
    "requests": [{**REQUEST, "id": 1, "line": 1, "custom_id": "q1"},
                 {**REQUEST, "id": 2, "line": 2, "custom_id": "q2"}],
    "results": [{"request_id": 1, "job_id": JOB, "status": "completed", "response": {"status_code": 200},
                 "error": None, "prompt_tokens": 3, "completion_tokens": 4, "cached_tokens": 0, "worker": "old-host:7",
                 "created_at": T}],
}


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_0010_keeps_every_row_and_an_old_job_holds_no_tokens(backend, tmp_path, request):
    url = f"sqlite:///{tmp_path / 'old.db'}" if backend == "sqlite" else request.getfixturevalue("pg_url")
    after = upgraded(url, "0009", ROWS)
    assert [r["enqueued_token_limit"] for r in after["tenants"]] == [None]
    assert [(r["enqueued_tokens"], r["error_code"]) for r in after["jobs"]] == [(0, None)]
    assert [(r["input_bytes"], r["output_bytes"], r["errors_bytes"]) for r in after["jobs"]] == [(0, 0, 0)]
    assert [r["tokens"] for r in after["requests"]] == [0, 0]
    try:
        db = open_database(url)
        [budget] = budgets(db, 1000, "alice")
        assert (budget.limit, budget.own_limit, budget.enqueued) == (1000, False, {"tiny-llama": 0})
        record_outcomes(db, [ResultRecord(2, JOB, ResultStatus.COMPLETED, response={}, prompt_tokens=3,
                                          completion_tokens=4)])
        with db.session() as s:
            job = s.get(Job, JOB)
            assert (job.completed, job.enqueued_tokens) == (2, 0)
    finally:
        close_database(url)
