"""The queue door against a hostile tenant, on RabbitMQ and PostgreSQL: a tenant reads only its own
inputs (no other tenant's folder, no link out of it), sees only its own events under the documented
RabbitMQ permissions and can reach none of berth's internal queues, and cannot stall the door for
the others with a message whose body cannot be read or whose dead letter fails."""

from __future__ import annotations

import gzip
import json
import time

import pika
import pytest
from sqlalchemy import select

from jobs import api
from jobs.queue_door.consumer import SET_ASIDE_TRIES, SubmitConsumer
from jobs.records.db import open_database
from jobs.records.models import Job, JobStatus
from tests.support.jobs_env import TINY_NAME, request_line, work_until_over, write_requests
from tests.support.rabbitmq import (
    PIKA_URL,
    EventTap,
    dead_letters,
    door_settings,
    job_of,
    jobs_queue_depth,
    publish,
    start_door,
    submit_body,
)
from worker.config import ConfigError
from worker.messaging.topology import Topology


def _job_status(settings, message_id: str):
    return api.status(job_of(settings, message_id), settings)


# ---- inputs
def test_a_tenant_reads_only_its_own_inputs_and_no_link_out_of_them(tmp_path, tiny_llama_dir, pg_url, queue_prefix):
    settings = door_settings(tmp_path, tiny_llama_dir, pg_url, queue_prefix)  # inbox/{tenant}
    inbox = tmp_path / "inbox"
    api.allow_broker_user("guest", "bob", settings)
    (inbox / "alice").mkdir()
    (inbox / "alice" / "secret.jsonl").write_text(json.dumps(request_line(0) | {"custom_id": "alice-secret"}) + "\n")
    (inbox / "bob").mkdir()
    write_requests(inbox / "bob" / "mine.jsonl", 2)
    (inbox / "bob" / "passwd.jsonl").symlink_to("/etc/passwd")
    (inbox / "bob" / "theirs.jsonl").symlink_to("../alice/secret.jsonl")
    (inbox / "bob" / "alice").symlink_to(inbox / "alice", target_is_directory=True)
    tries = {  # message id -> input_url, what the refusal says
        "m-other-tenant": (f"file://{inbox}/alice/secret.jsonl", "not in a store berth reads"),
        "m-host-file": (f"file://{inbox}/bob/passwd.jsonl", "symbolic link"),
        "m-link-across": (f"file://{inbox}/bob/theirs.jsonl", "symbolic link"),
        "m-linked-folder": (f"file://{inbox}/bob/alice/secret.jsonl", "is a link or not a folder"),
    }
    door = start_door(settings)
    try:
        publish(queue_prefix, submit_body(input_url=f"file://{inbox}/bob/mine.jsonl"), "m-own")
        for message_id, (url, _) in tries.items():
            publish(queue_prefix, submit_body(input_url=url), message_id)
        refused = {message_id: _job_status(settings, message_id) for message_id in tries}
        own = _job_status(settings, "m-own")  # ingested by the consumer before it took the next message
    finally:
        door.stop()
    assert own.tenant == "bob" and own.total == 2 and own.status is JobStatus.IN_PROGRESS
    for message_id, (_, reason) in tries.items():
        job = refused[message_id]
        assert job.status is JobStatus.FAILED and reason in job.error, (message_id, job.error)
    stored = b"".join(p.read_bytes() for p in (tmp_path / "store").rglob("*") if p.is_file())
    assert b"root:x:0:0" not in stored and b"alice-secret" not in stored


def test_an_input_store_every_tenant_could_read_is_refused_at_start(tmp_path, tiny_llama_dir, pg_url, queue_prefix):
    shared = door_settings(tmp_path, tiny_llama_dir, pg_url, queue_prefix,
                           submit_input_stores=f"file://{tmp_path / 'inbox'}")
    with pytest.raises(ConfigError, match=r"has no \{tenant\}: every tenant could make berth read what it holds"):
        SubmitConsumer(shared)


