"""The queue's public contract without servers: the JSON Schemas and their examples, how a submit
message is read or refused, the event bodies berth builds, webhook signatures, and the outbox:
every change of a job's status, on every path, writes one event row in its own transaction."""

from __future__ import annotations

import json

import jsonschema
import pytest
from sqlalchemy import select, update

from jobs.pipeline.finalize import finalize
from jobs.pipeline.ingest import ingest
from jobs.pipeline.submit import JobSpec, create_job
from jobs.queue_door.contract import EVENT_SCHEMA, SUBMIT_SCHEMA, SubmitRefused, read_submit, salvage, schema
from jobs.queue_door.destinations import Allowed
from jobs.queue_door.events import job_event_body, rejection_body
from jobs.queue_door.webhooks import sign, verify
from jobs.records.db import open_database
from jobs.records.job_files import JobFiles
from jobs.records.lifecycle import cancel, expire_due
from jobs.records.models import Job, JobEvent, JobStatus, RequestRow, ResultStatus, Tenant
from jobs.records.results import ResultRecord, record_outcomes
from tests.support.jobs_env import TINY_NAME, request_line, tiny_settings, write_requests
from tests.support.paths import ROOT

MAX = 1 << 20


@pytest.mark.parametrize("name", [SUBMIT_SCHEMA, EVENT_SCHEMA])
def test_each_schema_is_valid_and_its_examples_validate(name):
    document = schema(name)
    jsonschema.Draft202012Validator.check_schema(document)
    assert document["examples"], "a schema of the contract shows what a message looks like"
    for example in document["examples"]:
        jsonschema.validate(example, document, cls=jsonschema.Draft202012Validator)


def test_the_submit_examples_are_read_as_they_say():
    by_url, inline, embeddings = schema(SUBMIT_SCHEMA)["examples"]
    message = read_submit(json.dumps(by_url).encode(), "application/json", MAX)
    assert (message.input_url, message.priority, message.metadata, message.webhook_url) == (
        by_url["input_url"], 5, {"project": "summaries"}, "https://hooks.example.com/berth")
    message = read_submit(json.dumps(inline).encode(), None, MAX)
    assert message.requests == inline["requests"] and message.input_url is None
    assert (message.priority, message.completion_window, message.metadata) == (0, "24h", {})
    message = read_submit(json.dumps(embeddings).encode(), None, MAX)
    assert [r["url"] for r in message.requests] == ["/v1/embeddings"]


GOOD = {"version": 1, "model": TINY_NAME, "requests": [request_line(0)]}


@pytest.mark.parametrize("body, content_type, reason", [
    (b"\x80\x81 not text", None, "not UTF-8"),
    (b"{not json", None, "not JSON"),
    (b"[" * 100_000, None, "not JSON"),  # nested too deep for the parser
    (b'{"version": 1, "model": "m", "requests": [{}], "n": ' + b"9" * 5000 + b"}", None, "not JSON"),
    (json.dumps(GOOD).encode(), "application/x-python-serialize", "content type"),
    (json.dumps({**GOOD, "tenant": "someone-else"}).encode(), None, "'tenant' was unexpected"),
    (json.dumps({k: v for k, v in GOOD.items() if k != "requests"}).encode(), None, "exactly one of them"),
    (json.dumps({**GOOD, "input_url": "s3://b/k.jsonl"}).encode(), None, "exactly one of them"),
    (json.dumps({**GOOD, "version": 2}).encode(), None, "version: 1 was expected"),
    (json.dumps({**GOOD, "priority": 10}).encode(), None, "priority: 10 is greater than the maximum"),
    (json.dumps({**GOOD, "completion_window": "0h"}).encode(), None, "completion_window"),
    (json.dumps({**GOOD, "metadata": {"k": 1}}).encode(), None, "metadata/k: 1 is not of type 'string'"),
    (json.dumps({**GOOD, "webhook_url": "ftp://x/y"}).encode(), None, "webhook_url"),
    (json.dumps({**GOOD, "requests": []}).encode(), None, "requests"),
    (json.dumps(GOOD).encode() + b" " * MAX, None, "over the limit"),
])
def test_a_bad_submit_message_is_refused_with_what_and_where(body, content_type, reason):
    with pytest.raises(SubmitRefused, match=reason.replace("(", r"\(").replace(")", r"\)")):
        read_submit(body, content_type, MAX)


def test_what_is_valid_of_a_refused_message_is_kept_for_its_failed_job():
    body = json.dumps({"version": 1, "model": TINY_NAME, "priority": 99, "metadata": {"run": "7"},
                       "webhook_url": "http://127.0.0.1:9/hook", "completion_window": "0s", "extra": 1}).encode()
    loopback = Allowed.parse("127.0.0.1")  # the receiver is on loopback: an operator names it
    assert salvage(body, MAX, loopback) == {"model": TINY_NAME, "metadata": {"run": "7"},
                                            "webhook_url": "http://127.0.0.1:9/hook"}
    assert salvage(b"\xff", MAX) == {} and salvage(b"[1]", MAX) == {}


def test_the_event_bodies_berth_builds_follow_the_event_schema():
    event = JobEvent(id=7, job_id="batch_x", status=JobStatus.COMPLETED, total=3, completed=2, failed=1,
                     prompt_tokens=30, completion_tokens=12, output_key="jobs/batch_x/output.jsonl",
                     errors_key="jobs/batch_x/errors.jsonl", error=None, created_at=1.5)
    job = Job(id="batch_x", model=TINY_NAME, submit_message_id="m-1", metadata_={"a": "b"})
    body = job_event_body(event, job, "alice", "s3://bucket/prefix/")
    jsonschema.validate(body, schema(EVENT_SCHEMA), cls=jsonschema.Draft202012Validator)
    assert body["output_url"] == "s3://bucket/prefix/jobs/batch_x/output.jsonl" and body["event_id"] == "evt_7"
    rejected = rejection_body(None, "mallory", "not allowed", "berth.dead")
    jsonschema.validate(rejected, schema(EVENT_SCHEMA), cls=jsonschema.Draft202012Validator)


