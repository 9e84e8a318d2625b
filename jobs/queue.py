"""Publishing request messages with confirms (the topology, the connection and the message
contract are ``worker.queues``, shared with the engine workers that consume them)."""

from __future__ import annotations

import socket
import time
from typing import Iterable

from kombu import Producer, Queue

from jobs.messages import RequestMessage
from worker.config import Settings
from worker.queues import MAX_PRIORITY, Topology, connect, is_embedded


class PublishError(RuntimeError):
    """The broker refused (nacked) or never confirmed messages; they are still in the database."""


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
        self._declared: set[str] = set()

    def publish(self, messages: Iterable[RequestMessage]) -> int:
        batch = [(self.topology.request_queue(m.model, m.tenant),
                  {"body": m.to_body(), "serializer": "json", "priority": min(max(m.priority, 0), MAX_PRIORITY)})
                 for m in messages]
        return self._publish(batch)

    def _publish(self, batch: list[tuple[Queue, dict]]) -> int:
        for attempt in range(3):
            try:
                self._send(batch)
                return len(batch)
            except self.connection.recoverable_connection_errors:
                if attempt == 2:
                    raise
                self._channel = None  # a new connection and channel; the whole batch again
                self.connection.ensure_connection(max_retries=5)

    def _send(self, batch: list[tuple[Queue, dict]]) -> None:
        channel = self._confirm_channel()
        if self.confirms:
            self._send_on(channel, batch)
            self._await_confirms()
        else:  # the embedded queue: the batch is one transaction, committed (confirmed) on leaving
            with channel.one_transaction():
                self._send_on(channel, batch)

    def _send_on(self, channel, batch: list[tuple[Queue, dict]]) -> None:
        producer = Producer(channel)
        for queue, message in batch:
            declare = [] if queue.name in self._declared else [queue, self.topology.dead_queue]
            producer.publish(exchange=queue.exchange, routing_key=queue.routing_key, delivery_mode=2,
                             declare=declare, **message)
            self._declared.add(queue.name)
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
            except socket.timeout:
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