# ---- events and the broker's permissions
def test_a_tenant_user_with_the_documented_permissions_sees_only_its_own_events_and_no_internal_queue(
        tmp_path, tiny_llama_dir, tiny_engine, pg_url, queue_prefix, broker_users):
    settings = door_settings(tmp_path, tiny_llama_dir, pg_url, queue_prefix)
    (alice, alice_url), (bob, bob_url) = broker_users("team-a"), broker_users("team-b")
    api.allow_broker_user(alice, "team-a", settings)
    api.allow_broker_user(bob, "team-b", settings)
    topology = Topology(queue_prefix)
    with pika.BlockingConnection(pika.URLParameters(PIKA_URL)) as admin:  # berth's own queues, as they run
        channel = admin.channel()
        for tenant in ("team-a", "team-b"):
            queue = topology.request_queue(TINY_NAME, tenant)
            channel.exchange_declare(topology.exchange.name, "direct", durable=True)
            channel.queue_declare(queue.name, durable=True, arguments=queue.queue_arguments)
        channel.queue_declare(topology.celery_queue, durable=True)
    operator = EventTap(queue_prefix)  # the operator's user (guest) binds "#": every tenant's events
    door = start_door(settings)
    refused = []

    def refused_to(url: str, what: str, act) -> None:
        with pika.BlockingConnection(pika.URLParameters(url)) as conn:
            with pytest.raises(pika.exceptions.ChannelClosedByBroker, match="ACCESS_REFUSED"):
                act(conn.channel())
        refused.append(what)

    def bind(key: str):
        def act(channel):
            queue = channel.queue_declare("", exclusive=True).method.queue
            channel.queue_bind(queue, topology.events_exchange.name, key)
        return act

    def publish_to(exchange: str, key: str):
        def act(channel):
            channel.confirm_delivery()
            channel.basic_publish(exchange, key, b'{"request_id": 1, "job_id": "batch_x"}',
                                  pika.BasicProperties(user_id=alice, delivery_mode=2))
        return act

    try:
        for key in ("#", "team-b.#", "*.job.completed", "#.completed", ".submit.rejected"):
            refused_to(alice_url, f"bind {key}", bind(key))
        internal = [topology.jobs_queue.name, topology.dead_queue.name, topology.celery_queue,
                    topology.request_queue(TINY_NAME, "team-b").name, topology.request_queue(TINY_NAME, "team-a").name]
        for queue in internal:
            refused_to(alice_url, f"consume {queue}", lambda ch, q=queue: ch.basic_get(q))
        for exchange, key in [("", topology.request_queue(TINY_NAME, "team-b").name),  # the default exchange
                              ("", topology.celery_queue), ("", topology.jobs_queue.name),
                              (topology.exchange.name, f"{TINY_NAME}.team-b"), (topology.dead_exchange.name, "dead"),
                              (topology.events_exchange.name, "team-b.job.completed")]:
            refused_to(alice_url, f"publish {exchange or 'amq.default'}/{key}", publish_to(exchange, key))
        refused_to(alice_url, "delete the events exchange",
                   lambda ch: ch.exchange_delete(topology.events_exchange.name))

        taps = {}
        for tenant, url in (("team-a", alice_url), ("team-b", bob_url)):  # what each is allowed: its own events
            conn = pika.BlockingConnection(pika.URLParameters(url))
            channel = conn.channel()
            queue = channel.queue_declare("", exclusive=True).method.queue
            channel.queue_bind(queue, topology.events_exchange.name, f"{tenant}.#")
            taps[tenant] = (conn, channel, queue)
        body = submit_body(requests=[request_line(i) for i in range(2)], metadata={"confidential": "yes"})
        publish(queue_prefix, body, "a-1", user_id=alice, url=alice_url)
        publish(queue_prefix, body, "b-1", user_id=bob, url=bob_url)
        jobs = {"team-a": job_of(settings, "a-1"), "team-b": job_of(settings, "b-1")}
        for job_id in jobs.values():
            assert work_until_over(settings, tiny_engine, job_id).status is JobStatus.COMPLETED
        operator.wait_for(lambda key, b: key == "team-a.job.completed")
        operator.wait_for(lambda key, b: key == "team-b.job.completed")
        got = {}
        for tenant, (conn, channel, queue) in taps.items():
            got[tenant] = []
            deadline = time.monotonic() + 30
            while len(got[tenant]) < 4:
                method, properties, raw = channel.basic_get(queue, auto_ack=True)
                if method is None:
                    assert time.monotonic() < deadline, (tenant, got[tenant])
                    time.sleep(0.2)
                    continue
                got[tenant].append((method.routing_key, json.loads(raw)))
            time.sleep(1.0)  # anything else on its way
            assert channel.basic_get(queue, auto_ack=True)[0] is None
            conn.close()
    finally:
        door.stop()
        operator.close()
    for tenant, events in got.items():
        assert [key for key, _ in events] == [f"{tenant}.job.{s}" for s in
                                              ("validating", "in_progress", "finalizing", "completed")]
        assert {e["job_id"] for _, e in events} == {jobs[tenant]} and {e["tenant"] for _, e in events} == {tenant}
    assert len(refused) == 17, refused  # each of them tried, and refused by the broker


