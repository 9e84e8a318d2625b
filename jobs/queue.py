"""The request queue: its topology, the broker connection and publishing with confirms.

Topology (names start with ``Settings.queue_prefix``):

- ``<prefix>.requests`` — a durable direct exchange; the routing key is ``<model>.<tenant>``.
- ``<prefix>.requests.<model>.<tenant>`` — one durable queue per model and tenant, every message
  persistent, published with confirms, its priority the job's priority. An engine worker consumes
  the queues of every tenant with live jobs for its model, each with its own prefetch window, so
  its engine always sees every tenant's waiting work and shares its seats between them (a queue
  per model alone would be first-come first-served: a tenant's 100,000-line job would hold the
  head of the queue and every other tenant would wait behind it, whatever its share).
- ``<prefix>.dead`` — the dead-letter exchange and queue: a request that was delivered
  ``max_delivery_attempts`` times without finishing, or a message berth cannot read, is published
  there (with an ``x-berth-reason`` header) and its delivery acked.

Why a classic queue with ``x-max-priority`` and not a quorum queue: jobs carry a priority and the
broker must hand higher-priority work out first, across jobs, before it reaches any engine. Quorum
queues had no priorities before RabbitMQ 4.0 (3.x is still what most installations run; this
machine has 3.10), and 4.x gives them only two levels; a classic queue has up to 255 and we use
10 (0-9; each level costs the broker memory and CPU). What a quorum queue would have given us
instead, and how we make up for it:

- the delivery count (``x-delivery-count``, ``x-delivery-limit``): the worker counts deliveries in
  the database (``requests.attempts``) and dead-letters past the limit itself — which also works on
  the embedded transport, where no broker counts anything;
- replication across nodes: the database holds every request, and the reconciler republishes any
  that lost its message, so a lost broker node loses queue contents, not work.

The dead-lettering is explicit (publish to ``<prefix>.dead``, then ack) rather than a queue's
``x-dead-letter-exchange``, so that it carries its reason and works the same on both transports.

An empty ``Settings.broker_url`` means the embedded queue: kombu's SQLAlchemy transport on a SQLite
file beside the jobs database, no server. It keeps messages across restarts but has no priorities
and holds a delivered message invisible until acked: if a worker dies, the reconciler's stale-
delivery rule (``jobs.reconcile``) brings its requests back.
"""

from __future__ import annotations

import socket
import sqlite3
import time
from contextlib import contextmanager
from dataclasses import dataclass
from json import dumps
from pathlib import Path
from typing import Iterable, Iterator

from kombu import Connection, Exchange, Producer, Queue
from kombu.transport import sqlalchemy as kombu_sqla
from sqlalchemy import insert
from sqlalchemy.engine import make_url

from jobs.messages import RequestMessage
from worker.config import ConfigError, Settings

MAX_PRIORITY = 9  # job priorities 0..9 become message priorities 0..9
DEAD_ROUTING_KEY = "dead"


def is_embedded(settings: Settings) -> bool:
    return not settings.broker_url


def broker_url(settings: Settings) -> str:
    """The broker: ``Settings.broker_url``, or the embedded SQLite queue beside a SQLite database."""
    if settings.broker_url:
        return settings.broker_url
    url = make_url(settings.database_url)
    if url.get_backend_name() != "sqlite" or not url.database or url.database == ":memory:":
        raise ConfigError("an empty broker_url means the embedded queue, which lives beside a SQLite database "
                          f"file; with database_url {url.render_as_string(hide_password=True)} set "
                          "BERTH_BROKER_URL=amqp://USER:PASSWORD@HOST:5672// (RabbitMQ)")
    db_file = Path(url.database).resolve()
    return f"sqla+sqlite:///{db_file.with_name(db_file.stem + '-queue.db')}"


def connect(settings: Settings) -> Connection:
    if is_embedded(settings):
        path = broker_url(settings).removeprefix("sqla+sqlite:///")
        # kombu hands transport options to create_engine: a creator that turns on WAL, so that a
        # publish (one committed insert) is not an fsync and readers never block the writer
        return Connection(f"sqlite:///{path}", transport=EmbeddedTransport,
                          transport_options={"creator": lambda: _sqlite_wal(path)})
    return Connection(settings.broker_url, heartbeat=30, connect_timeout=10)


def _sqlite_wal(path: str) -> sqlite3.Connection:
    conn = sqlite3.connect(path, timeout=60, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    return conn


class EmbeddedChannel(kombu_sqla.Channel):
    """kombu's SQLAlchemy channel, able to store a batch of publishes in one transaction.

    kombu commits each message on its own (a query for the queue's row, an ORM insert, a commit:
    about 2 ms), which made the embedded queue the bottleneck of a large submission. Inside
    ``one_transaction()`` messages are collected and written with one bulk insert and one commit
    at the end; outside it, a publish is kombu's own.
    """

    _pending: list[dict] | None = None
    _queue_ids: dict[str, int] | None = None

    def _put(self, queue, payload, **kwargs):
        if self._pending is None:
            return super()._put(queue, payload, **kwargs)
        if queue not in self._queue_ids:
            self._queue_ids[queue] = self._get_or_create(queue).id
        self._pending.append({"queue_id": self._queue_ids[queue], "payload": dumps(payload), "visible": True,
                              "version": 1})

    @contextmanager
    def one_transaction(self) -> Iterator[None]:
        """Publishes inside are committed together on leaving (and none of them on an error)."""
        self._pending, self._queue_ids = [], {}
        try:
            yield
            if self._pending:
                self.session.execute(insert(self.message_cls.__table__), self._pending)
            self.session.commit()
        except BaseException:
            self.session.rollback()
            raise
        finally:
            self._pending = self._queue_ids = None


class EmbeddedTransport(kombu_sqla.Transport):
    Channel = EmbeddedChannel


@dataclass(frozen=True)
class Topology:
    prefix: str

    @property
    def exchange(self) -> Exchange:
        return Exchange(f"{self.prefix}.requests", "direct", durable=True)

    def request_queue(self, model: str, tenant: str) -> Queue:
        key = f"{model}.{tenant}"
        return Queue(f"{self.prefix}.requests.{key}", self.exchange, routing_key=key, durable=True,
                     queue_arguments={"x-queue-type": "classic", "x-max-priority": MAX_PRIORITY + 1})

    @property
    def dead_exchange(self) -> Exchange:
        return Exchange(f"{self.prefix}.dead", "direct", durable=True)

    @property
    def dead_queue(self) -> Queue:
        return Queue(f"{self.prefix}.dead", self.dead_exchange, routing_key=DEAD_ROUTING_KEY, durable=True)

    @property
    def celery_queue(self) -> str:
        return f"{self.prefix}.tasks"


def queue_depth(connection: Connection, queues: Iterable[Queue]) -> int:
    """Messages ready in ``queues`` (not counting those delivered and not yet acked)."""
    channel = connection.default_channel
    return sum(q.bind(channel).queue_declare(passive=True).message_count for q in queues)


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

    def dead_letter(self, body: bytes | str, content_type: str | None, content_encoding: str | None, reason: str,
                    attempts: int) -> None:
        """Publish a delivery's body, as it came, to the dead-letter queue with the reason."""
        self._publish([(self.topology.dead_queue, {
            "body": body, "content_type": content_type or "application/data",
            "content_encoding": content_encoding or "binary",
            "headers": {"x-berth-reason": reason[:1000], "x-berth-attempts": attempts}})])

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
