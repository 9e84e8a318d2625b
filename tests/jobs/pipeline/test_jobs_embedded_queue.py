"""The embedded queue stores a published batch in one transaction: all of it, in order, or none."""

from __future__ import annotations

import pytest
from kombu.exceptions import EncodeError

from jobs.pipeline.publish import Publisher
from jobs.pipeline.request_messages import RequestMessage
from worker.config import Settings
from worker.messaging.topology import Topology, connect


def _message(i: int, job_id: object = "batch_test") -> RequestMessage:
    return RequestMessage(i, job_id, "m")


def _drain(settings: Settings) -> list[dict]:
    """Every message in the queue of model "m", tenant "default", in delivery order (acked)."""
    bodies = []
    queue = Topology(settings.queue_prefix).request_queue("m", "default")
    with connect(settings) as conn, conn.Consumer(queue, accept=["json"],
                                                  callbacks=[lambda body, m: (bodies.append(body), m.ack())]):
        try:
            while True:
                conn.drain_events(timeout=0.5)
        except TimeoutError:
            pass
    return bodies


def test_a_batch_arrives_whole_and_in_order(tmp_path):
    settings = Settings(database_url=f"sqlite:///{tmp_path}/berth.db")
    with Publisher(settings) as publisher:
        assert publisher.publish([_message(i) for i in range(500)]) == 500
        publisher.publish([_message(500)])
    assert [b["request_id"] for b in _drain(settings)] == list(range(501))


def test_a_batch_that_fails_midway_stores_nothing(tmp_path):
    settings = Settings(database_url=f"sqlite:///{tmp_path}/berth.db")
    with Publisher(settings) as publisher:
        publisher.publish([_message(0)])
        unserializable = _message(2, object())
        with pytest.raises(EncodeError):
            publisher.publish([_message(1), unserializable, _message(3)])
        publisher.publish([_message(4)])
    assert [b["request_id"] for b in _drain(settings)] == [0, 4]
