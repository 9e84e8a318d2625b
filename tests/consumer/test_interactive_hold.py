"""Issue 34, finding 4, on a real RabbitMQ: the worker's ``BrokerLink`` and ``RemoteRequests`` (no
model: an inbox stand-in whose test says when each request's first event and end go out), at the
default ``interactive_prefetch`` (8). Twenty requests published at once are held at most eight at a
time, acked or not; the rest wait in the queue, unacked by nobody, and each is taken once as others
end. Before, each ack at a first event freed a place in the consumer's prefetch while its request
ran on, and the worker held all twenty."""

from __future__ import annotations

import time
import uuid

import pika
import pytest

from tests.support.jobs_env import AMQP_URL, reachable
from tests.support.rabbitmq import PIKA_URL
from worker.config import Settings
from worker.consumer.broker import BrokerLink
from worker.consumer.interactive_inbox import Delta, Done
from worker.consumer.interactive_queue import RemoteRequests, message_body
from worker.engine.request import Request, RequestOutput, SamplingParams
from worker.messaging.topology import Topology
from worker.metrics import WorkerMetrics

MODEL = "hold-test"


class Inbox:
    """What ``RemoteRequests`` hands the engine: the sinks, for the test to call."""

    def __init__(self):
        self.sinks: dict[str, object] = {}

    def submit(self, request, sink):
        self.sinks[request.request_id] = sink

    def abort(self, request_id):
        self.sinks.pop(request_id, None)


def _door(url, body, request_id, tenant):
    return Request(request_id, [1, 2], SamplingParams(max_tokens=2), tenant=tenant)


def test_a_worker_holds_at_most_interactive_prefetch_requests_on_rabbitmq():
    if not reachable(5672):
        pytest.skip("RabbitMQ (5672) is not reachable on 127.0.0.1")
    settings = Settings(broker_url=AMQP_URL, queue_prefix=f"berth-test-{uuid.uuid4().hex[:10]}")
    assert settings.interactive_prefetch == 8  # the default a user gets
    broker = BrokerLink(settings, MODEL, WorkerMetrics(), "hold-test")
    inbox = Inbox()
    remote = RemoteRequests(inbox, broker, _door, broker.metrics, settings.http_max_body_bytes, "hold-test")
    queue = Topology(settings.queue_prefix).interactive_queue(MODEL).name
    conn = pika.BlockingConnection(pika.URLParameters(PIKA_URL))
    try:
        broker.connect(max_retries=3)
        channel = conn.channel()
        channel.basic_consume("amq.rabbitmq.reply-to", lambda *a: None, auto_ack=True)
        ids = [f"i-{i}" for i in range(20)]
        for rid in ids:
            body = message_body(rid, f"t{int(rid[2:]) % 6}", "/v1/completions", {"prompt": "hi"})
            channel.basic_publish("", queue, body, pika.BasicProperties(
                reply_to="amq.rabbitmq.reply-to", correlation_id=rid, content_type="application/json"))
        taken: list[str] = []
        held: list[int] = []

        def turn(seconds: float) -> None:
            """The loop's part for ``seconds``: deliveries in, each new request's first event out (its ack)."""
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                broker.receive(0, 0.05)
                remote.admit()
                for rid in [r for r in inbox.sinks if r not in taken]:
                    taken.append(rid)
                    inbox.sinks[rid]([Delta(0, "x", (5,))])
                held.append(len(remote.live))
                conn.process_data_events(time_limit=0)

        turn(3.0)
        waiting = channel.queue_declare(queue, passive=True).method.message_count
        print(f"held after 3 s: {len(remote.live)} (at most {max(held)}); ready in the queue: {waiting}")
        assert max(held) <= settings.interactive_prefetch and len(remote.live) == settings.interactive_prefetch
        assert waiting == len(ids) - settings.interactive_prefetch
        while len(taken) < len(ids) or remote.live:  # the held ones end, three at a time: the others come
            for rid in list(remote.live)[:3]:
                inbox.sinks.pop(rid)([Done(RequestOutput(rid, [1, 2], []))])
            turn(0.5)
            assert max(held) <= settings.interactive_prefetch
            assert len(taken) <= len(ids) and len(held) < 10_000, "the requests did not all come"
        assert sorted(taken) == sorted(ids)  # each once
        assert channel.queue_declare(queue, passive=True).method.message_count == 0
    finally:
        remote.hand_back()
        broker.close()
        with pika.BlockingConnection(pika.URLParameters(PIKA_URL)) as admin:
            admin.channel().queue_delete(queue)
            admin.channel().exchange_delete(Topology(settings.queue_prefix).interactive_abort_exchange.name)
        conn.close()
