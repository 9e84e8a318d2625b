"""Migration 0009 (prefix sharing: tenants' cache groups, lines' cache salts, cached tokens counted) on
a database made at 0008 holding a job mid-run: every row and value is kept, a job and a result from
before count no cached tokens, a tenant shares with nobody, and an old request is claimed with its
tenant's own salt; a later outcome adds its cached tokens to the job's."""

from __future__ import annotations

import pytest

from jobs.hosting.database_ledger import JobsLedger
from jobs.records.db import close_database, open_database
from jobs.records.models import Job, ResultStatus
from jobs.records.results import ResultRecord, record_outcomes
from jobs.records.tenants import set_cache_group
from tests.support.jobs_env import tiny_settings
from tests.support.migration_db import upgraded

T = 1_790_000_000.0
JOB = "batch_0123456789abcdef01234567"
REQUEST = {"job_id": JOB, "url": "/v1/completions", "prompt_token_ids": [1, 2, 3], "params": {"max_tokens": 4},
           "published_at": T, "created_at": T, "attempts": 1, "progress": 0, "strikes": 0, "suspect": 0}
ROWS = {  # a result without an id: PostgreSQL's sequence gives it, and the next one
    "tenants": [{"id": 1, "name": "alice", "weight": 1.0, "created_at": T}],
    "jobs": [{"id": JOB, "tenant_id": 1, "model": "tiny-llama", "status": "in_progress", "priority": 0,
              "completion_window": "24h", "metadata": {}, "input_name": "in.jsonl", "input_key": f"jobs/{JOB}/in",
              "total": 2, "completed": 1, "failed": 0, "prompt_tokens": 3, "completion_tokens": 4, "created_at": T,
              "in_progress_at": T + 1, "expires_at": T + 86400}],
    "requests": [{**REQUEST, "id": 1, "line": 1, "custom_id": "q1"},
                 {**REQUEST, "id": 2, "line": 2, "custom_id": "q2"}],
    "results": [{"request_id": 1, "job_id": JOB, "status": "completed", "response": {"status_code": 200},
                 "error": None, "prompt_tokens": 3, "completion_tokens": 4, "worker": "old-host:7", "created_at": T}],
}


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_0009_keeps_every_row_and_counts_no_cached_tokens_before_it(backend, tmp_path, request, tiny_llama_dir):
    url = f"sqlite:///{tmp_path / 'old.db'}" if backend == "sqlite" else request.getfixturevalue("pg_url")
    after = upgraded(url, "0008", ROWS)
    assert [r["cached_tokens"] for r in after["jobs"]] == [0] and [r["cached_tokens"] for r in after["results"]] == [0]
    assert [r["cache_group"] for r in after["tenants"]] == [None]
    assert [r["cache_salt"] for r in after["requests"]] == [None, None]

    ledger = JobsLedger(tiny_settings(tiny_llama_dir, database_url=url), None, "tiny-llama", eager_tasks=True)
    try:
        assert ledger.claim([2], "new-host:1")[2].cache_salt is None  # alice's own
        db = open_database(url)
        set_cache_group(db, "alice", "lab")
        assert ledger.claim([2], "new-host:1")[2].cache_salt == "group:lab"
        record_outcomes(db, [ResultRecord(2, JOB, ResultStatus.COMPLETED, response={}, prompt_tokens=40,
                                          completion_tokens=4, cached_tokens=32)])
        with db.session() as s:
            job = s.get(Job, JOB)
            assert (job.prompt_tokens, job.cached_tokens) == (43, 32)
    finally:
        close_database(url)
