"""The embedded queue delivers a run of messages a poll, within the prefetch, shared among the queues
consumed, each message once and in order: the highest priority first, as RabbitMQ's priority queues."""

from __future__ import annotations

from kombu import Consumer, Producer
from sqlalchemy import text

from worker.config import Settings
from worker.messaging.topology import EmbeddedChannel, Topology, connect


def _publish(settings: Settings, tenant: str, ids: range, priority: int | None = None) -> None:
    queue = Topology(settings.queue_prefix).request_queue("m", tenant)
    with connect(settings) as conn:
        producer = Producer(conn.default_channel)
        for i in ids:
            producer.publish({"request_id": i, "tenant": tenant}, exchange=queue.exchange,
                             routing_key=queue.routing_key, declare=[queue], priority=priority)


def _consumer(conn, tenants: list[str], prefetch: int, got: list) -> Consumer:
    topology = Topology(Settings().queue_prefix)
    consumer = Consumer(conn.channel(), [topology.request_queue("m", t) for t in tenants], accept=["json"],
                        callbacks=[lambda body, message: got.append((body, message))])
    consumer.qos(prefetch_count=prefetch)
    consumer.consume()
    return consumer


def _drain(conn, tenants: list[str], got: list) -> None:
    """Everything the tenants' queues deliver now into ``got``, until 0.3 s pass without a message."""
    _consumer(conn, tenants, 1000, got)
    try:
        while True:
            conn.drain_events(timeout=0.3)
    except TimeoutError:
        pass


def _settings(tmp_path) -> Settings:
    return Settings(database_url=f"sqlite:///{tmp_path}/berth.db")


def test_one_poll_takes_a_run_but_never_more_than_the_prefetch(tmp_path):
    settings = _settings(tmp_path)
    _publish(settings, "default", range(20))
    got: list = []
    with connect(settings) as conn:
        _consumer(conn, ["default"], 5, got)
        conn.drain_events(timeout=1)
        assert [b["request_id"] for b, _ in got] == [0, 1, 2, 3, 4]  # one poll, the whole window
        for _, message in got:
            message.ack()
        conn.drain_events(timeout=1)
        assert [b["request_id"] for b, _ in got] == list(range(10))


def test_the_window_is_shared_among_the_queues_consumed(tmp_path):
    settings = _settings(tmp_path)
    _publish(settings, "a", range(20))
    _publish(settings, "b", range(100, 120))
    got: list = []
    with connect(settings) as conn:
        _consumer(conn, ["a", "b"], 8, got)
        for _ in range(4):
            try:
                conn.drain_events(timeout=0.2)
            except TimeoutError:
                break
        tenants = [b["tenant"] for b, _ in got]
        assert len(tenants) == 8 and tenants.count("a") == tenants.count("b") == 4


def test_every_message_is_delivered_once_in_order(tmp_path):
    settings = _settings(tmp_path)
    total = 3 * EmbeddedChannel.GET_BATCH + 7
    _publish(settings, "default", range(total))
    got: list = []
    with connect(settings) as conn:
        _drain(conn, ["default"], got)
        for _, message in got:
            message.ack()
    assert [b["request_id"] for b, _ in got] == list(range(total))
    with connect(settings) as conn:  # nothing left to deliver again
        again: list = []
        _consumer(conn, ["default"], 1000, again)
        try:
            conn.drain_events(timeout=0.3)
        except TimeoutError:
            pass
        assert again == []


def test_higher_priority_messages_are_delivered_first_read_in_the_index_order(tmp_path):
    settings = _settings(tmp_path)
    _publish(settings, "default", range(10), priority=None)  # no priority: 0
    _publish(settings, "default", range(10, 20), priority=7)  # published later, more urgent
    _publish(settings, "default", range(20, 25), priority=2)
    got: list = []
    with connect(settings) as conn:
        _drain(conn, ["default"], got)
        plan = " ".join(str(r) for r in conn.default_channel.session.execute(text(
            "EXPLAIN QUERY PLAN SELECT id FROM kombu_message WHERE queue_id = 1 AND visible = 1 ORDER BY "
            "coalesce(json_extract(payload, '$.properties.priority'), 0) DESC, timestamp, id LIMIT 5")))
    assert [b["request_id"] for b, _ in got] == [*range(10, 20), *range(20, 25), *range(10)]
    assert EmbeddedChannel.PRIORITY_INDEX in plan and "TEMP B-TREE" not in plan, plan  # no sort of the queue


def test_a_message_priority_is_the_jobs_urgency_then_its_priority():
    from worker.messaging.topology import MAX_PRIORITY, message_priority

    hour, day, week = 3600.0, 24 * 3600.0, 7 * 24 * 3600.0
    assert message_priority(0, 15 * 60) == message_priority(0, hour) == 6
    assert message_priority(9, day) == 3 < message_priority(0, 6 * hour) == 4 < message_priority(0, hour)
    assert message_priority(9, week) == 1 < message_priority(0, day) == message_priority(0, None) == 2
    assert all(0 <= message_priority(p, w) <= MAX_PRIORITY for p in range(10) for w in (60, hour, day, week))


def test_a_busy_consumer_polls_again_soon_only_for_a_window_with_room_for_many(tmp_path, monkeypatch):
    """Each poll is a transaction on the engine loop's thread: a window with room for a few and a queue
    found empty wait ``GET_EVERY`` before the next; room for a sixteenth of the window or more is filled at once."""
    settings = _settings(tmp_path)
    _publish(settings, "default", range(100))
    got, polls = [], []
    get_many = EmbeddedChannel._get_many_from
    monkeypatch.setattr(EmbeddedChannel, "_get_many_from",
                        lambda self, queue, limit: polls.append(limit) or get_many(self, queue, limit))
    monkeypatch.setattr(EmbeddedChannel, "GET_EVERY", 3600.0)  # "soon" is the rest of the test

    def drain_now() -> None:
        try:
            conn.drain_events(timeout=0)
        except TimeoutError:
            pass

    with connect(settings) as conn:
        _consumer(conn, ["default"], 64, got)
        drain_now()
        assert (len(got), polls) == (64, [64])
        for _, message in got[:3]:  # room for 3, under 64 / 16
            message.ack()
        for _ in range(20):
            drain_now()
        assert (len(got), polls) == (64, [64])
        got[3][1].ack()  # room for 4: polled at once
        drain_now()
        assert (len(got), polls) == (68, [64, 4])
        for _, message in got[4:]:
            message.ack()
        drain_now()  # the 32 left
        drain_now()  # room for 32 more: polled at once, and found empty
        assert (len(got), polls[2:]) == (100, [64, 32])
        for _ in range(20):  # found empty: not polled again soon, whatever the room
            drain_now()
        assert len(polls) == 4
        monkeypatch.setattr(EmbeddedChannel, "GET_EVERY", 0.0)
        drain_now()
        assert len(polls) == 5  # polled again once its time came
