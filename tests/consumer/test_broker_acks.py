"""On RabbitMQ a step's acks go as one ``multiple`` ack for the oldest run of deliveries that are all
done, and one by one for the rest: a delivery not done is never covered (the broker gives it back
when the connection closes), and one covered is never acked again (which would close the channel)."""

from __future__ import annotations

import time

from kombu import Connection, Consumer, Producer

from tests.support.jobs_env import AMQP_URL, TINY_NAME
from worker.config import Settings
from worker.consumer.broker import BrokerLink
from worker.messaging.topology import Topology
from worker.metrics import WorkerMetrics


def _receive(link: BrokerLink, count: int) -> list:
    got, deadline = [], time.monotonic() + 10
    while len(got) < count and time.monotonic() < deadline:
        got += link.receive(count - len(got), 0.5)
    return got


def test_a_multiple_ack_covers_only_deliveries_that_are_done(queue_prefix):
    settings = Settings(broker_url=AMQP_URL, queue_prefix=queue_prefix)
    queue = Topology(queue_prefix).request_queue(TINY_NAME, "default")
    with Connection(AMQP_URL) as conn:
        producer = Producer(conn.default_channel)
        for i in range(6):
            producer.publish({"n": i}, exchange=queue.exchange, routing_key=queue.routing_key, declare=[queue])

    link = BrokerLink(settings, TINY_NAME, WorkerMetrics(), "test")
    link.window = 10
    link.connect(max_retries=1)
    link.follow({"default"})
    deliveries = _receive(link, 6)
    assert [d.decode()["n"] for d in deliveries] == list(range(6))
    frames = []
    channel = link.consumer.channel
    basic_ack = channel.basic_ack
    channel.basic_ack = lambda tag, multiple=False: (frames.append((tag, multiple)), basic_ack(tag, multiple=multiple))
    tags = [d.message.delivery_tag for d in deliveries]

    link.ack_all([deliveries[i] for i in (4, 0, 2, 1)])  # 3 and 5 are still running
    assert frames == [(tags[2], True), (tags[4], False)]
    link.ack(deliveries[1])  # covered by the multiple ack: nothing is sent again
    link.ack_all([deliveries[0], deliveries[4]])
    assert len(frames) == 2 and not link.broken
    link.ack_all([deliveries[3]])  # the oldest now, alone: one by one
    assert frames[2:] == [(tags[3], False)]
    link.close()  # what was not acked goes back to the queue

    left = []
    with Connection(AMQP_URL) as conn:
        consumer = Consumer(conn.channel(), [queue], accept=["json"], callbacks=[lambda body, m: left.append(body)])
        with consumer:
            try:
                while True:
                    conn.drain_events(timeout=1)
            except TimeoutError:
                pass
    assert left == [{"n": 5}]


def test_a_tenant_whose_jobs_ended_is_left_only_once_its_queue_is_empty(queue_prefix):
    """Copies of finished requests (redelivered after an outage) left in a tenant's queue would hold its
    depth, and an autoscaler, up for good: the worker takes them (and acks them) before leaving it."""
    settings = Settings(broker_url=AMQP_URL, queue_prefix=queue_prefix)
    queue = Topology(queue_prefix).request_queue(TINY_NAME, "alice")
    link = BrokerLink(settings, TINY_NAME, WorkerMetrics(), "test")
    link.window = 1
    link.connect(max_retries=1)
    link.follow({"alice"})
    with Connection(AMQP_URL) as conn:
        producer = Producer(conn.default_channel)
        for i in range(3):
            producer.publish({"n": i}, exchange=queue.exchange, routing_key=queue.routing_key, declare=[queue])
    [first] = _receive(link, 1)  # the window holds one: two wait in the queue
    link.follow(set())  # alice has no live job now
    assert "alice" in link.queues
    link.ack(first)
    for _ in range(2):
        [copy] = _receive(link, 1)
        link.ack(copy)
    deadline = time.monotonic() + 10
    while "alice" in link.queues and time.monotonic() < deadline:
        link.follow(set())
        time.sleep(0.1)
    assert "alice" not in link.queues and link.depth() == 0
    link.close()