# ---- stalls
def test_a_message_with_a_content_encoding_holds_no_tenant_up(
        tmp_path, tiny_llama_dir, tiny_engine, pg_url, queue_prefix, broker_users):
    """py-amqp hands a body with a content_encoding over as a str; each such message is read (or
    refused) like any other, and another tenant's job submitted after them completes."""
    settings = door_settings(tmp_path, tiny_llama_dir, pg_url, queue_prefix)
    api.allow_broker_user("guest", "bob", settings)
    alice, alice_url = broker_users("team-a")
    api.allow_broker_user(alice, "team-a", settings)
    door = start_door(settings)
    good = submit_body(requests=[request_line(i) for i in range(2)])
    latin = b'{"version": 1, "model": "caf\xe9", "requests": []}'
    try:
        publish(queue_prefix, good, "m-utf8", content_encoding="utf-8")  # what wedged the door
        publish(queue_prefix, latin, "m-latin1", content_encoding="latin-1")
        publish(queue_prefix, gzip.compress(good), "m-gzip", content_encoding="gzip")
        publish(queue_prefix, good, "m-utf16", content_encoding="utf-16")  # py-amqp would make nonsense of it
        publish(queue_prefix, good, None, content_encoding="utf-8")  # no message_id: a dead letter, from a str body
        publish(queue_prefix, submit_body(requests=[request_line(0)]), "a-after", user_id=alice, url=alice_url)
        after = job_of(settings, "a-after", timeout=60)
        utf8 = job_of(settings, "m-utf8")
        for job_id in (after, utf8):
            job = work_until_over(settings, tiny_engine, job_id)
            assert job.status is JobStatus.COMPLETED and job.failed == 0, (job.status, job.error)
        reasons = {m: _job_status(settings, m).error for m in ("m-latin1", "m-gzip", "m-utf16")}
        utf16 = _job_status(settings, "m-utf16")  # its bytes, as published, are UTF-8 JSON: a job like any other
        assert utf16.status is not JobStatus.FAILED and utf16.total == 2
        assert all(t.is_alive() for t in door.threads)
        deadline = time.monotonic() + 30
        while jobs_queue_depth(queue_prefix):
            assert time.monotonic() < deadline
            time.sleep(0.2)
    finally:
        door.stop()
    assert jobs_queue_depth(queue_prefix) == 0  # every message acked
    assert "not UTF-8 text (its content_encoding is 'latin-1'" in reasons["m-latin1"]
    assert "not UTF-8 text (its content_encoding is 'gzip'" in reasons["m-gzip"]
    assert reasons["m-utf16"] is None
    [(body, headers)] = dead_letters(queue_prefix)
    assert body == good and "needs a message_id" in headers["x-berth-reason"]  # the bytes as published


class _Message:
    """A delivery as kombu hands it to the door's callback."""

    def __init__(self, body, message_id: str):
        self.body, self.content_type, self.content_encoding = body, "application/json", "utf-8"
        self.properties = {"user_id": "guest", "message_id": message_id}
        self.acked = self.requeued = 0

    def ack(self):
        self.acked += 1

    def requeue(self):
        self.requeued += 1


def test_a_message_whose_dead_letter_fails_too_is_dropped_after_a_few_tries_not_redelivered_forever(
        tmp_path, tiny_llama_dir, pg_url, queue_prefix, monkeypatch):
    consumer = SubmitConsumer(door_settings(tmp_path, tiny_llama_dir, pg_url, queue_prefix))
    consumer._stop.set()  # no backoff waits between the tries here
    handled = []

    def handle(body, properties, content_type=None, content_encoding=None):
        if properties["message_id"] == "m-poison":
            raise RuntimeError("a failure of berth's own")
        handled.append(properties["message_id"])

    def dead_letter(*args, **kwargs):
        raise RuntimeError("the dead-letter queue refuses it")

    monkeypatch.setattr(consumer, "handle", handle)
    monkeypatch.setattr(consumer, "_dead_letter", dead_letter)
    poison = _Message('{"version": 1}', "m-poison")  # a str body, as py-amqp hands it over
    for delivery in range(1, SET_ASIDE_TRIES + 1):  # the broker redelivers what is put back
        consumer._on_message(poison)
        assert (poison.requeued, poison.acked) == ((delivery, 0) if delivery < SET_ASIDE_TRIES else (delivery - 1, 1))
    after = _Message(b"{}", "m-after")
    consumer._on_message(after)
    assert after.acked == 1 and handled == ["m-after"]
    with open_database(pg_url).session() as s:
        assert s.scalars(select(Job.id)).all() == []
