"""Publishing with confirms: request messages (the topology, the connection and the message
contract are ``worker.messaging.topology``, shared with the engine workers that consume them), and any other
persistent message berth publishes (job events, dead letters) as an ``Outgoing``."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from kombu import Exchange, Producer, Queue

from jobs.pipeline.request_messages import RequestMessage
from worker.config import Settings
from worker.messaging.topology import MAX_PRIORITY, Topology, connect, is_embedded


class PublishError(RuntimeError):
    """The broker refused (nacked) or never confirmed messages; they are still in the database."""


@dataclass(frozen=True)
class Outgoing:
    """One persistent message: where it goes, what to declare first (once per channel), its body
    and the rest of ``kombu.Producer.publish``'s arguments (headers, message_id, serializer...)."""

    exchange: Exchange
    routing_key: str
    body: object
    declare: tuple[Exchange | Queue, ...] = ()
    options: dict = field(default_factory=dict)


class Publisher:
    """Publishes persistent messages; ``publish`` returns once the broker confirmed every one.

    On RabbitMQ the channel is in confirm mode and a batch is published without waiting, then the
    broker's acks are awaited together (one confirm round trip per message would cap publishing
    at a few hundred messages a second). On the embedded transport a publish is a committed insert.
    """

    CONFIRM_TIMEOUT = 60.0

    def __init__(self, settings: Settings):
        self.topology = Topology(settings.queue_prefix)
        self.connection = connect(settings)
        self.confirms = not is_embedded(settings)
        self._channel = None
        self._unconfirmed: set[int] = set()
        self._nacked = 0
        self._next_tag = 1
        self._declared: set[tuple[str, str]] = set()

    def publish(self, messages: Iterable[RequestMessage]) -> int:
        batch, queues, dead = [], {}, self.topology.dead_queue  # kombu's Queue objects, made once a batch
        for m in messages:
            queue = queues.get((m.model, m.tenant))
            if queue is None:
                queue = queues[m.model, m.tenant] = self.topology.request_queue(m.model, m.tenant)
            batch.append(Outgoing(queue.exchange, queue.routing_key, m.to_body(), (queue, dead),
                                  {"serializer": "json", "priority": min(max(m.priority, 0), MAX_PRIORITY)}))
        return self.send(batch)

    def send(self, batch: list[Outgoing]) -> int:
        """Publish ``batch``, persistent; returns once the broker confirmed every message."""
        for attempt in range(3):
            try:
                self._send(batch)
                return len(batch)
            except self.connection.recoverable_connection_errors:
                if attempt == 2:
                    raise
                self._channel = None  # a new connection and channel; the whole batch again
                self.connection.ensure_connection(max_retries=5)

    def _send(self, batch: list[Outgoing]) -> None:
        channel = self._confirm_channel()
        if self.confirms:
            self._send_on(channel, batch)
            self._await_confirms()
        else:  # the embedded queue: the batch is one transaction, committed (confirmed) on leaving
            with channel.one_transaction():
                self._send_on(channel, batch)

    def _send_on(self, channel, batch: list[Outgoing]) -> None:
        producer = Producer(channel)
        for item in batch:
            declare = [d for d in item.declare if (type(d).__name__, d.name) not in self._declared]
            producer.publish(item.body, exchange=item.exchange, routing_key=item.routing_key, delivery_mode=2,
                             declare=declare, **item.options)
            self._declared.update((type(d).__name__, d.name) for d in declare)
            if self.confirms:
                self._unconfirmed.add(self._next_tag)
                self._next_tag += 1

    def _confirm_channel(self):
        if self._channel is None:
            self._channel = self.connection.channel()
            self._declared.clear()
            if self.confirms:
                self._channel.confirm_select()
                self._channel.events["basic_ack"].add(self._on_ack)
                self._channel.events["basic_nack"].add(self._on_nack)
                self._unconfirmed.clear()
                self._next_tag = 1
        return self._channel

    def _on_ack(self, tag: int, multiple: bool) -> None:
        done = {t for t in self._unconfirmed if t <= tag} if multiple else {tag}
        self._unconfirmed -= done

    def _on_nack(self, tag: int, multiple: bool) -> None:
        before = len(self._unconfirmed)
        self._on_ack(tag, multiple)
        self._nacked += before - len(self._unconfirmed)

    def _await_confirms(self) -> None:
        deadline = time.monotonic() + self.CONFIRM_TIMEOUT
        while self._unconfirmed:
            left = deadline - time.monotonic()
            if left <= 0:
                raise PublishError(f"the broker did not confirm {len(self._unconfirmed)} messages in "
                                   f"{self.CONFIRM_TIMEOUT:.0f}s; the reconciler will publish them again")
            try:
                self.connection.drain_events(timeout=min(left, 1.0))
            except TimeoutError:
                pass
        if self._nacked:
            nacked, self._nacked = self._nacked, 0
            raise PublishError(f"the broker refused {nacked} messages (nack: out of disk or memory?); "
                               "the reconciler will publish them again")

    def close(self) -> None:
        self.connection.release()

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