def test_a_webhook_signature_covers_the_exact_bytes():
    body = b'{"type":"job.completed"}'
    signature = sign("whsec_1", body)
    assert signature.startswith("sha256=") and len(signature) == 7 + 64
    assert verify("whsec_1", body, signature)
    assert not verify("whsec_1", body + b" ", signature) and not verify("whsec_2", body, signature)
    assert not verify("whsec_1", body, None)


def _statuses(db, job_id: str) -> list[str]:
    with db.session() as s:
        return [e.value for e in s.scalars(select(JobEvent.status).where(JobEvent.job_id == job_id)
                                           .order_by(JobEvent.id))]


def test_every_change_of_status_on_every_path_writes_one_event(tmp_path, tiny_llama_dir):
    settings = tiny_settings(tiny_llama_dir, database_url=f"sqlite:///{tmp_path / 'berth.db'}",
                             storage_url=f"file://{tmp_path / 'store'}")
    db, files = open_database(settings.database_url), JobFiles(settings.storage_url)

    def submit(path) -> str:
        return create_job(db, files, path, TINY_NAME, JobSpec(tenant="alice"), settings)

    done = submit(write_requests(tmp_path / "two.jsonl", 2))
    assert ingest(db, files, settings, done) == []  # published on the embedded queue, none finished yet
    with db.session() as s:
        ids = list(s.scalars(select(RequestRow.id).where(RequestRow.job_id == done)))
    with db.session() as s, s.begin():  # a counter update that leaves status alone: no event
        s.execute(update(Job).where(Job.id == done).values(prompt_tokens=Job.prompt_tokens + 0))
    ready = record_outcomes(db, [ResultRecord(i, done, ResultStatus.COMPLETED, response={}, prompt_tokens=5,
                                              completion_tokens=4) for i in ids]).finalize
    assert ready == [done]
    assert finalize(db, files, done) is JobStatus.COMPLETED
    assert _statuses(db, done) == ["validating", "in_progress", "finalizing", "completed"]

    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    failed = submit(empty)
    ingest(db, files, settings, failed)
    assert _statuses(db, failed) == ["validating", "failed"]

    cancelled = submit(write_requests(tmp_path / "c.jsonl", 2))
    cancel(db, cancelled)
    finalize(db, files, cancelled)
    assert _statuses(db, cancelled) == ["validating", "cancelling", "cancelled"]

    expired = submit(write_requests(tmp_path / "e.jsonl", 2))
    with db.session() as s, s.begin():
        s.execute(update(Job).where(Job.id == expired).values(expires_at=0))
    assert expire_due(db) == [expired]
    finalize(db, files, expired)
    assert _statuses(db, expired) == ["validating", "finalizing", "expired"]

    with db.session() as s:  # each event holds the job as it was then
        last = s.scalars(select(JobEvent).where(JobEvent.job_id == done).order_by(JobEvent.id.desc())).first()
        job = s.get(Job, done)
        tenant = s.scalar(select(Tenant.name).where(Tenant.id == job.tenant_id))
    assert (last.total, last.completed, last.failed, last.prompt_tokens, last.completion_tokens) == (2, 2, 0, 10, 8)
    assert (last.output_key, last.errors_key) == (job.output_key, None) and tenant == "alice"
    assert last.published_at is None and last.webhook_due_at is None  # no relay ran; no webhook asked for


def test_events_are_deleted_once_older_than_the_keep_time(tmp_path, tiny_llama_dir):
    from jobs.records.outbox import prune_events

    settings = tiny_settings(tiny_llama_dir, database_url=f"sqlite:///{tmp_path / 'berth.db'}",
                             storage_url=f"file://{tmp_path / 'store'}")
    db, files = open_database(settings.database_url), JobFiles(settings.storage_url)
    old = create_job(db, files, write_requests(tmp_path / "a.jsonl", 1), TINY_NAME, JobSpec(), settings)
    new = create_job(db, files, write_requests(tmp_path / "b.jsonl", 1), TINY_NAME, JobSpec(), settings)
    with db.session() as s, s.begin():
        s.execute(update(JobEvent).where(JobEvent.job_id == old).values(created_at=JobEvent.created_at - 3600))
    assert prune_events(db, keep_seconds=600) == 1
    assert _statuses(db, old) == [] and _statuses(db, new) == ["validating"]


def test_the_documented_permissions_of_a_tenants_user_are_the_ones_berth_prints_and_the_tests_apply():

    from jobs.queue_door.contract import event_routing_key
    from jobs.queue_door.permissions import shell_lines

    doc = (ROOT / "docs" / "queue.md").read_text()
    section = doc.split("### Permissions of a tenant's user", 1)[1]
    block = section.split("```sh\n", 1)[1].split("\n```", 1)[0]
    assert block.splitlines() == shell_lines("alice", "team-a", "berth", "/")
    assert "'^team%2Ea\\.'" in section and shell_lines("u", "team.a", "berth")[1].endswith("'^team%2Ea\\.'")
    assert event_routing_key("team.a", "job.completed") == "team%2Ea.job.completed"
    assert event_routing_key(None, "submit.rejected") == ".submit.rejected"
