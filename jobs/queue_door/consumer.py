"""The queue's entry point for jobs: job-submit messages on ``<prefix>.jobs`` (published to
``<prefix>.submit``) become jobs, as ``berth submit`` makes them. The tenant comes from the broker-checked
``user_id``, idempotency from ``message_id``; each message is acked once what it made is committed, and
a message that cannot run becomes a failed job or a dead letter, never a stuck consumer.

    berth submit-consumer          # this consumer, the event relay and the webhook sender

The contract: docs/queue.md.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import signal
import threading
from collections import OrderedDict
from contextlib import ExitStack
from typing import BinaryIO

from kombu import Connection, Consumer
from sqlalchemy import exc as sql_errors
from sqlalchemy import select

from jobs.lines.validate import InputError
from jobs.pipeline.celery_tasks import INGEST, make_app
from jobs.pipeline.publish import Outgoing, Publisher
from jobs.pipeline.submit import DuplicateSubmit, JobRefused, JobSpec, create_failed_job, create_job_from, submitted_job
from jobs.queue_door.contract import SubmitMessage, SubmitRefused, read_submit, salvage
from jobs.queue_door.destinations import Allowed
from jobs.queue_door.events import EventRelay, outgoing, rejection_body
from jobs.queue_door.inputs import parse_input_stores
from jobs.queue_door.webhooks import WebhookSender
from jobs.records.db import open_database
from jobs.records.job_files import JobFiles
from jobs.records.models import Job, JobStatus
from jobs.records.storage_quota import QuotaExceeded
from jobs.records.tenants import tenant_of_broker_user
from storage import ObjectNotFound, StorageError, check_key
from worker.config import ConfigError, Settings
from worker.messaging.message_body import keep_bodies_raw, raw_body
from worker.messaging.topology import REASON_HEADER, Topology, connect, is_embedded

log = logging.getLogger("berth.submit")

MAX_MESSAGE_ID = 255  # the jobs.submit_message_id column, and AMQP's shortstr
DATABASE_DOWN = (sql_errors.OperationalError, sql_errors.InterfaceError)
RECONNECT_MAX = 10.0
SET_ASIDE_TRIES = 3  # deliveries of a message whose dead letter fails before it is dropped (acked, logged)


class SubmitConsumer:
    def __init__(self, settings: Settings, eager_ingest: bool | None = None):
        """``eager_ingest``: run each job's ingest in this process before acking its message
        (default: on the Celery workers, as for ``berth submit``)."""
        if is_embedded(settings):
            raise ConfigError("the submit consumer needs RabbitMQ (its user_id check names the tenant): set "
                              "BERTH_BROKER_URL=amqp://USER:PASSWORD@HOST:5672//")
        self.input_stores = parse_input_stores(settings.input_stores())  # a bad entry fails now, not on a message
        try:
            self.webhook_allow = Allowed.parse(settings.webhook_allow)  # and a bad BERTH_WEBHOOK_ALLOW
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        self.settings = settings
        self.db = open_database(settings.database_url)
        self.files = JobFiles(settings.storage_url)
        self.topology = Topology(settings.queue_prefix)
        self.tasks = make_app(settings, eager_ingest)
        self.model = settings.served_model_name()
        self.connection: Connection | None = None
        self._publisher: Publisher | None = None  # dead letters and their events, confirmed
        self._stop = threading.Event()
        self._db_failures = 0
        self._unsettled: OrderedDict[tuple, int] = OrderedDict()  # a message whose dead letter failed -> tries

    # ---- the loop
    def run(self, stop: threading.Event | None = None) -> None:
        """Consume until ``stop`` is set; a lost broker is reconnected to with backoff."""
        self._stop = stop or self._stop
        backoff = 0.0
        while not self._stop.is_set():
            try:
                if self.connection is None:
                    self._connect()
                    backoff = 0.0
                self.connection.heartbeat_check()
                self.connection.drain_events(timeout=1.0)
            except TimeoutError:
                continue
            except Exception as exc:  # noqa: BLE001 (connection and channel errors: reconnect)
                log.warning("submit consumer: broker connection lost (%s); reconnecting", exc)
                self._disconnect()
                backoff = min(max(backoff * 2, 0.5), RECONNECT_MAX)
                self._stop.wait(backoff)
        self._disconnect()

    def stop(self) -> None:
        self._stop.set()

    def _connect(self) -> None:
        self.connection = connect(self.settings)
        channel = self.connection.channel()
        keep_bodies_raw(channel)
        self.topology.dead_queue.bind(channel).declare()
        # the exchanges a tenant's user may use but not declare (docs/queue.md, the permissions)
        self.topology.events_exchange.bind(channel).declare()
        self.topology.submit_exchange.bind(channel).declare()
        # raw deliveries (on_message): kombu decodes nothing; the body is read as JSON here or refused
        jobs = self.topology.jobs_queue.bind(channel)
        consumer = Consumer(channel, queues=[jobs], on_message=self._on_message, accept=[])
        jobs.bind_to(self.topology.submit_exchange, routing_key=jobs.name)
        consumer.qos(prefetch_count=1)
        consumer.consume()
        log.info("submit consumer: consuming %s", self.topology.jobs_queue.name)

    def _disconnect(self) -> None:
        for closing in (self.connection, self._publisher):
            try:
                if closing is not None:
                    (closing.close if isinstance(closing, Publisher) else closing.release)()
            except Exception:  # noqa: BLE001 (closing a link that may be broken already: nothing left to do)
                pass
        self.connection = self._publisher = None

    def _on_message(self, message) -> None:
        body = raw_body(message.body, message.content_encoding)  # as published, whatever the client decoded
        try:
            self.handle(body, message.properties, message.content_type, message.content_encoding)
        except DATABASE_DOWN as exc:
            self._db_failures += 1
            if self._db_failures == 1:
                log.warning("submit consumer: the database does not answer (%s); messages wait", exc)
            message.requeue()
            self._stop.wait(min(0.5 * 2 ** self._db_failures, RECONNECT_MAX))
            return
        except Exception as exc:
            log.exception("submit consumer: could not handle a message; dead-lettering it")
            self._db_failures = 0
            if not self._set_aside(message, body, f"berth could not handle this message ({type(exc).__name__}: "
                                                  f"{str(exc)[:300]})"):
                return
        self._db_failures = 0
        message.ack()

    def _set_aside(self, message, body: bytes, reason: str) -> bool:
        """Dead-letter a message berth could not handle; True when it may be acked. When the dead
        letter fails as well, the message is put back (False) and tried again, at most
        ``SET_ASIDE_TRIES`` deliveries in all: then it is dropped with the reason in the log, so
        that it cannot hold the queue for everyone behind it."""
        properties = message.properties
        try:
            self._dead_letter(body, properties, message.content_type, reason, message.content_encoding)
            return True
        except Exception:
            key = (hashlib.sha256(body).hexdigest(), properties.get("message_id"), properties.get("user_id"))
            tries = self._unsettled.pop(key, 0) + 1
            if tries >= SET_ASIDE_TRIES:
                log.error("submit consumer: dropped message %r of %r (%d bytes) after %d tries to dead-letter it: %s",
                          key[1], key[2], len(body), tries, reason, exc_info=True)
                return True
            self._unsettled[key] = tries
            while len(self._unsettled) > 1000:
                self._unsettled.popitem(last=False)
            log.warning("submit consumer: could not dead-letter message %r of %r (try %d of %d); it is put back",
                        key[1], key[2], tries, SET_ASIDE_TRIES, exc_info=True)
            message.requeue()
            self._stop.wait(min(0.5 * 2 ** tries, RECONNECT_MAX))
            return False

    # ---- one message
    def handle(self, body: bytes | str, properties: dict, content_type: str | None = None,
               content_encoding: str | None = None) -> str | None:
        """Make the job a message asks for (or its failed job, or its dead letter); the job's id
        (None: dead-lettered). The caller acks the message afterwards."""
        body = raw_body(body, content_encoding)
        user, message_id = properties.get("user_id"), properties.get("message_id")
        if not user:
            return self._dead_letter(body, properties, content_type, "the message has no user_id: set the AMQP "
                                     "property user_id to the broker user you connect as (RabbitMQ checks it)",
                                     content_encoding)
        tenant = tenant_of_broker_user(self.db, user)
        if tenant is None:
            return self._dead_letter(body, properties, content_type,
                                     f"broker user {user[:100]!r} may not submit jobs: no tenant is mapped to it "
                                     f"(`berth broker-user {user[:100]} --tenant TENANT`)", content_encoding)
        if not message_id or len(message_id) > MAX_MESSAGE_ID:
            return self._dead_letter(body, properties, content_type,
                                     f"the message needs a message_id of 1 to {MAX_MESSAGE_ID} characters: it is the "
                                     "idempotency key (the same message published twice makes one job)",
                                     content_encoding, tenant)
        existing = submitted_job(self.db, tenant, message_id)
        if existing is not None:
            log.info("submit consumer: message %r of %s made job %s already", message_id, user, existing)
            self._resume(existing)
            return existing
        try:
            job_id = self._create(body, content_type, tenant, message_id, content_encoding)
        except DuplicateSubmit as dup:
            return dup.job_id
        except SubmitRefused as refused:
            return self._fail(body, tenant, message_id, str(refused))
        self._dispatch(job_id)
        log.info("submit consumer: message %r of %s made job %s", message_id, user, job_id)
        return job_id

    def _create(self, body: bytes, content_type: str | None, tenant: str, message_id: str,
                content_encoding: str | None = None) -> str:
        message = read_submit(body, content_type, self.settings.max_submit_bytes, self.webhook_allow,
                              content_encoding=content_encoding)
        if message.model != self.model:
            raise SubmitRefused(f"model {message.model[:200]!r} is not served here: this berth runs {self.model!r}")
        spec = JobSpec(tenant, message.priority, message.completion_window, message.metadata)
        try:
            with ExitStack() as stack:
                source, name = self._input(message, tenant)
                stack.callback(source.close)
                return create_job_from(self.db, self.files, source, name, message.model, spec, self.settings,
                                       message_id=message_id, webhook_url=message.webhook_url)
        except (InputError, JobRefused, QuotaExceeded, ObjectNotFound, StorageError) as exc:
            raise SubmitRefused(str(exc)) from None

    def _input(self, message: SubmitMessage, tenant: str) -> tuple[BinaryIO, str]:
        """The message's requests as a file to read, and the job's input name: inline, or an object
        in the tenant's own part of an input store (``jobs.queue_door.inputs``), never another's."""
        if message.requests is not None:
            lines = b"".join(json.dumps(r, ensure_ascii=False).encode() + b"\n" for r in message.requests)
            return io.BytesIO(lines), "inline requests"
        url = message.input_url
        for store in self.input_stores:
            key = store.key_of(url, tenant)
            if key is None:
                continue
            try:
                check_key(key)
            except ValueError as exc:
                raise SubmitRefused(f"input_url {url[:300]!r}: {exc}") from None
            try:
                return store.store.open(key), url
            except ObjectNotFound:
                raise SubmitRefused(f"input_url {url[:300]!r}: there is no such object") from None
            except StorageError as exc:
                raise SubmitRefused(f"input_url {url[:300]!r} could not be read: {exc}") from None
        own = ", ".join(store.tenant_url(tenant) for store in self.input_stores) or "none: give the requests inline"
        raise SubmitRefused(f"input_url {url[:300]!r} is not in a store berth reads submit inputs from for tenant "
                            f"{tenant!r} (its inputs go under {own}; BERTH_SUBMIT_INPUT_STORES, set by its operator)")

    def _fail(self, body: bytes, tenant: str, message_id: str, reason: str) -> str:
        kept = salvage(body, self.settings.max_submit_bytes, self.webhook_allow)
        try:
            job_id = create_failed_job(self.db, tenant, reason, model=kept.get("model", ""),
                                       priority=kept.get("priority", 0),
                                       completion_window=kept.get("completion_window", "24h"),
                                       metadata=kept.get("metadata"), message_id=message_id,
                                       webhook_url=kept.get("webhook_url"))
        except DuplicateSubmit as dup:
            return dup.job_id
        log.info("submit consumer: message %r of tenant %s refused, job %s failed: %s", message_id, tenant, job_id,
                 reason)
        return job_id

    def _dispatch(self, job_id: str) -> None:
        try:
            self.tasks.tasks[INGEST].delay(job_id)
        except Exception:
            log.exception("submit consumer: could not dispatch the ingest of job %s; the reconciler will", job_id)

    def _resume(self, job_id: str) -> None:
        """A message seen again whose job never started its ingest (its consumer died before the
        dispatch): dispatch it now rather than after the reconciler's silence."""
        with self.db.session() as s:
            waiting = s.scalar(select(Job.id).where(Job.id == job_id, Job.status == JobStatus.VALIDATING,
                                                    Job.ingest_seen_at.is_(None)))
        if waiting is not None:
            self._dispatch(job_id)

    def _dead_letter(self, body: bytes, properties: dict, content_type: str | None, reason: str,
                     content_encoding: str | None = None, tenant: str | None = None) -> None:
        """The message, as it came, to ``<prefix>.dead`` with the reason, and a ``submit.rejected``
        event (the tenant's, when the broker user has one), both confirmed (a failure raises)."""
        user, message_id = properties.get("user_id"), properties.get("message_id")
        dead = self.topology.dead_queue
        options = {"headers": {REASON_HEADER: reason[:1000], "x-berth-broker-user": user or ""},
                   "content_type": content_type or "application/octet-stream",
                   "content_encoding": content_encoding or "binary"}
        if message_id:
            options["message_id"] = message_id
        event = rejection_body(message_id, user, reason, dead.name)
        if self._publisher is None:
            self._publisher = Publisher(self.settings)
        self._publisher.send([Outgoing(self.topology.dead_exchange, dead.routing_key, raw_body(body, content_encoding),
                                       (dead,), options),
                              outgoing(self.topology, event, tenant)])
        log.warning("submit consumer: dead-lettered message %r of %r: %s", message_id, user, reason)
        return None


