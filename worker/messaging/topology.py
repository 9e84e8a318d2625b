"""The request queue as both sides see it: its topology (exchanges and queues named from
``Settings.queue_prefix``), the broker connection, the embedded transport and the request message
contract. Publishing with confirms is ``jobs.pipeline.publish``. Why classic queues with priorities
rather than quorum queues, and every queue and exchange: docs/queue.md, "Queues and exchanges".
"""

from __future__ import annotations

import math
import sqlite3
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from json import dumps, loads
from pathlib import Path
from queue import Empty

from kombu import Connection, Exchange, Queue
from kombu.transport import sqlalchemy as kombu_sqla
from kombu.utils.encoding import bytes_to_str
from sqlalchemy import func, insert, select, text, update
from sqlalchemy.engine import make_url

from worker.config import ConfigError, Settings

MAX_PRIORITY = 9  # message priorities 0..9 (the queues' x-max-priority is 10: a redeclare must not change it)
# A request message's priority: its job's urgency (the length of its completion window) first, then whether the
# job's priority is high (5-9) or low (0-4): (window at most, urgency), the longest windows last. docs/queue.md.
URGENCY = ((3600.0, 3), (6 * 3600.0, 2), (24 * 3600.0, 1))


def message_priority(priority: int, window: float | None) -> int:
    """The message priority of a request of a job of ``priority`` (0-9) and completion window ``window``
    seconds (None: a 24-hour one): 2 x urgency + (priority >= 5), 0..7 of 0..MAX_PRIORITY."""
    window = 24 * 3600.0 if window is None else window
    urgency = next((u for most, u in URGENCY if window <= most), 0)
    return min(2 * urgency + (priority >= 5), MAX_PRIORITY)
DEAD_ROUTING_KEY = "dead"
REASON_HEADER = "x-berth-reason"  # a dead letter's reason, on every message published to <prefix>.dead


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


def connect(settings: Settings, confirm: bool = False) -> Connection:
    """A connection to the broker; ``confirm``: each publish waits for RabbitMQ's confirm (the
    embedded queue's publish is a committed insert anyway)."""
    if is_embedded(settings):
        path = broker_url(settings).removeprefix("sqla+sqlite:///")
        # kombu hands transport options to create_engine: a creator that turns on WAL, so that a
        # publish (one committed insert) is not an fsync and readers never block the writer
        return Connection(f"sqlite:///{path}", transport=EmbeddedTransport,
                          transport_options={"creator": lambda: _sqlite_wal(path)})
    return Connection(settings.broker_url, heartbeat=30, connect_timeout=10,
                      transport_options={"confirm_publish": True} if confirm else {})


