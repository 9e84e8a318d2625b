"""Jobs submitted through RabbitMQ by a producer that is not berth's (pika, raw JSON bytes and AMQP
properties), job events out on ``<prefix>.events``, bad messages answered with their reasons,
signed webhooks that wait for a receiver without holding the job up, and a job's at-risk event."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

import jsonschema
import pika
import pytest
from sqlalchemy import func, select, update

from jobs import api
from jobs.pipeline.submit import JobSpec, create_job
from jobs.queue_door.contract import EVENT_SCHEMA, schema
from jobs.queue_door.events import EventRelay
from jobs.queue_door.webhooks import SIGNATURE_HEADER, WebhookSender, verify
from jobs.records.db import open_database
from jobs.records.job_files import JobFiles
from jobs.records.models import Job, JobEvent, JobStatus
from jobs.records.outbox import raise_at_risk
from tests.support.jobs_env import TINY_NAME, read_jsonl, request_line, work_until_over, write_requests
from tests.support.processes import free_port
from tests.support.rabbitmq import (
    EventTap,
    TricklingReceiver,
    WebhookReceiver,
    dead_letters,
    door_settings,
    job_of,
    jobs_queue_depth,
    publish,
    publish_all,
    start_door,
    submit_body,
)


def _valid_event(body: dict) -> dict:
    jsonschema.validate(body, schema(EVENT_SCHEMA), cls=jsonschema.Draft202012Validator)
    return body


def test_a_job_published_twice_by_another_producer_runs_once_and_its_events_come_out(
        tmp_path, tiny_llama_dir, tiny_engine, pg_url, queue_prefix):
    settings = door_settings(tmp_path, tiny_llama_dir, pg_url, queue_prefix)
    api.allow_broker_user("guest", "alice", settings)
    (tmp_path / "inbox" / "alice").mkdir()
    write_requests(tmp_path / "inbox" / "alice" / "batch-1.jsonl", 6)
    tap = EventTap(queue_prefix)
    door = start_door(settings)
    try:
        body = submit_body(input_url=f"file://{tmp_path / 'inbox'}/alice/batch-1.jsonl", priority=3,
                           metadata={"order": "1"})
        publish(queue_prefix, body, "order-1")
        publish(queue_prefix, body, "order-1")  # published twice (a retrying producer): one job
        job_id = job_of(settings, "order-1")
        job = work_until_over(settings, tiny_engine, job_id)
        tap.wait_for(lambda key, b: key == "alice.job.completed" and b["job_id"] == job_id)
        deadline = time.monotonic() + 10
        while jobs_queue_depth(queue_prefix):
            assert time.monotonic() < deadline
            time.sleep(0.2)
    finally:
        door.stop()
    assert jobs_queue_depth(queue_prefix) == 0  # both copies acked (one unacked would be back after the stop)
    with open_database(pg_url).session() as s:
        assert s.scalar(select(func.count()).select_from(Job).where(Job.submit_message_id == "order-1")) == 1

    assert job.status is JobStatus.COMPLETED and (job.total, job.completed, job.failed) == (6, 6, 0)
    assert (job.tenant, job.priority, job.metadata) == ("alice", 3, {"order": "1"})
    events = tap.of_job(job_id)
    keys = [key for key, *_ in events]
    assert keys == ["alice.job.validating", "alice.job.in_progress", "alice.job.finalizing",
                    "alice.job.completed"], keys
    for key, body, headers, properties in events:
        _valid_event(body)
        assert headers["tenant"] == "alice" and properties.delivery_mode == 2
        assert (body["message_id"], body["metadata"], properties.correlation_id) == ("order-1", {"order": "1"},
                                                                                      "order-1")
        assert properties.message_id == body["event_id"] and properties.type == body["type"] == f"job.{body['status']}"
        assert key == f"alice.{body['type']}"  # the tenant's word first: what its topic permissions match
    in_progress, completed = events[1][1], events[3][1]
    assert in_progress["request_counts"]["total"] == 6
    assert completed["request_counts"] == {"total": 6, "completed": 6, "failed": 0}
    assert completed["usage"] == {"prompt_tokens": job.prompt_tokens, "completion_tokens": job.completion_tokens}
    assert completed["output_file"] == job.output_key and completed["error_file"] is None
    output = completed["output_url"].removeprefix("file://")
    assert [line["custom_id"] for line in read_jsonl(output)] == [f"req-{i}" for i in range(6)]
    tap.close()


def test_each_bad_submit_message_gets_its_reason_back_and_the_consumer_goes_on(
        tmp_path, tiny_llama_dir, tiny_engine, pg_url, queue_prefix):
    settings = door_settings(tmp_path, tiny_llama_dir, pg_url, queue_prefix)
    inbox = tmp_path / "inbox"
    good = {"requests": [request_line(i) for i in range(3)]}
    tap = EventTap(queue_prefix)
    door = start_door(settings)
    try:
        # no job can be made without a tenant or an idempotency key: dead letters
        publish(queue_prefix, submit_body(**good), "m-not-allowed")  # guest is not mapped to a tenant yet
        tap.wait_for(lambda key, b: key == ".submit.rejected" and b["message_id"] == "m-not-allowed")  # no tenant
        api.allow_broker_user("guest", "bob", settings)
        publish(queue_prefix, submit_body(**good), None)  # no message_id
        publish(queue_prefix, submit_body(**good), "m-no-user", user_id=None)
        # RabbitMQ itself refuses a user_id that is not the connection's user: no one submits as another
        with pytest.raises(pika.exceptions.ChannelClosedByBroker, match="user_id property set to 'mallory'"):
            publish(queue_prefix, submit_body(**good), "m-spoofed", user_id="mallory")
        # enough for a job: failed jobs with the reason
        bad = {
            "m-not-json": (b"{this is not json", "not JSON"),
            "m-unknown-field": (submit_body(**good, tenant="alice", metadata={"try": "2"}), "'tenant' was unexpected"),
            "m-no-input": (submit_body(), "exactly one of them"),
            "m-missing-file": (submit_body(input_url=f"file://{inbox}/bob/nowhere.jsonl"), "there is no such object"),
            "m-outside": (submit_body(input_url="file:///etc/passwd"), "not in a store berth reads"),
            "m-bad-key": (submit_body(input_url=f"file://{inbox}/bob/../store/x.jsonl"), "not an object key"),
            "m-unknown-model": (submit_body(model="gpt-9", **good), "not served here"),
            "m-pickle": (b"\x80\x04K\x01.", "content type"),
        }
        for message_id, (body, _) in bad.items():
            publish(queue_prefix, body, message_id,
                    content_type="application/x-python-serialize" if message_id == "m-pickle" else "application/json")
        publish(queue_prefix, submit_body(**good, metadata={"after": "the bad ones"}), "m-good")
        job_id = job_of(settings, "m-good")
        assert all(t.is_alive() for t in door.threads), "the door survives every message"
        job = work_until_over(settings, tiny_engine, job_id)
        events = tap.wait_for(lambda key, b: key == "bob.job.completed" and b["job_id"] == job_id)
        tap.wait_for(lambda key, b: key == "bob.job.failed" and b["message_id"] == "m-pickle")
    finally:
        door.stop()
    assert job.status is JobStatus.COMPLETED and (job.total, job.completed) == (3, 3)
    assert job.tenant == "bob" and job.metadata == {"after": "the bad ones"}

    failed = {body["message_id"]: body for body in events if body["type"] == "job.failed"}
    for message_id, (_, reason) in bad.items():
        event = _valid_event(failed[message_id])
        assert reason in event["error"], (message_id, event["error"])
        assert event["tenant"] == "bob"
        view = api.status(event["job_id"], settings)
        assert view.status is JobStatus.FAILED and reason in view.error and view.message_id == message_id
    assert failed["m-unknown-field"]["metadata"] == {"try": "2"}  # what was valid is echoed
    assert failed["m-unknown-model"]["model"] == "gpt-9"

    rejected = {body["message_id"]: body for body in events if body["type"] == "submit.rejected"}
    assert set(rejected) == {"m-not-allowed", None, "m-no-user"}
    assert "broker user 'guest' may not submit" in rejected["m-not-allowed"]["reason"]
    assert "needs a message_id" in rejected[None]["reason"] and "no user_id" in rejected["m-no-user"]["reason"]
    letters = dead_letters(queue_prefix)
    assert len(letters) == 3
    reasons = sorted(headers["x-berth-reason"] for _, headers in letters)
    assert reasons == sorted(body["reason"] for body in rejected.values())
    assert all(body == submit_body(**good) for body, _ in letters)  # the message as it came
    with open_database(pg_url).session() as s:
        assert s.scalar(select(func.count()).select_from(Job).where(Job.submit_message_id == "m-spoofed")) == 0
    tap.close()


class _Receiver(BaseHTTPRequestHandler):
    got: list[tuple[dict, bytes, float]] = []

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        type(self).got.append((dict(self.headers), body, time.time()))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_a_webhook_waits_for_its_receiver_without_holding_the_job_up(
        tmp_path, tiny_llama_dir, tiny_engine, pg_url, queue_prefix):
    settings = door_settings(tmp_path, tiny_llama_dir, pg_url, queue_prefix, webhook_backoff=0.2,
                             webhook_backoff_max=1.0, webhook_max_attempts=1000,
                             webhook_allow="127.0.0.1")  # the receiver is on loopback: an operator names it
    api.allow_broker_user("guest", "carol", settings)
    port = free_port()  # nothing listens there yet
    door = start_door(settings)
    server = None
    try:
        publish(queue_prefix, submit_body(requests=[request_line(i) for i in range(4)],
                                          webhook_url=f"http://127.0.0.1:{port}/berth/hook?team=carol"), "m-hook")
        job_id = job_of(settings, "m-hook")
        job = work_until_over(settings, tiny_engine, job_id)  # completes while every POST fails
        assert job.status is JobStatus.COMPLETED
        time.sleep(1.0)  # a few retries against the closed port
        _Receiver.got = []
        server = HTTPServer(("127.0.0.1", port), _Receiver)
        up_at = time.time()
        threading.Thread(target=server.serve_forever, daemon=True).start()
        deadline = time.monotonic() + 30
        while not any(json.loads(body)["type"] == "job.completed" for _, body, _ in _Receiver.got):
            assert time.monotonic() < deadline, "the completed event never reached the webhook"
            time.sleep(0.1)
    finally:
        door.stop()
        if server is not None:
            server.shutdown()
            server.server_close()
    assert job.completed_at < up_at  # the job finished before any webhook could be delivered

    secret = api.webhook_secret("carol", settings)
    bodies = []
    for headers, body, _ in _Receiver.got:
        assert verify(secret, body, headers[SIGNATURE_HEADER]), "signed with the tenant's secret"
        event = _valid_event(json.loads(body))
        assert headers["X-Berth-Event"] == event["type"] and headers["X-Berth-Event-Id"] == event["event_id"]
        bodies.append(event)
    assert [b["type"] for b in bodies] == ["job.validating", "job.in_progress", "job.finalizing", "job.completed"]
    completed = bodies[-1]
    assert completed["request_counts"] == {"total": 4, "completed": 4, "failed": 0}
    assert completed["output_file"] == job.output_key and completed["message_id"] == "m-hook"
    with open_database(pg_url).session() as s:
        attempts = dict(s.execute(select(JobEvent.status, JobEvent.webhook_attempts)
                                  .where(JobEvent.job_id == job_id)).all())
        assert all(e.webhook_sent_at is not None and e.webhook_due_at is None
                   for e in s.scalars(select(JobEvent).where(JobEvent.job_id == job_id)))
    assert attempts[JobStatus.VALIDATING] > 1  # it was tried while the receiver was down


def test_a_job_at_risk_of_missing_its_window_raises_one_event_on_the_exchange_and_to_its_webhook(
        tmp_path, tiny_llama_dir, pg_url, queue_prefix):
    settings = door_settings(tmp_path, tiny_llama_dir, pg_url, queue_prefix, webhook_allow="127.0.0.1")
    db = open_database(pg_url)
    job_id = create_job(db, JobFiles(settings.storage_url), write_requests(tmp_path / "in.jsonl", 4), TINY_NAME,
                        JobSpec(tenant="alice", completion_window="1h"), settings)
    receiver, tap = WebhookReceiver(), EventTap(queue_prefix, "alice.job.at_risk")  # what alice's user may bind
    try:
        t = time.time()
        with db.session() as s, s.begin():  # 50 minutes of its hour gone and 1 request of 4 done: 150 more to go
            s.execute(update(Job).where(Job.id == job_id).values(
                status=JobStatus.IN_PROGRESS, created_at=t - 3000, in_progress_at=t - 3000, expires_at=t + 600,
                total=4, completed=1))
            s.execute(update(Job).where(Job.id == job_id).values(webhook_url=f"http://127.0.0.1:{receiver.port}/h"))
        assert raise_at_risk(db) == [job_id] and raise_at_risk(db) == []  # once
        relay = EventRelay(settings, db)
        assert relay.drain() == 3  # validating, in_progress, at_risk
        relay.close()
        tap.wait_for(lambda key, body: key == "alice.job.at_risk")
        assert WebhookSender(settings, db).send_due() == 1  # only the at-risk event has its webhook
        [(key, body, headers, properties)] = tap.of_job(job_id)
    finally:
        receiver.close()
        tap.close()
    assert _valid_event(body)["type"] == properties.type == "job.at_risk" and headers["tenant"] == "alice"
    assert (body["status"], body["request_counts"]["completed"], body["expires_at"]) == ("in_progress", 1, t + 600)
    assert body["expected_finish_at"] == pytest.approx(t + 9000, abs=60)  # 3 requests left at 3000 s each
    [(post_headers, post_body, _)] = receiver.got
    assert json.loads(post_body) == body and post_headers["X-Berth-Event"] == "job.at_risk"
    assert verify(api.webhook_secret("alice", settings), post_body, post_headers[SIGNATURE_HEADER])


def test_a_tenants_flood_of_refused_messages_and_slow_receiver_do_not_hold_up_another_tenants_webhook(
        tmp_path, tiny_llama_dir, tiny_engine, pg_url, queue_prefix):
    """Tenant flood sends 200 messages that are refused (each makes a failed job, and so an event)
    with a webhook to a closed port, and 20 with a receiver that answers one byte every 2 s. Tenant
    calm's job completes meanwhile: its completed webhook arrives within 10 s, with the defaults."""
    settings = door_settings(tmp_path, tiny_llama_dir, pg_url, queue_prefix,
                             webhook_allow="127.0.0.1")  # the receivers are on loopback: an operator names it
    closed, trickle, calm = free_port(), TricklingReceiver(gap=2.0), WebhookReceiver()
    api.allow_broker_user("guest", "flood", settings)
    door = start_door(settings)
    try:
        refused = [(submit_body(model="not-served-here", requests=[request_line(0)],
                                webhook_url=f"http://127.0.0.1:{trickle.port if i % 11 == 5 else closed}/hook"),
                    f"m-flood-{i}") for i in range(220)]
        publish_all(queue_prefix, refused)
        db = open_database(pg_url)
        deadline = time.monotonic() + 180
        while True:  # every refused message made its failed job, and the slow receiver holds POSTs
            with db.session() as s:
                made = s.scalar(select(func.count()).select_from(Job).where(Job.status == JobStatus.FAILED))
            if made == 220 and trickle.connections:
                break
            assert time.monotonic() < deadline, f"{made} of 220 refused messages handled"
            time.sleep(0.2)
        api.allow_broker_user("guest", "calm", settings)  # the producer now submits for another tenant
        publish(queue_prefix, submit_body(requests=[request_line(i) for i in range(2)],
                                          webhook_url=f"http://127.0.0.1:{calm.port}/calm"), "m-calm")
        job = work_until_over(settings, tiny_engine, job_of(settings, "m-calm"))
        assert job.status is JobStatus.COMPLETED
        deadline = time.monotonic() + 60  # generous for waiting; the assertion is on when it came
        while not any(b["type"] == "job.completed" for b in calm.bodies()):
            assert time.monotonic() < deadline, f"calm's completed webhook never came: {calm.bodies()}"
            time.sleep(0.1)
    finally:
        door.stop()
        trickle.close()
        calm.close()
    (arrived,) = [came for _, body, came in calm.got if json.loads(body)["type"] == "job.completed"]
    assert arrived - job.completed_at < 10.0, f"calm's webhook came {arrived - job.completed_at:.1f} s after"
    assert [b["type"] for b in calm.bodies()] == ["job.validating", "job.in_progress", "job.finalizing",
                                                   "job.completed"]
    with db.session() as s:  # and the flood is still being tried: held back, not dropped
        tried = s.scalar(select(func.count()).select_from(JobEvent).where(JobEvent.webhook_attempts > 0,
                                                                          JobEvent.webhook_sent_at.is_(None)))
    assert tried > 0


