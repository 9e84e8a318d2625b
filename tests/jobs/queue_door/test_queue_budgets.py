"""Token budgets at the queue door (issue 34, finding 4), on RabbitMQ and PostgreSQL: a submit message
whose lines would pass its tenant's enqueued-token limit makes a job that fails with OpenAI's
``token_limit_exceeded`` (its ``job.failed`` event says so), and the tenant gets its room back as its
lines finish."""

from __future__ import annotations

import json

from sqlalchemy import select

from jobs import api
from jobs.records.budgets import TOKEN_LIMIT_CODE, set_token_limit
from jobs.records.db import open_database
from jobs.records.models import JobStatus, RequestRow, ResultStatus
from jobs.records.results import ResultRecord, record_outcomes
from tests.support.jobs_env import request_line, write_requests
from tests.support.rabbitmq import EventTap, door_settings, job_of, publish, start_door, submit_body


def test_a_submit_past_the_enqueued_token_limit_fails_with_token_limit_exceeded_and_room_comes_back(
        tmp_path, tiny_llama_dir, pg_url, queue_prefix):
    settings = door_settings(tmp_path, tiny_llama_dir, pg_url, queue_prefix)
    db = open_database(settings.database_url)
    api.allow_broker_user("guest", "alice", settings)
    (tmp_path / "inbox" / "alice").mkdir()
    write_requests(tmp_path / "inbox" / "alice" / "r.jsonl", 3, max_tokens=8)
    body = submit_body(input_url=f"file://{tmp_path / 'inbox'}/alice/r.jsonl")
    tap = EventTap(queue_prefix)
    door = start_door(settings)
    try:
        publish(queue_prefix, body, "m-1")
        first = job_of(settings, "m-1")
        tap.wait_for(lambda key, b: key == "alice.job.in_progress" and b["job_id"] == first)
        held = api.status(first, settings).enqueued_tokens
        set_token_limit(db, "alice", held + held // 2)

        publish(queue_prefix, body, "m-2")
        second = job_of(settings, "m-2")
        events = tap.wait_for(lambda key, b: key == "alice.job.failed" and b["job_id"] == second)
        [failed] = [e for e in events if e.get("job_id") == second and e["type"] == "job.failed"]
        assert failed["error_code"] == TOKEN_LIMIT_CODE and "Enqueued token limit reached" in failed["error"]
        view = api.status(second, settings)
        assert view.status is JobStatus.FAILED and view.to_dict()["errors"]["data"][0]["code"] == TOKEN_LIMIT_CODE

        with db.session() as s:  # the first job's lines finish, as an engine worker records them
            ids = list(s.scalars(select(RequestRow.id).where(RequestRow.job_id == first)))
        record_outcomes(db, [ResultRecord(i, first, ResultStatus.COMPLETED, response={}) for i in ids])
        publish(queue_prefix, body, "m-3")
        third = job_of(settings, "m-3")
        tap.wait_for(lambda key, b: key == "alice.job.in_progress" and b["job_id"] == third)
    finally:
        door.stop()


def test_inline_inputs_count_in_the_storage_quota(tmp_path, tiny_llama_dir, pg_url, queue_prefix):
    """A queue submit's inline requests are stored as its job's input, and count in the tenant's storage
    quota like an upload (issue 34, finding 3): before, a tenant with no file at all could fill the store."""
    lines = [request_line(i) for i in range(20)]
    size = sum(len(json.dumps(r, ensure_ascii=False).encode()) + 1 for r in lines)
    settings = door_settings(tmp_path, tiny_llama_dir, pg_url, queue_prefix, tenant_max_storage_bytes=int(1.5 * size))
    api.allow_broker_user("guest", "alice", settings)
    door = start_door(settings)
    try:
        publish(queue_prefix, submit_body(requests=lines), "m-fits")
        fits = api.status(job_of(settings, "m-fits"), settings)
        publish(queue_prefix, submit_body(requests=lines), "m-over")
        over = api.status(job_of(settings, "m-over"), settings)
    finally:
        door.stop()
    assert fits.status is not JobStatus.FAILED, fits.error
    assert over.status is JobStatus.FAILED and "does not fit your storage quota" in over.error