class QueueDoor:
    """What ``berth submit-consumer`` runs, each on a thread of its own: the submit consumer, the
    event relay and the webhook sender. ``submit=False`` runs only the last two (``berth events``,
    for a deployment whose jobs come by ``berth submit`` or HTTP)."""

    def __init__(self, settings: Settings, *, submit: bool = True, events: bool = True,
                 eager_ingest: bool | None = None):
        self.stop_event = threading.Event()
        self.parts: list[tuple[str, object]] = []
        if submit:
            self.parts.append(("submit-consumer", SubmitConsumer(settings, eager_ingest)))
        if events:
            self.parts += [("event-relay", EventRelay(settings)), ("webhooks", WebhookSender(settings))]
        self.threads: list[threading.Thread] = []

    def start(self) -> QueueDoor:
        for name, part in self.parts:
            thread = threading.Thread(target=part.run, args=(self.stop_event,), name=f"berth-{name}", daemon=True)
            thread.start()
            self.threads.append(thread)
        return self

    def stop(self, timeout: float = 15.0) -> None:
        self.stop_event.set()
        for thread in self.threads:
            thread.join(timeout)

    def serve(self) -> None:
        """Run until SIGTERM or SIGINT."""
        previous = {sig: signal.signal(sig, lambda *_: self.stop_event.set())
                    for sig in (signal.SIGTERM, signal.SIGINT)}
        self.start()
        try:
            while not self.stop_event.wait(1.0):
                if not all(t.is_alive() for t in self.threads):
                    raise RuntimeError("a part of the queue door stopped; see the log")
        finally:
            self.stop()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
