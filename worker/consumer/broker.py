"""The engine worker's link to the broker: deliveries in, acks, hand-backs and dead letters out.

Every broker call goes through one guard: a connection or channel error marks the link broken
instead of raising into the loop, and ``maintain`` reconnects with the worker's one backoff while
the engine keeps stepping (kombu's own retries would sleep in the loop). Deliveries are taken raw
(``on_message``), never decoded by kombu inside ``drain_events``: a body berth cannot read is the
admission's to refuse, not an exception that would end the worker on every redelivery. A body is
read by ``worker.messaging.message_body``, the function the queue door reads its messages with too.

A delivery is valid only on the channel it came on: after a reconnection the broker has requeued
it, and ``is_current`` says so (its redelivery is then adopted by the request still running here).

Acks: ``ack_all`` settles a step's deliveries together. On RabbitMQ a run of them goes in one frame,
``basic.ack`` with ``multiple`` set on the run's last delivery tag, which acks every delivery of the
channel up to it; so the link keeps the request channel's unsettled deliveries in tag order, and a
run is only ever a prefix of them whose every delivery is being acked. The others are acked one by
one. (The embedded transport ignores ``multiple``: there every ack is its own, and costs no I/O.)

Interactive requests (``worker.consumer.interactive_queue``): a worker with ``interactive_prefetch`` > 0
also consumes its model's interactive queue, on a channel of its own with that prefetch (the
request queues' window and its channel-wide cap do not count them), and the aborts' fanout through
an exclusive queue of its own on the same channel. Replies go to each request's direct reply-to
address on a connection apart (``reply``): a producer with broker access can name a forged
address, and RabbitMQ answers a publish to one by closing the whole connection (INTERNAL_ERROR),
which must not cost the request queues' deliveries. A reply connection that fails is opened again
once, for the same publish, then not before ``RECONNECT[0]`` seconds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import kombu
from kombu import Producer
from kombu.exceptions import OperationalError

from worker.config import Settings
from worker.messaging.backoff import RECONNECT, Backoff
from worker.messaging.message_body import UnreadableBody, keep_bodies_raw, raw_body, read_json
from worker.messaging.topology import REASON_HEADER, Topology, connect, is_embedded, queue_depth
from worker.metrics import WorkerMetrics

log = logging.getLogger("berth.worker")



@dataclass(eq=False)
class Delivery:
    """One message handed to this worker."""

    body: bytes | str  # a str when the client library decoded it by its content_encoding
    content_type: str | None
    content_encoding: str | None
    redelivered: bool
    tenant: str | None  # of the queue it came from, where known
    message: object = field(default=None, repr=False)  # the broker's handle, for acks
    reply_to: str | None = None  # an interactive request's: where its events go
    correlation_id: str | None = None

    def decode(self) -> object:
        """The body as JSON; ``UnreadableBody`` with the reason for anything else."""
        return read_json(self.body, self.content_type, self.content_encoding)


class BrokerLink:
    def __init__(self, settings: Settings, model: str, metrics: WorkerMetrics, name: str):
        self.settings = settings
        self.model = model
        self.metrics = metrics
        self.name = name
        self.topology = Topology(settings.queue_prefix)
        self.queues: dict[str, kombu.Queue] = {}  # tenant -> its request queue for this model
        self.connection: kombu.Connection | None = None
        self.consumer: kombu.Consumer | None = None
        self.broken = False
        self.window = 1
        self.backoff = Backoff(*RECONNECT)
        self._received: list[Delivery] = []
        self._unsettled: dict[int, Delivery] = {}  # the request channel's deliveries not acked or requeued, by tag
        self.multiple_acks = not is_embedded(settings)
        self._dead: kombu.Connection | None = None  # publishes dead letters, with confirms
        # the embedded transport has no direct reply-to: berth serve answers in its own process there
        self.interactive_prefetch = 0 if is_embedded(settings) else settings.interactive_prefetch
        self.interactive: kombu.Consumer | None = None  # the model's interactive queue (and the aborts)
        self.interactive_paused = False  # its consumer cancelled: the worker holds all it may (``interactive_room``)
        self._interactive_received: list[Delivery] = []
        self._aborts: list[str] = []
        self._replies: kombu.Connection | None = None  # publishes interactive requests' events
        self._reply_producer: Producer | None = None
        self._replies_failed_at: float | None = None

    # ---- the one guard
    def _errors(self) -> tuple:
        conn = self.connection
        extra = (OperationalError, OSError)
        return (conn.connection_errors + conn.channel_errors + extra) if conn is not None else extra

    @contextmanager
    def _guard(self) -> Iterator[None]:
        """Broker errors inside mark the link broken (what follows in the block is skipped)."""
        try:
            yield
        except self._errors() as exc:
            if not self.broken:
                self.broken = True
                self.metrics.broker_up.set(0)
                log.warning("worker %s: broker connection lost (%s); reconnecting, the engine keeps running",
                            self.name, exc)

    # ---- connecting
    def connect(self, max_retries: int | None = None) -> None:
        """Connect and consume the queues followed so far (waiting for the broker if ``max_retries`` is None)."""
        self.connection = connect(self.settings)
        self.connection.ensure_connection(max_retries=max_retries, interval_max=10)
        channel = self.connection.channel()
        keep_bodies_raw(channel)
        self.consumer = kombu.Consumer(channel, queues=list(self.queues.values()),
                                       on_message=self._on_message, accept=["json"], no_ack=False)
        self._qos(self.window)
        self.consumer.consume()
        self._received.clear()
        self._unsettled.clear()  # the old channel's: requeued by the broker
        self._interactive_received.clear()
        self._aborts.clear()
        self.interactive = self._consume_interactive() if self.interactive_prefetch else None
        self.interactive_paused = False
        self.broken = False
        self.metrics.broker_up.set(1)

    def start(self) -> None:
        """The first connection, without waiting: a broker that does not answer is said once, in a line
        with its address, and marked broken, so that ``maintain`` tries again with the backoff while the
        loop stays free to stop on SIGTERM."""
        try:
            self.connect(max_retries=0)
        except self._errors() as exc:
            self.broken = True
            self.metrics.broker_up.set(0)
            self.backoff.failed()
            address = self.connection.as_uri() if self.connection is not None else self.settings.broker_url
            log.warning("worker %s: the broker at %s does not answer (%s); trying again every %.0f-%.0f s until it "
                        "does (check that RabbitMQ runs there, or BERTH_BROKER_URL)", self.name, address, exc,
                        *RECONNECT)

    def maintain(self) -> bool:
        """While broken, one try to reconnect when due; True once connected."""
        if not self.broken:
            return True
        if not self.backoff.ready():
            return False
        self.backoff.failed()
        self._release(self.connection)
        try:
            self.connect(max_retries=0)
        except self._errors() as exc:
            log.info("worker %s: the broker still does not answer after %.0f s (%s)", self.name,
                     time.monotonic() - self.backoff.down_since, exc)
            return False
        self.backoff.succeeded()
        self.metrics.broker_reconnects.inc()
        log.warning("worker %s: reconnected to the broker", self.name)
        return True

    # ---- deliveries in
    def follow(self, tenants: Iterable[str]) -> None:
        """Consume exactly the queues of ``tenants`` (those with live jobs): new ones added, gone ones left
        once empty (a message left there would hold the queue's depth up, and an autoscaler with it)."""
        tenants = set(tenants)
        new = {t: self.topology.request_queue(self.model, t) for t in tenants - self.queues.keys()}
        gone = [t for t in self.queues if t not in tenants]
        if self.broken or not (new or gone):
            return
        with self._guard():
            for tenant in gone:
                if queue_depth(self.connection, [self.queues[tenant]]):
                    continue  # copies of its ended jobs' requests (redelivered after an outage): taken and acked first
                self.consumer.cancel_by_queue(self.queues.pop(tenant).name)
            for queue in new.values():
                self.consumer.add_queue(queue)
            if new:
                self.consumer.consume()  # starts consuming the queues added
            self.queues.update(new)

    def receive(self, limit: int, timeout: float) -> list[Delivery]:
        """Up to ``limit`` deliveries, waiting up to ``timeout`` seconds for the first."""
        with self._guard():  # interactive requests and aborts come whatever the limit (their own prefetch)
            while (len(self._received) < limit or self.interactive is not None) and not self.broken:
                try:
                    self.connection.drain_events(timeout=timeout)
                except TimeoutError:
                    break
                timeout = 0
        out, self._received = self._received, []
        return out

    def _on_message(self, message) -> None:
        info = message.delivery_info or {}
        delivery = Delivery(message.body, message.content_type, message.content_encoding,
                            bool(info.get("redelivered")), self._tenant_of(info), message)
        self._received.append(delivery)
        self._unsettled[message.delivery_tag] = delivery

    # ---- interactive requests in
    def _consume_interactive(self) -> kombu.Consumer:
        channel = self.connection.channel()
        keep_bodies_raw(channel)
        consumer = kombu.Consumer(channel, queues=[self.topology.interactive_queue(self.model)],
                                  on_message=self._on_interactive, accept=["json"], no_ack=False)
        consumer.qos(prefetch_count=self.interactive_prefetch)
        consumer.consume()
        aborts = kombu.Consumer(channel, queues=[self.topology.interactive_abort_queue()],
                                on_message=self._on_abort, accept=["json"], no_ack=True)
        aborts.consume()
        return consumer

    def _on_interactive(self, message) -> None:
        info, props = message.delivery_info or {}, message.properties or {}
        self._interactive_received.append(Delivery(
            message.body, message.content_type, message.content_encoding, bool(info.get("redelivered")), None,
            message, _text(props.get("reply_to")), _text(props.get("correlation_id"))))

    def _on_abort(self, message) -> None:
        try:
            payload = read_json(message.body, message.content_type, message.content_encoding, max_bytes=1024)
        except UnreadableBody:
            return
        request_id = payload.get("request_id") if isinstance(payload, dict) else None
        if isinstance(request_id, str) and len(request_id) <= 200:
            self._aborts.append(request_id)

    def interactive_room(self, room: int) -> None:
        """Take at most ``room`` more interactive requests: at 0 the interactive queue's consumer is
        cancelled (the aborts' goes on), and a cancelled one starts again with a prefetch of ``room``
        once there is room (RabbitMQ applies a consumer's prefetch when it starts). Its prefetch alone
        cannot bound what a worker holds: a request's message is acked at its first event (so that one
        whose worker dies before any token goes to another), which frees its place in the prefetch
        while the request still runs here. Deliveries that were on their way when it paused are the
        caller's to requeue."""
        if self.broken or self.interactive is None:
            return
        if room <= 0 and not self.interactive_paused:
            with self._guard():
                self.interactive.cancel()
                self.interactive_paused = True
        elif room > 0 and self.interactive_paused:
            with self._guard():
                self.interactive.qos(prefetch_count=min(room, self.interactive_prefetch))
                self.interactive.consume()
                self.interactive_paused = False

    def take_interactive(self) -> tuple[list[Delivery], list[str]]:
        """The interactive deliveries and aborts received since the last call (by ``receive``)."""
        out, aborts = self._interactive_received, self._aborts
        self._interactive_received, self._aborts = [], []
        return out, aborts

    def reply(self, reply_to: str, correlation_id: str | None, body: bytes) -> bool:
        """Publish an interactive request's events to its direct reply-to address: transient, without a
        confirm (the server counts the replies of each request, so a lost one ends its stream with an
        error, never with text missing). False when the broker did not take it."""
        if self._replies is None and self._replies_failed_at is not None \
                and time.monotonic() - self._replies_failed_at < RECONNECT[0]:
            return False
        for attempt in (0, 1):
            try:
                if self._replies is None:
                    self._replies = connect(self.settings)
                    self._replies.ensure_connection(max_retries=0)  # never kombu's retries, which sleep
                    self._reply_producer = Producer(self._replies.channel())
                else:  # a close the broker sent (a forged address before): seen now, not after this publish
                    self._poll_replies()
                self._reply_producer.publish(
                    body, exchange="", routing_key=reply_to, correlation_id=correlation_id, delivery_mode=1,
                    content_type="application/json", content_encoding="utf-8", retry=False)
                self._replies_failed_at = None
                return True
            except Exception as exc:  # noqa: BLE001 (a closed or unreachable connection: once more on a new one)
                log.info("worker %s: the reply connection failed (%s: %s)%s", self.name, type(exc).__name__, exc,
                         "; opening it again" if not attempt else "")
                self._release(self._replies)
                self._replies = None
                self._replies_failed_at = time.monotonic()
        return False

    def _poll_replies(self) -> None:
        try:
            self._replies.drain_events(timeout=0)
        except TimeoutError:
            pass

    def _tenant_of(self, info: dict) -> str | None:
        key = str(info.get("routing_key") or "")
        for tenant, queue in self.queues.items():
            if key in (queue.routing_key, queue.name):
                return tenant
        return None

    # ---- acks
    def is_current(self, delivery: Delivery | None) -> bool:
        """Whether ``delivery`` can still be acked: not acked yet, and on the channel of now."""
        m = delivery.message if delivery is not None else None
        return (m is not None and not self.broken and self.consumer is not None and not m.acknowledged
                and (m.channel is self.consumer.channel
                     or (self.interactive is not None and m.channel is self.interactive.channel)))

    def ack(self, delivery: Delivery | None) -> None:
        if self.is_current(delivery):
            self._settled(delivery)
            with self._guard():
                delivery.message.ack()

    def ack_all(self, deliveries: list[Delivery | None]) -> None:
        """Ack each of ``deliveries`` still current: the longest run of the request channel's oldest
        unsettled deliveries that are all among them with one multiple ack, the rest one by one."""
        current = {id(d): d for d in deliveries if self.is_current(d)}
        if not current:
            return
        run: list[Delivery] = []
        if self.multiple_acks:
            for d in self._unsettled.values():  # in tag order: the order they were delivered on the channel
                if id(d) not in current:
                    break
                run.append(d)
        if len(run) > 1:
            for d in run:
                self._settled(d)
                del current[id(d)]
            with self._guard():
                run[-1].message.ack(multiple=True)
                for d in run[:-1]:  # acked by the frame above, which kombu's Message of an earlier tag does
                    d.message._state = "ACK"  # not know of: so that nothing acks or rejects it again
        for d in current.values():
            self.ack(d)

    def _settled(self, delivery: Delivery) -> None:
        """No longer the worker's to settle: acked or requeued (another ack or reject of its tag,
        RabbitMQ answers by closing the channel)."""
        tag = getattr(delivery.message, "delivery_tag", None)
        if self._unsettled.get(tag) is delivery:
            del self._unsettled[tag]

    def requeue(self, delivery: Delivery | None) -> None:
        if self.is_current(delivery):
            self._settled(delivery)
            with self._guard():
                delivery.message.reject(requeue=True)

    def dead_letter(self, delivery: Delivery, reason: str, strikes: int = 0) -> bool:
        """Publish the delivery's body, as it came, to ``<prefix>.dead`` with the reason, confirmed;
        then ack it. False (and nothing acked) when the broker did not take it: it comes back later."""
        try:
            if self._dead is None:
                self._dead = connect(self.settings, confirm=True)
            Producer(self._dead.default_channel).publish(
                raw_body(delivery.body, delivery.content_encoding), exchange=self.topology.dead_exchange,
                routing_key=self.topology.dead_queue.routing_key,
                declare=[self.topology.dead_queue], delivery_mode=2,
                content_type=delivery.content_type or "application/data",
                content_encoding=delivery.content_encoding or "binary",
                headers={REASON_HEADER: reason[:1000], "x-berth-strikes": strikes})
        except Exception as exc:  # noqa: BLE001 (any failure to publish: keep the message, try again later)
            log.warning("worker %s: could not dead-letter a message (%s); it stays queued", self.name, exc)
            self._release(self._dead)
            self._dead = None
            return False
        log.warning("worker %s: dead-lettered a message: %s", self.name, reason)
        self.ack(delivery)
        return True

    # ---- the window, depth, liveness
    def set_window(self, window: int) -> None:
        with self._guard():
            self._qos(window)
            self.window = window

    def _qos(self, window: int) -> None:
        """``window`` unacked deliveries per tenant queue, and twice that for all of them together.

        RabbitMQ applies a per-consumer limit to the consumers started after it is set (a tenant
        queue followed later, a reconnection), and a channel-wide one at once: so a resize takes
        effect through the channel-wide cap, and many tenants cannot make a worker hoard the queue.
        (The embedded transport keeps one channel-wide limit: the last one set.)
        """
        self.consumer.qos(prefetch_count=window)
        self.consumer.qos(prefetch_count=2 * window, apply_global=True)

    def depth(self) -> int | None:
        """Messages ready in the followed queues (None while broken)."""
        if self.broken or not self.queues:
            return None if self.broken else 0
        with self._guard():
            return queue_depth(self.connection, self.queues.values())
        return None

    def heartbeat(self) -> None:
        if not self.broken:  # on a lost connection kombu would try to connect, sleeping 2s
            with self._guard():
                self.connection.heartbeat_check()
        if self._replies is not None:
            try:
                self._poll_replies()
                self._replies.heartbeat_check()
            except Exception:  # noqa: BLE001 (opened again for the next reply)
                self._release(self._replies)
                self._replies = None

    def cancel(self) -> None:
        """Stop taking deliveries (those in hand can still be acked)."""
        if not self.broken and self.consumer is not None:
            with self._guard():
                self.consumer.cancel()
                if self.interactive is not None:
                    self.interactive.cancel()
                    self.interactive_paused = True  # for good: ``interactive_room`` starts it no more

    def close(self) -> None:
        self._release(self.connection)
        self._release(self._dead)
        self._release(self._replies)

    @staticmethod
    def _release(connection) -> None:
        if connection is not None:
            try:
                connection.release()
            except Exception:  # noqa: BLE001 (a broken connection may fail to close)
                pass


def _text(value) -> str | None:
    """An AMQP property as text (a producer may send bytes, or nothing)."""
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    return value if isinstance(value, str) else None