def _sqlite_wal(path: str) -> sqlite3.Connection:
    conn = sqlite3.connect(path, timeout=60, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    return conn


_PRIORITY_SQL = "coalesce(json_extract(payload, '$.properties.priority'), 0)"  # a message's priority in its row


def _priority(table):
    return func.coalesce(func.json_extract(table.c.payload, "$.properties.priority"), 0)


class EmbeddedChannel(kombu_sqla.Channel):
    """kombu's SQLAlchemy channel, able to store a batch of publishes in one transaction, and to take
    a run of deliveries in one.

    kombu commits each message on its own (a query for the queue's row, an ORM insert, a commit:
    about 2 ms), which made the embedded queue the bottleneck of a large submission. Inside
    ``one_transaction()`` messages are collected and written with one bulk insert and one commit
    at the end; outside it, a publish is kombu's own.

    kombu's ``_get`` likewise takes one message a transaction (a locked select, an update, a commit),
    which cost the engine worker about a millisecond a request. ``_get_and_deliver`` takes up to what
    the prefetch allows in one, shared among the queues consumed (one tenant's queue does not fill a
    worker's window before the next queue's turn), each delivered as kombu's own would be.

    A busy engine worker asks for deliveries before every step, and each poll is a transaction on the
    loop's thread (about a millisecond of its GIL: a quarter of the loop's time at an H200's pace). So a
    queue found empty, or a window with room for only a few (under ``1 / FEW_SHARE`` of it: the worker
    still holds a quarter of its seats' worth waiting), is polled again no sooner than ``GET_EVERY``
    seconds later; a window with more room is filled at once.
    """

    GET_BATCH = 64  # deliveries one poll takes from a queue at most
    GET_EVERY = 0.05  # seconds between polls of a queue found empty, or of a window with little room
    FEW_SHARE = 16  # "little room": under this share of the prefetch window
    PRIORITY_INDEX = "berth_message_priority"  # (queue, visible, priority, timestamp, id): the polls' order

    _indexed = False

    _pending: list[dict] | None = None
    _queue_ids: dict[str, int] | None = None
    _polls: dict[str, tuple[float, bool]] | None = None  # queue -> (monotonic time of its last poll, found any)

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


    def _get_and_deliver(self, queue, callback):
        room = self.qos.can_consume_max_estimate()  # None: no prefetch limit
        limit = self.GET_BATCH
        if room is not None:  # a queue's share of the window, and no more than is free of it
            limit = min(limit, room, max(1, self.qos.prefetch_count // max(1, len(self._active_queues))))
        if self._polls is None:
            self._polls = {}
        now = time.monotonic()
        polled, found = self._polls.get(queue, (-math.inf, True))
        few = room is not None and limit < self.qos.prefetch_count // self.FEW_SHARE
        if now - polled < self.GET_EVERY and (few or not found):
            raise Empty()
        self._polls[queue] = (now, False)
        payloads = self._get_many_from(queue, max(1, limit))
        self._polls[queue] = (now, True)
        for payload in payloads:
            callback(payload, queue)

    def _index_priorities(self, table) -> None:
        """The index the polls read in order (made once, by the first poll of any channel on the file)."""
        if not self._indexed:
            self.session.execute(text(
                f"CREATE INDEX IF NOT EXISTS {self.PRIORITY_INDEX} ON {table.name} (queue_id, visible, "
                f"{_PRIORITY_SQL} DESC, timestamp, id)"))
            self._indexed = True

    def _get_many_from(self, queue, limit: int) -> list:
        """Up to ``limit`` messages of ``queue``, the highest message priority first (as RabbitMQ's
        ``x-max-priority`` queues), then oldest first, made invisible in one transaction; ``Empty`` when
        there are none (as kombu's ``_get``)."""
        table = self.message_cls.__table__
        queue_id = self._get_or_create(queue).id
        session = self.session
        if session.bind.name == "sqlite":
            session.execute(text("BEGIN IMMEDIATE TRANSACTION"))
        try:
            self._index_priorities(table)
            rows = session.execute(
                select(table.c.id, table.c.payload).where(table.c.queue_id == queue_id, table.c.visible == True)  # noqa: E712
                .order_by(_priority(table).desc(), table.c.timestamp, table.c.id).limit(limit).with_for_update()).all()
            if rows:
                session.execute(update(table).where(table.c.id.in_([r.id for r in rows])).values(visible=False))
        finally:
            session.commit()
        if not rows:
            raise Empty()
        return [loads(bytes_to_str(r.payload)) for r in rows]


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

    def interactive_queue(self, model: str) -> Queue:
        """The model's interactive requests (see the module's docstring); its messages are transient."""
        return Queue(f"{self.prefix}.interactive.{model}", Exchange(""),
                     routing_key=f"{self.prefix}.interactive.{model}",
                     durable=True, queue_arguments={"x-queue-type": "classic"})

    @property
    def interactive_abort_exchange(self) -> Exchange:
        """Aborts of interactive requests whose callers left, to every mixed worker."""
        return Exchange(f"{self.prefix}.interactive.abort", "fanout", durable=True)

    def interactive_abort_queue(self) -> Queue:
        """One worker's binding to the aborts: server-named, exclusive, gone with its connection."""
        return Queue("", self.interactive_abort_exchange, exclusive=True, auto_delete=True, durable=False)

    @property
    def dead_exchange(self) -> Exchange:
        return Exchange(f"{self.prefix}.dead", "direct", durable=True)

    @property
    def dead_queue(self) -> Queue:
        return Queue(f"{self.prefix}.dead", self.dead_exchange, routing_key=DEAD_ROUTING_KEY, durable=True)

    @property
    def celery_queue(self) -> str:
        return f"{self.prefix}.tasks"

    @property
    def jobs_queue(self) -> Queue:
        """Where any producer submits jobs (docs/queue.md): a durable classic queue without arguments,
        published to through the default exchange, so that a producer declaring it with plain
        ``durable=True`` declares the same queue."""
        return Queue(f"{self.prefix}.jobs", Exchange(""), routing_key=f"{self.prefix}.jobs", durable=True)

    @property
    def submit_exchange(self) -> Exchange:
        """Where producers publish job-submit messages (docs/queue.md): a durable direct exchange bound
        to ``jobs_queue`` by its name. A tenant's broker user may write here and nowhere else: write
        permission on the default exchange would let it publish to every queue by name, berth's
        request queues and Celery's included."""
        return Exchange(f"{self.prefix}.submit", "direct", durable=True)

    @property
    def events_exchange(self) -> Exchange:
        """Job events, routing key ``<tenant>.job.<status>`` (and ``<tenant>.submit.rejected``; see
        ``jobs.queue_door.contract.event_routing_key``): a durable topic exchange."""
        return Exchange(f"{self.prefix}.events", "topic", durable=True)


def queue_depth(connection: Connection, queues: Iterable[Queue]) -> int:
    """Messages ready in ``queues`` (not counting those delivered and not yet acked)."""
    channel = connection.default_channel
    return sum(q.bind(channel).queue_declare(passive=True).message_count for q in queues)




# ---- the request message: it only points at its request row, which says what the request is
MESSAGE_VERSION = 1
MAX_JOB_ID = 40  # the jobs.id column


class BadMessage(ValueError):
    """A delivery on a request queue that is not a berth request message; the reason says why."""


@dataclass(frozen=True)
class RequestRef:
    request_id: int
    job_id: str


def request_body(request_id: int, job_id: str) -> dict:
    return {"v": MESSAGE_VERSION, "request_id": request_id, "job_id": job_id}


def parse_request_body(payload: object) -> RequestRef:
    """The request a decoded message body names. Any producer with broker access can publish, so
    everything is checked; what the request is comes from its database row, never from here."""
    if not isinstance(payload, dict):
        raise BadMessage(f"the body is a JSON {type(payload).__name__}, not an object with request_id and job_id")
    request_id, job_id = payload.get("request_id"), payload.get("job_id")
    if type(request_id) is not int or not 0 < request_id < 1 << 63:
        raise BadMessage(f"request_id must be a positive integer, not {str(request_id)[:40]!r}")
    if not isinstance(job_id, str) or not 0 < len(job_id) <= MAX_JOB_ID:
        raise BadMessage(f"job_id must be a string of 1 to {MAX_JOB_ID} characters, not {str(job_id)[:60]!r}")
    return RequestRef(request_id, job_id)
