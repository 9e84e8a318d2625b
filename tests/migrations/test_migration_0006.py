"""Migration 0006 (files.expires_at, jobs.output_expires_after) on a database made at 0005 holding a
finished batch and its files: every row and value is kept, the old files never expire, the expiry
pass removes nothing of them, and the HTTP API shows them as before with ``expires_at`` null."""

from __future__ import annotations

import pytest

from jobs.records.db import close_database, open_database
from jobs.records.job_files import JobFiles
from tests.support.migration_db import upgraded

T = 1_790_000_000.0
JOB = "batch_0123456789abcdef01234567"
ROWS = {
    "tenants": [{"id": 1, "name": "alice", "weight": 1.0, "created_at": T, "webhook_secret": None}],
    "jobs": [{"id": JOB, "tenant_id": 1, "model": "tiny-llama", "status": "completed", "priority": 0,
              "completion_window": "24h", "metadata": {}, "input_name": "in.jsonl",
              "input_key": f"jobs/{JOB}/input.jsonl", "output_key": f"jobs/{JOB}/output.jsonl", "errors_key": None,
              "error": None, "total": 1, "completed": 1, "failed": 0, "prompt_tokens": 7, "completion_tokens": 4,
              "created_at": T, "in_progress_at": T + 1, "finalizing_at": T + 2, "completed_at": T + 3,
              "failed_at": None, "cancelling_at": None, "cancelled_at": None, "expired_at": None,
              "expires_at": T + 86400, "ingest_seen_at": T + 1, "endpoint": "/v1/completions",
              "input_file_id": "file-000000000000000000000001", "output_file_id": "file-000000000000000000000002",
              "error_file_id": None, "submit_message_id": None, "webhook_url": None}],
    "files": [{"id": "file-000000000000000000000001", "tenant_id": 1, "purpose": "batch", "filename": "in.jsonl",
               "bytes": 20, "key": "files/file-000000000000000000000001", "job_id": None, "created_at": T},
              {"id": "file-000000000000000000000002", "tenant_id": 1, "purpose": "batch_output",
               "filename": f"{JOB}_output.jsonl", "bytes": 20, "key": f"jobs/{JOB}/output.jsonl", "job_id": JOB,
               "created_at": T + 4}],
}


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_0006_keeps_every_row_of_a_0005_database_and_expires_none_of_its_files(backend, tmp_path, request):
    from jobs.http.files import get_file
    from jobs.records.file_removal import expire_files

    url = f"sqlite:///{tmp_path / 'old.db'}" if backend == "sqlite" else request.getfixturevalue("pg_url")
    after = upgraded(url, "0005", ROWS)
    assert [f["expires_at"] for f in after["files"]] == [None, None]
    assert after["jobs"][0]["output_expires_after"] is None

    files = JobFiles(f"file://{tmp_path / 'store'}")
    for f in ROWS["files"]:
        files.store.put(f["key"], b'{"custom_id": "q1"}\n')
    db = open_database(url)
    try:
        assert expire_files(db, files.store, at=T + 100 * 365 * 86400) == 0
        assert all(files.store.exists(f["key"]) for f in ROWS["files"])
        shown = get_file(db, "alice", "file-000000000000000000000002").to_openai()
        assert shown["expires_at"] is None and shown["purpose"] == "batch_output"
    finally:
        close_database(url)
