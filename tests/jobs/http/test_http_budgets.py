"""Token budgets through the HTTP API (issue 34, finding 4): a batch past its tenant's enqueued-token
limit fails as OpenAI's does, ``errors.data[0].code == "token_limit_exceeded"`` in the Batch object
the openai client reads, and the tenant gets its room back as its lines finish."""

from __future__ import annotations

from sqlalchemy import select

from jobs.records.budgets import TOKEN_LIMIT_CODE, set_token_limit
from jobs.records.db import open_database
from jobs.records.models import RequestRow, ResultStatus
from jobs.records.results import ResultRecord, record_outcomes
from jobs.records.status import get_job
from tests.support.jobs_env import write_requests
from tests.support.serving import client, embedded_settings, key_for, serving, upload, wait_for


def _finish_lines(db, job_id: str) -> None:
    """What the engine worker does as the batch's lines finish: their outcomes."""
    with db.session() as s:
        ids = list(s.scalars(select(RequestRow.id).where(RequestRow.job_id == job_id)))
    record_outcomes(db, [ResultRecord(i, job_id, ResultStatus.COMPLETED, response={"status_code": 200})
                         for i in ids])


def test_a_batch_past_the_enqueued_token_limit_fails_with_openais_error_and_room_comes_back(tmp_path, tiny_llama_dir):
    settings = embedded_settings(tiny_llama_dir, tmp_path)
    requests = write_requests(tmp_path / "r.jsonl", 3, max_tokens=8)
    with serving(settings, worker=False) as server:
        db = open_database(settings.database_url)
        c = client(server, key_for(settings, "alice"))
        file_id = upload(c, requests).id
        first = wait_for(c, c.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                             completion_window="24h").id, statuses=("in_progress",))
        held = get_job(db, first.id).enqueued_tokens
        assert held > 0
        set_token_limit(db, "alice", held + held // 2)

        refused = wait_for(c, c.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                               completion_window="24h").id)
        assert refused.status == "failed" and refused.errors is not None
        [error] = refused.errors.data
        assert error.code == TOKEN_LIMIT_CODE and error.message.startswith("Enqueued token limit reached for")
        assert f"Limit: {held + held // 2:,} enqueued tokens" in error.message
        assert refused.request_counts.failed == refused.request_counts.total == 3
        assert c.files.content(refused.error_file_id).text.count(TOKEN_LIMIT_CODE) == 3

        _finish_lines(db, first.id)  # its lines are done: the room is back
        again = wait_for(c, c.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                             completion_window="24h").id, statuses=("in_progress", "failed"))
        assert again.status == "in_progress" and again.errors is None
