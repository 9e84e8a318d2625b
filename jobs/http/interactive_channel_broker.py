"""``BrokerChannel``: the RabbitMQ ``InteractiveChannel``. A request is published as JSON to the
model's interactive queue (transient, expiring), answers come back by direct reply-to with sequence
numbers, aborts go on the fanout ``<prefix>.interactive.abort``. A worker silent for
``interactive_deadline`` ends the stream with ``Failed``; text is never given twice. ``ready`` is
false while no worker consumes the queue (the routes then answer 503) (docs/http-api.md).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import kombu
from kombu import Producer

from jobs.http.interactive_channel import Subscription
from jobs.lines.line_error import BatchLine
from jobs.lines.validate import ModelInfo
from worker.config import Settings
from worker.consumer.interactive_inbox import Done, Event, Failed
from worker.consumer.interactive_queue import message_body, read_reply
from worker.engine.request import Request
from worker.messaging.backoff import RECONNECT, Backoff
from worker.messaging.message_body import keep_bodies_raw, raw_body
from worker.messaging.topology import Topology, connect

log = logging.getLogger("berth.http")

DIRECT_REPLY_TO = "amq.rabbitmq.reply-to"
POLL = 0.02  # seconds the thread waits for replies before it publishes what was asked meanwhile
COUNT_INTERVAL = 2.0  # seconds between counts of the queue's consumers (``ready``)


@dataclass(eq=False)
class _Sub:
    loop: asyncio.AbstractEventLoop
    subscription: Subscription
    opened: float = field(default_factory=time.monotonic)
    last_heard: float = field(default_factory=time.monotonic)
    seq: int = 0  # the last reply with events taken
    started: bool = False  # some events were handed on


class BrokerChannel:
    """Requests to the engine workers through RabbitMQ; ``start`` the thread before serving, ``close`` after."""

    def __init__(self, settings: Settings):
        if not settings.broker_url:
            raise ValueError("the RabbitMQ interactive channel needs BERTH_BROKER_URL")
        self.settings = settings
        self.topology = Topology(settings.queue_prefix)
        self.queue = self.topology.interactive_queue(settings.served_model_name())
        self._lock = threading.Lock()
        self._subs: dict[str, _Sub] = {}
        self._outbox: deque[tuple[str, str, bytes]] = deque()  # (kind, request id, body): to publish
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._connected = False
        self.consumers = 0  # of the interactive queue, when last counted

    # ---- the seam (the event loop's thread)
    @property
    def connected(self) -> bool:
        return self._connected

    def ready(self) -> bool:
        return self._connected and self.consumers > 0

    def model(self) -> ModelInfo | None:
        return None  # the settings' model: this server runs no engine

    def open(self, request: Request, line: BatchLine) -> Subscription:
        subscription = Subscription(request.request_id, self._abort)
        body = message_body(request.request_id, request.tenant, line.url, line.body)
        with self._lock:
            self._subs[request.request_id] = _Sub(asyncio.get_running_loop(), subscription)
            self._outbox.append(("request", request.request_id, body))
        return subscription

    def _abort(self, request_id: str) -> None:
        with self._lock:
            if self._subs.pop(request_id, None) is not None:
                self._outbox.append(("abort", request_id, json.dumps({"request_id": request_id}).encode()))

    # ---- the thread
    def start(self) -> BrokerChannel:
        self._thread = threading.Thread(target=self._run, name="berth-interactive-broker", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        backoff = Backoff(*RECONNECT)
        while not self._stop.is_set():
            connection = connect(self.settings)
            try:
                connection.ensure_connection(max_retries=0)
                self._serve(connection, backoff)
            except Exception as exc:  # noqa: BLE001 (any broker failure: fail what is open, connect again)
                if backoff.failed():
                    log.warning("interactive requests: the broker connection failed (%s: %s); connecting again",
                                type(exc).__name__, exc)
            finally:
                self._connected = False
                self._end_all("this server lost its connection to the broker: try again")
                try:
                    connection.release()
                except Exception:  # noqa: BLE001 (a broken connection may fail to close)
                    pass
            while not (backoff.ready() or self._stop.is_set()):
                self._stop.wait(0.1)

    def _serve(self, connection: kombu.Connection, backoff: Backoff) -> None:
        channel = connection.channel()
        keep_bodies_raw(channel)
        self.topology.interactive_abort_exchange(channel).declare()
        queue = self.queue(channel)
        consumer = kombu.Consumer(channel, queues=[kombu.Queue(DIRECT_REPLY_TO, no_declare=True)],
                                  on_message=self._on_reply, no_ack=True, accept=["json"])
        consumer.consume()
        producer = Producer(channel)
        self.consumers = queue.queue_declare()[2]
        self._connected = True
        if backoff.down:
            log.warning("interactive requests: connected to the broker again")
        backoff.succeeded()
        next_count = time.monotonic() + COUNT_INTERVAL
        while not self._stop.is_set():
            try:
                connection.drain_events(timeout=POLL)
            except TimeoutError:
                pass
            self._publish(producer)
            self._check_deadlines()
            if time.monotonic() >= next_count:
                next_count = time.monotonic() + COUNT_INTERVAL
                self.consumers = queue.queue_declare()[2]
                connection.heartbeat_check()

    def _publish(self, producer: Producer) -> None:
        while True:
            with self._lock:
                if not self._outbox:
                    return
                kind, request_id, body = self._outbox.popleft()
            if kind == "request":
                producer.publish(body, exchange="", routing_key=self.queue.name, reply_to=DIRECT_REPLY_TO,
                                 correlation_id=request_id, expiration=self.settings.interactive_expiry,
                                 delivery_mode=1, content_type="application/json", content_encoding="utf-8",
                                 retry=False)
            else:
                producer.publish(body, exchange=self.topology.interactive_abort_exchange.name, routing_key="",
                                 delivery_mode=1, content_type="application/json", content_encoding="utf-8",
                                 retry=False)

    def _on_reply(self, message) -> None:
        request_id = (message.properties or {}).get("correlation_id")
        with self._lock:
            sub = self._subs.get(request_id) if isinstance(request_id, str) else None
        if sub is None:
            return  # its caller left, or it ended already
        sub.last_heard = time.monotonic()
        try:
            seq, events = read_reply(raw_body(message.body, message.content_encoding))
        except Exception as exc:  # noqa: BLE001 (whatever a reply holds: this request's failure alone)
            log.warning("interactive request %s: an unreadable reply (%s: %s)", request_id, type(exc).__name__, exc)
            seq, events = sub.seq + 1, [Failed("the engine worker's reply could not be read")]
        if not events or seq <= sub.seq:
            return  # a keepalive, or a reply published again after a failed try
        if seq > sub.seq + 1:
            events = [Failed("a reply of the engine worker was lost: the answer would miss text; try again")]
        sub.seq = seq
        self._hand_on(request_id, sub, events)

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        deadline, expiry = self.settings.interactive_deadline, self.settings.interactive_expiry
        with self._lock:
            subs = list(self._subs.items())
        for request_id, sub in subs:
            due = sub.last_heard + deadline
            if not sub.started:  # it may wait in the queue until its message expires
                due = max(due, sub.opened + expiry + deadline)
            if now <= due:
                continue
            if sub.started:
                reason = (f"the engine worker running this request went silent for {deadline:g}s (it may have died): "
                          "the answer is incomplete; try again")
            else:
                reason = f"no engine worker answered this request within {expiry:g}s: try again later"
            log.warning("interactive request %s: %s", request_id, reason)
            self._hand_on(request_id, sub, [Failed(reason, "server_unavailable")])
            with self._lock:  # a worker alive after all drops it
                self._outbox.append(("abort", request_id, json.dumps({"request_id": request_id}).encode()))

    def _end_all(self, reason: str) -> None:
        with self._lock:
            subs, self._subs = self._subs, {}
            self._outbox.clear()
        for request_id, sub in subs.items():
            self._hand_on(request_id, sub, [Failed(reason, "server_unavailable")])

    def _hand_on(self, request_id: str, sub: _Sub, events: list[Event]) -> None:
        final = any(isinstance(e, (Done, Failed)) for e in events)
        if final:
            with self._lock:
                self._subs.pop(request_id, None)
        sub.started = True
        try:
            sub.loop.call_soon_threadsafe(sub.subscription.put, events)
        except RuntimeError:  # its event loop has closed: nobody reads it
            self._abort(request_id)