def test_an_input_named_by_an_s3_url_is_read_only_from_an_allowed_prefix(
        tmp_path, tiny_llama_dir, pg_url, queue_prefix, s3_url):
    from storage import open_store

    inbox = f"{s3_url}/inbox"
    settings = door_settings(tmp_path, tiny_llama_dir, pg_url, queue_prefix, submit_input_stores=inbox + "/{tenant}")
    api.allow_broker_user("guest", "alice", settings)
    lines = write_requests(tmp_path / "batch.jsonl", 5).read_bytes()
    open_store(inbox).put("alice/batch.jsonl", lines)
    open_store(inbox).put("bob/batch.jsonl", lines)  # the same store, another tenant's prefix
    open_store(s3_url).put("elsewhere/batch.jsonl", lines)  # the same bucket, outside the allowed prefix
    door = start_door(settings)
    try:  # ingested by the consumer before it takes the next message: in progress once the next is handled
        publish(queue_prefix, submit_body(input_url=f"{inbox}/alice/batch.jsonl"), "m-s3")
        publish(queue_prefix, submit_body(input_url=f"{s3_url}/elsewhere/batch.jsonl"), "m-s3-outside")
        publish(queue_prefix, submit_body(input_url=f"{inbox}/bob/batch.jsonl"), "m-s3-other-tenant")
        outside = job_of(settings, "m-s3-outside")
        other = job_of(settings, "m-s3-other-tenant")
        job = api.status(job_of(settings, "m-s3"), settings)
    finally:
        door.stop()
    assert job.status is JobStatus.IN_PROGRESS and job.total == 5 and job.input_name == f"{inbox}/alice/batch.jsonl"
    for refused in (api.status(outside, settings), api.status(other, settings)):
        assert refused.status is JobStatus.FAILED and "not in a store berth reads" in refused.error
        assert f"its inputs go under {inbox}/alice/" in refused.error
