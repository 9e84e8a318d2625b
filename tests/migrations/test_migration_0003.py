"""Migration 0003 (the HTTP API's tables, a job's endpoint and file ids) on a database made at 0002
holding a finished job: every row and value is kept, and the HTTP API shows the old job as a batch."""

from __future__ import annotations

import json

import pytest

from jobs.http.batches import batch_object, get_batch
from jobs.records.db import close_database, open_database
from jobs.records.job_files import JobFiles
from tests.support.migration_db import upgraded

T = 1_790_000_000.0
ROWS = {
    "tenants": [{"id": 1, "name": "alice", "weight": 2.0, "created_at": T}],
    "jobs": [{"id": "batch_0123456789abcdef01234567", "tenant_id": 1, "model": "tiny-llama", "status": "completed",
              "priority": 3, "completion_window": "24h", "metadata": {"team": "search"}, "input_name": "in.jsonl",
              "input_key": "jobs/batch_0123456789abcdef01234567/input.jsonl",
              "output_key": "jobs/batch_0123456789abcdef01234567/output.jsonl", "errors_key": None, "error": None,
              "total": 1, "completed": 1, "failed": 0, "prompt_tokens": 7, "completion_tokens": 4, "created_at": T,
              "in_progress_at": T + 1, "finalizing_at": T + 2, "completed_at": T + 3, "failed_at": None,
              "cancelling_at": None, "cancelled_at": None, "expired_at": None, "expires_at": T + 86400,
              "ingest_seen_at": T + 1}],
    "requests": [{"id": 1, "job_id": "batch_0123456789abcdef01234567", "line": 1, "custom_id": "q1",
                  "url": "/v1/completions", "prompt_token_ids": [1, 2, 3], "params": {"max_tokens": 4},
                  "attempts": 1, "published_at": T, "delivered_at": T, "last_error": None, "created_at": T,
                  "holder": None, "started": True, "progress": 4, "strikes": 0}],
    "results": [{"id": 1, "request_id": 1, "job_id": "batch_0123456789abcdef01234567", "status": "completed",
                 "response": {"status_code": 200, "body": {"choices": []}}, "error": None, "prompt_tokens": 7,
                 "completion_tokens": 4, "worker": "host:1", "created_at": T + 2}],
    "line_errors": [{"id": 1, "job_id": "batch_0123456789abcdef01234567", "line": 2, "custom_id": None,
                     "param": "body", "code": "invalid_request", "message": "bad"}],
}


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_0003_keeps_every_row_of_a_0002_database(backend, tmp_path, request):
    url = f"sqlite:///{tmp_path / 'old.db'}" if backend == "sqlite" else request.getfixturevalue("pg_url")
    after = upgraded(url, "0002", ROWS)
    job = after["jobs"][0]
    assert {job[c] for c in ("endpoint", "input_file_id", "output_file_id", "error_file_id")} == {None}

    store = tmp_path / "store"
    files = JobFiles(f"file://{store}")
    files.store.put(ROWS["jobs"][0]["input_key"], b'{"custom_id": "q1"}\n')
    files.store.put(ROWS["jobs"][0]["output_key"], json.dumps({"custom_id": "q1"}).encode() + b"\n")
    db = open_database(url)
    try:
        shown = batch_object(get_batch(db, files, "alice", ROWS["jobs"][0]["id"]))
        assert shown["status"] == "completed" and shown["metadata"] == {"team": "search"}
        assert shown["input_file_id"].startswith("file-") and shown["output_file_id"].startswith("file-")
        assert shown["error_file_id"] is None and shown["request_counts"]["completed"] == 1
        assert batch_object(get_batch(db, files, "alice", ROWS["jobs"][0]["id"])) == shown  # ids made once
    finally:
        close_database(url)
