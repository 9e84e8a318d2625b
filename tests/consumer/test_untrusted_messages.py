"""Queue messages are untrusted: on RabbitMQ and PostgreSQL, one message of each bad kind lands on a
tenant's request queue beside real jobs. Each is dead-lettered with its reason, the jobs complete
with one result per request, and the `berth worker` process never exits."""

from __future__ import annotations

import os
import pickle
import sys
import time

from kombu import Connection, Producer
from sqlalchemy import func, select

from jobs import api
from jobs.pipeline.celery_tasks import finalize_later, make_app
from jobs.records.db import open_database
from jobs.records.models import JobStatus, RequestRow, Result
from tests.support.jobs_env import (
    AMQP_URL,
    TINY_NAME,
    kill_if_running,
    stop_gracefully,
    tiny_env,
    tiny_settings,
    write_requests,
)
from tests.support.processes import spawn
from worker.messaging.topology import REASON_HEADER, Topology


def _wait(settings, job_ids, proc, timeout=120):
    """Until every request of the jobs has its outcome; then the jobs are finalized here (there is no
    Celery worker in this test)."""
    deadline = time.monotonic() + timeout
    while True:
        views = [api.status(j, settings) for j in job_ids]
        if all(v.status is JobStatus.FINALIZING for v in views):
            finalize_later(make_app(settings, eager=True), job_ids)
            return [api.status(j, settings) for j in job_ids]
        assert proc.poll() is None, "the worker exited"
        assert time.monotonic() < deadline, [(v.status.value, v.done, v.total) for v in views]
        time.sleep(0.3)


def test_bad_messages_are_dead_lettered_and_the_worker_keeps_consuming(tmp_path, tiny_llama_dir, pg_url, queue_prefix):
    settings = tiny_settings(tiny_llama_dir, database_url=pg_url, broker_url=AMQP_URL, queue_prefix=queue_prefix,
                             storage_url=f"file://{tmp_path / 'store'}", drain_timeout=5)
    proc = spawn([sys.executable, "-m", "jobs.cli", "worker"], {**os.environ, **tiny_env(settings)},
                  tmp_path / "worker.log")
    try:
        first = api.submit(write_requests(tmp_path / "first.jsonl", 3), settings, eager=True)
        with open_database(pg_url).session() as s:
            foreign = s.scalar(select(func.min(RequestRow.id)).where(RequestRow.job_id == first.id))
        topology = Topology(queue_prefix)
        queue = topology.request_queue(TINY_NAME, "default")
        bad = {  # body, content type -> what the reason must say
            (b"this is not JSON", "application/json"): "unreadable message",
            (pickle.dumps({"request_id": foreign, "job_id": first.id}), "application/x-python-serialize"):
                "unreadable message",
            (b"<request id='1'/>", "application/xml"): "unreadable message",
            (b'{"request_id": "7", "job_id": "batch_x"}', "application/json"): "request_id must be a positive integer",
            (f'{{"request_id": {foreign}, "job_id": "batch_nosuchjob"}}'.encode(), "application/json"):
                "belongs to job",
            (b'{"request_id": 987654321, "job_id": "batch_x"}', "application/json"): "is not in the database",
            (b'{"request_id": 1, "job_id": ' + b'"' + b"x" * 5000 + b'"}', "application/json"): "job_id must be",
        }
        with Connection(AMQP_URL) as conn:
            producer = Producer(conn.default_channel)
            for body, content_type in bad:
                producer.publish(body, exchange=queue.exchange, routing_key=queue.routing_key, declare=[queue],
                                 content_type=content_type, content_encoding="binary", delivery_mode=2)
        second = api.submit(write_requests(tmp_path / "second.jsonl", 5), settings, eager=True)
        views = _wait(settings, [first.id, second.id], proc)
        assert [(v.status, v.completed, v.failed) for v in views] == [(JobStatus.COMPLETED, 3, 0),
                                                                       (JobStatus.COMPLETED, 5, 0)]
        dead = []
        with Connection(AMQP_URL) as conn:
            dead_queue = topology.dead_queue.bind(conn.default_channel)
            deadline = time.monotonic() + 30
            while len(dead) < len(bad) and time.monotonic() < deadline:
                message = dead_queue.get(no_ack=True)
                if message is None:
                    time.sleep(0.2)
                    continue
                dead.append(((message.body, message.content_type), message.headers[REASON_HEADER]))
        assert len(dead) == len(bad), dead
        for (body, content_type), reason in dead:
            expected = bad[(body, content_type)]  # the body and its content type, as published
            assert expected in reason, (body[:60], reason)
        assert proc.poll() is None, "the worker exited"
        assert stop_gracefully(proc) == 0
    finally:
        kill_if_running(proc)
    with open_database(pg_url).session() as s:
        per_request = s.execute(select(Result.request_id, func.count()).group_by(Result.request_id)).all()
    assert len(per_request) == 8 and all(n == 1 for _, n in per_request)
