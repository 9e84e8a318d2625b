"""The engine worker (``berth worker``): queue deliveries in, one engine running across jobs and
tenants, results out.

One loop, never blocked while the engine has work:

1. drain deliveries (without waiting while the engine has work, up to ``IDLE_WAIT`` when idle);
2. admit them: count the attempt in the database, ack and skip a request that already has its
   result or whose job is closed, dead-letter one delivered too often, add the rest to the engine
   with the job's tenant and priority;
3. one engine step; the requests it finished get their result rows and job counters in one
   transaction, and only after the commit are their messages acked;
4. about every second: abort the requests of cancelled or expired jobs, follow the tenants with
   live jobs (consume their queues, give the engine their weights), resize the prefetch window,
   refresh the metrics.

Tenants: each tenant has its own queue for the model (``jobs.queue``), consumed with its own
prefetch window, so the engine sees every tenant's waiting requests and its scheduler shares the
seats by the tenants' weights (``jobs.tenants``); priorities order the requests within a tenant's
queue on the broker and across all of them in the engine.

Prefetch: the window of unacked deliveries of each tenant queue is what the engine can hold
running (``max_num_seqs``, or fewer when the KV cache cannot fit that many of the requests seen so
far, counting each request's prompt plus ``n * max_tokens``) plus a quarter more waiting, so that
seats freed by a step are filled at the next one (never starved) while the rest of the queue stays
with the broker for other workers (never flooded); all tenant queues together are capped at twice
that. ``Settings.prefetch`` fixes it instead.

Idempotency: a result's ``request_id`` is unique and written with "on conflict do nothing"; a
delivery of a request that has a result is acked and skipped; a second delivery of a request this
worker is already running is acked (or, if the first delivery's channel is gone, adopted).

Poison: attempts are counted in the database (classic queues only flag ``redelivered``); a request
delivered more than ``max_delivery_attempts`` times without finishing is failed with the reason
(and its last error) and its message goes to the dead-letter queue. A worker told to stop hands
back unfinished requests without counting that delivery as an attempt.

RabbitMQ's ``consumer_timeout`` (30 minutes by default) closes the channel of a delivery unacked
that long and requeues every message it held. We ack only after the result is committed, so a
request running longer than that would be redelivered. We chose: (1) ``compose.yaml`` raises
``consumer_timeout`` to 24 hours, the longest completion window in normal use, since a request
that long is legitimate in a bulk service; (2) the worker survives the channel closing: it keeps
its requests running, reconnects, and on finishing writes the result without acking the void
delivery; the redelivered copy is adopted if it comes back here, or acked as done (or computed
twice at worst, one result kept) if it went elsewhere. Nothing is lost either way.

Outages: the loop never waits on a service that is down. Without the broker it tries to reconnect
once a second (``RECONNECT_INTERVAL``; kombu's own retries would sleep in the loop) and runs what
it holds. Without the database it backs off (``worker.database_health``): finished outcomes wait in
``_unrecorded``, their requests kept in ``inflight`` and their messages unacked (the ack still
follows the commit), deliveries wait unadmitted, closed jobs and tenants are not looked up; the
next try that gets through commits the waiting outcomes. Both show in the metrics.

SIGTERM (or Ctrl-C): stop consuming, hand back at once the requests not started, let the running
ones finish for up to ``Settings.drain_timeout`` seconds, checkpoint and hand back the rest (reject
with requeue), exit. A second signal stops at once, handing everything back.

Checkpoints (``Settings.checkpoint_interval`` > 0): after each step the ``Checkpointer`` snapshots
the running requests that are due and a thread writes them to ``Settings.storage_url``. A
redelivered request (the broker's flag, or a second attempt in the database) is first looked up
there by the ``Restorer`` in the background and added to the engine with its generated tokens (and
KV blocks, when reading them is faster than computing them). A request's checkpoint is deleted once
its outcome is committed, or when its job closes; a request handed back keeps it.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable

import kombu
from kombu.exceptions import OperationalError
from kombu.message import Message
from sqlalchemy import select

from jobs.batch_format import response_line
from jobs.db import open_database
from jobs.lifecycle import LIVE
from jobs.messages import RequestMessage
from jobs.models import Job, ResultStatus
from jobs.queue import Publisher, Topology, connect, queue_depth
from jobs.results import Outcome, note_error, record_deliveries, record_outcomes, release
from jobs.tenants import live_tenants
from jobs.tasks import finalize_later, make_app
from storage import open_store
from worker import database_health
from worker.checkpointer import Checkpointer
from worker.config import Settings
from worker.engine import Engine, RequestRejected
from worker.metrics import WorkerMetrics
from worker.request import Request, RequestOutput
from worker.resume import Restorer

log = logging.getLogger("berth.worker")

IDLE_WAIT = 0.5  # seconds to wait for deliveries when the engine has nothing to do
RESTORE_WAIT = 0.02  # ... when it has nothing to do but requests are being restored from checkpoints
CHECKPOINT_FLUSH = 10.0  # seconds a stopping worker waits for its last checkpoints to be written
CONTROL_INTERVAL = 1.0  # seconds between checks for closed jobs, window resizing, metrics
QUEUE_DEPTH_INTERVAL = 5.0
RECONNECT_INTERVAL = 1.0  # seconds between tries to reach a broker that went away


def prefetch_window(max_num_seqs: int, kv_capacity_tokens: int, mean_kv_tokens: float | None) -> int:
    """Deliveries to hold: the requests the engine can run at once, plus a quarter more waiting."""
    seats = max_num_seqs
    if mean_kv_tokens:
        seats = max(1, min(max_num_seqs, int(kv_capacity_tokens // mean_kv_tokens)))
    return seats + max(1, seats // 4)


@dataclass
class Inflight:
    message: RequestMessage
    request: Request  # as the engine runs it
    delivery: Message | None  # None once its channel is gone (the broker requeued the message)

    @property
    def started(self) -> bool:
        return any(s.num_computed_tokens for s in self.request.sequences)


class EngineWorker:
    def __init__(self, settings: Settings, engine: Engine | None = None, eager_tasks: bool | None = None):
        """``eager_tasks``: run the finalize tasks in this process (default: when the broker is embedded)."""
        self.settings = settings
        self.engine = engine or Engine(settings)
        self.db = open_database(settings.database_url)
        self.tasks = make_app(settings, eager_tasks)
        self.topology = Topology(settings.queue_prefix)
        self.queues: dict[str, kombu.Queue] = {}  # tenant -> its request queue for this engine's model
        self.name = f"{socket.gethostname()}:{os.getpid()}"
        self.metrics = WorkerMetrics()
        self.checkpoints: Checkpointer | None = None
        self.restorer: Restorer | None = None
        if settings.checkpoint_interval:
            store = open_store(settings.storage_url)
            self.checkpoints = Checkpointer(self.engine, store, settings, self.metrics)
            self.restorer = Restorer(self.engine, store, self.checkpoints, self.metrics)
        kv = self.engine.kv_usage()
        self.kv_capacity = kv["blocks_total"] * self.engine.settings.block_size
        self.inflight: dict[str, Inflight] = {}
        self.incoming: list[Message] = []
        self.mean_kv_tokens: float | None = None
        self.window = settings.prefetch or prefetch_window(self.engine.settings.max_num_seqs, self.kv_capacity, None)
        self.stop_requested = 0  # signals received
        self.connection: kombu.Connection | None = None
        self.consumer: kombu.Consumer | None = None
        self._publisher: Publisher | None = None
        self._broken = False  # the channel failed; reconnect before the next receive
        self._reconnect_at = 0.0  # monotonic time of the next try to reconnect
        self._unrecorded: list[tuple[Outcome, RequestMessage, Message | None, str | None]] = []  # database down
        self.database = database_health.DatabaseHealth(self.name, self.metrics)

    # ---- the loop
    def run(self, until: Callable[[], bool] | None = None) -> None:
        """Work until stopped by a signal, or until ``until()`` is true (checked about every second)."""
        if self.settings.metrics_port:
            self.metrics.serve(self.settings.metrics_port)
        previous_handlers = self._install_signal_handlers()
        self._connect()
        log.info("worker %s consuming %s.requests.%s.* (prefetch %d)", self.name, self.settings.queue_prefix,
                 self.engine.model_name, self.window)
        drain_deadline = None
        next_control = next_depth = 0.0
        graceful = False
        try:
            while True:
                if self._broken and not self.stop_requested:
                    self._reconnect()
                if self._broken and not self.engine.has_unfinished():
                    time.sleep(IDLE_WAIT)  # no broker and nothing to run: wait, then try again
                if not self.database.ready() and not self.engine.has_unfinished():
                    time.sleep(IDLE_WAIT)  # no database and nothing to run: the same
                wait = 0 if self.engine.has_unfinished() else RESTORE_WAIT if self._restoring() else IDLE_WAIT
                self._receive(wait)
                self._record_waiting()
                self._admit()
                self._add_restored()
                if self.engine.has_unfinished():
                    self._step()
                t = time.monotonic()
                if t >= next_control:
                    next_control = t + CONTROL_INTERVAL
                    self._control(t >= next_depth)
                    next_depth = next_depth if t < next_depth else t + QUEUE_DEPTH_INTERVAL
                    if until is not None and until():
                        graceful = True
                        break
                if self.stop_requested:
                    if drain_deadline is None:
                        drain_deadline = self._begin_drain()
                    finished = not self.engine.has_unfinished() and not self._unrecorded
                    if self.stop_requested > 1 or finished or t > drain_deadline:
                        graceful = True
                        break
        finally:
            if graceful and self.checkpoints is not None:  # what is handed back continues from here elsewhere
                self.checkpoints.save_all(CHECKPOINT_FLUSH)
            self._hand_back(count_attempt=not graceful)
            self._close()
            for sig, handler in previous_handlers.items():
                signal.signal(sig, handler)

    def stop(self) -> None:
        self.stop_requested += 1

    def _install_signal_handlers(self) -> dict:
        """SIGTERM and SIGINT ask the loop to stop; the handlers replaced, to put back."""
        if threading.current_thread() is not threading.main_thread():
            return {}
        return {sig: signal.signal(sig, lambda *_: self.stop()) for sig in (signal.SIGTERM, signal.SIGINT)}

    # ---- deliveries in
    def _connect(self, max_retries: int | None = None) -> None:
        self.connection = connect(self.settings)
        self.connection.ensure_connection(max_retries=max_retries, interval_max=10)
        self.consumer = kombu.Consumer(self.connection.channel(), queues=list(self.queues.values()),
                                       callbacks=[self._on_delivery], accept=["json"], no_ack=False)
        self._set_prefetch(self.window)
        self.consumer.consume()
        self._broken = False
        self.metrics.broker_up.set(1)
        self._follow_tenants()

    def _reconnect(self) -> None:
        """A new connection and consumer: one try (kombu's retries sleep) every ``RECONNECT_INTERVAL``
        seconds, so that the engine keeps stepping meanwhile."""
        now = time.monotonic()
        if now < self._reconnect_at:
            return
        first = self._reconnect_at == 0.0
        self._reconnect_at = now + RECONNECT_INTERVAL
        if first:
            self.metrics.broker_up.set(0)
            log.warning("worker %s: broker channel lost; reconnecting every %.0fs, %d requests keep running",
                        self.name, RECONNECT_INTERVAL, len(self.inflight))
        for item in self.inflight.values():
            item.delivery = None  # the broker requeued these; a redelivery here is adopted
        self.incoming.clear()
        self._close_connection()
        try:
            self._connect(max_retries=0)
        except self._broker_errors() + (OperationalError, OSError) as exc:
            if first:
                log.warning("worker %s: broker unreachable (%s); trying again", self.name, exc)
            return
        self._reconnect_at = 0.0
        self.metrics.broker_reconnects.inc()
        log.warning("worker %s: reconnected to the broker", self.name)

    def _on_delivery(self, _body, delivery: Message) -> None:
        self.incoming.append(delivery)

    def _receive(self, timeout: float) -> None:
        while len(self.incoming) < self.window and not self._broken:
            try:
                self.connection.drain_events(timeout=timeout)
            except socket.timeout:
                return
            except self._broker_errors():
                self._broken = True
                return
            timeout = 0

    def _admit(self) -> None:
        if not self.database.ready():
            return  # deliveries wait in ``incoming`` (the window keeps more from coming)
        batch, self.incoming = self.incoming, []
        fresh: list[tuple[RequestMessage, Message]] = []
        for delivery in batch:
            try:
                message = RequestMessage.from_body(delivery.decode())
            except Exception as exc:  # noqa: BLE001 (MalformedMessage, or kombu's decoding errors)
                self._dead_letter(delivery, f"unreadable message: {exc}", 0)
                self._ack(delivery)
                continue
            running = self.inflight.get(message.engine_id)
            if running is None:
                fresh.append((message, delivery))
            elif running.delivery is None:
                running.delivery = delivery  # the redelivery of what this worker runs: ack it when done
            else:
                self._ack(delivery)  # a duplicate of what this worker runs
        if not fresh:
            return
        try:
            known = record_deliveries(self.db, [m.request_id for m, _ in fresh])
        except database_health.DOWN as exc:
            self.database.failed(exc, len(self.inflight))
            self.incoming[:0] = [delivery for _, delivery in fresh]  # admitted once the database is back
            return
        self.database.succeeded()
        failures: list[tuple[Outcome, RequestMessage, Message, str | None]] = []
        for message, delivery in fresh:
            d = known.get(message.request_id)
            if d is None:
                self._dead_letter(delivery, f"request {message.request_id} is not in the database", 0)
                self._ack(delivery)
            elif d.has_result or d.job_status not in LIVE:
                self._ack(delivery)
            elif d.attempts > self.settings.max_delivery_attempts:
                reason = (f"delivered {d.attempts - 1} times without finishing (the worker died or was stopped "
                          f"each time); last error: {d.last_error or 'none recorded'}")
                failures.append((Outcome.failure(message.request_id, message.job_id, "delivery_limit", reason),
                                 message, delivery, reason))
            else:
                self._start(message, delivery, d.attempts, failures)
        self._record(failures)

    def _start(self, message: RequestMessage, delivery: Message, attempts: int, failures: list) -> None:
        item = self.inflight[message.engine_id] = Inflight(message, message.engine_request(), delivery)
        delivered_before = attempts > 1 or delivery.delivery_info.get("redelivered", False)
        if delivered_before and self.restorer is not None and self.checkpoints.store_up:
            self.restorer.submit(item.request)  # added once its checkpoint is read (``_add_restored``)
        else:
            self._add(item, failures)

    def _restoring(self) -> bool:
        return self.restorer is not None and self.restorer.pending > 0

    def _add_restored(self) -> None:
        if not self._restoring():
            return
        failures: list = []
        for request in self.restorer.ready():
            item = self.inflight.get(request.request_id)
            if item is not None and item.request is request:  # not dropped or handed back meanwhile
                self._add(item, failures)
        self._record(failures)

    def _add(self, item: Inflight, failures: list) -> None:
        message = item.message
        try:
            self.engine.add_request(item.request)
        except RequestRejected as exc:  # never runnable here: fail it now
            del self.inflight[message.engine_id]
            failures.append((Outcome.failure(message.request_id, message.job_id, "request_rejected", str(exc)),
                             message, item.delivery, None))
            return
        except Exception as exc:  # noqa: BLE001 (anything else: hand it back, the attempt counts)
            del self.inflight[message.engine_id]
            log.exception("request %s could not be admitted", message.request_id)
            try:
                note_error(self.db, message.request_id, f"{type(exc).__name__}: {exc}")
            except database_health.DOWN as db_exc:  # the error goes unrecorded; the attempt still counts
                self.database.failed(db_exc, len(self.inflight))
            self._reject(item.delivery)
            return
        size = message.kv_tokens
        self.mean_kv_tokens = size if self.mean_kv_tokens is None else 0.9 * self.mean_kv_tokens + 0.1 * size

    # ---- results out
    def _step(self) -> None:
        t0 = time.perf_counter()
        outputs = self.engine.step()
        self.metrics.observe_step(self.engine, time.perf_counter() - t0)
        if self.checkpoints is not None:
            self.checkpoints.after_step()
            self.restorer.observe_step()
        done = []
        for output in outputs:
            item = self.inflight.get(output.request_id)
            if item is not None:
                done.append((self._completed(item.message, output), item.message, item.delivery, None))
        self._record(done)

    def _completed(self, message: RequestMessage, output: RequestOutput) -> Outcome:
        line = response_line(message.batch_line(), output, self.engine.model_name, self.engine.tokenizer)
        return Outcome(message.request_id, message.job_id, ResultStatus.COMPLETED, response=line["response"],
                       prompt_tokens=len(output.prompt_token_ids), completion_tokens=output.num_output_tokens)

    def _record(self, items: list[tuple[Outcome, RequestMessage, Message | None, str | None]]) -> None:
        """Commit the outcomes, then dead-letter what must be and ack every delivery. While the
        database is down they wait in ``_unrecorded``, their requests still in ``inflight`` (so a
        redelivery is adopted, not run again) and their deliveries unacked."""
        if not items:
            return
        if not self.database.ready():
            self._keep_unrecorded(items)
            return
        try:
            recorded = record_outcomes(self.db, [o for o, *_ in items], self.name)
        except database_health.DOWN as exc:
            self.database.failed(exc, len(self.inflight))
            self._keep_unrecorded(items)
            return
        self.database.succeeded()
        for outcome, message, delivery, dead_reason in items:
            item = self.inflight.pop(message.engine_id, None)
            if item is not None:
                delivery = item.delivery  # the broker may have redelivered it since it finished
            if dead_reason is not None and delivery is not None:
                self._dead_letter(delivery, dead_reason, self.settings.max_delivery_attempts)
            self._ack(delivery)
            if self.checkpoints is not None:
                self.checkpoints.finished(message.engine_id)
            if outcome.request_id in recorded.new:
                counter = self.metrics.finished if outcome.status is ResultStatus.COMPLETED else self.metrics.failed
                counter.labels(message.tenant).inc()
        try:
            finalize_later(self.tasks, recorded.finalize)
        except Exception:  # noqa: BLE001 (the broker is down: the reconciler finalizes jobs left finalizing)
            log.exception("worker %s: could not dispatch the finalizing of jobs %s", self.name, recorded.finalize)

    def _keep_unrecorded(self, items: list) -> None:
        self._unrecorded.extend(items)
        self.metrics.outcomes_waiting.set(len(self._unrecorded))

    def _record_waiting(self) -> None:
        """Try again to commit the outcomes kept while the database was down, when a try is due."""
        if self._unrecorded and self.database.ready():
            items, self._unrecorded = self._unrecorded, []
            self.metrics.outcomes_waiting.set(0)
            self._record(items)

    # ---- every second
    def _control(self, measure_queue: bool) -> None:
        try:
            if not self._broken:  # on a lost connection kombu would try to connect, sleeping 2s
                self.connection.heartbeat_check()
        except self._broker_errors():
            self._broken = True
        if self.database.ready():
            self._drop_closed_jobs()
            self._follow_tenants()
        self._resize_window()
        self.metrics.observe_kv(self.engine)
        if measure_queue and not self._broken:
            try:
                self.metrics.queue_depth.set(queue_depth(self.connection, self.queues.values()))
            except self._broker_errors():
                self._broken = True

    def _drop_closed_jobs(self) -> None:
        """Abort the requests of jobs cancelled, expired or otherwise closed; ack their messages."""
        job_ids = {item.message.job_id for item in self.inflight.values()}
        if not job_ids:
            return
        try:
            with self.db.session() as s:
                closed = set(s.scalars(select(Job.id).where(Job.id.in_(job_ids), Job.status.not_in(LIVE))))
        except database_health.DOWN as exc:
            self.database.failed(exc, len(self.inflight))
            return
        self.database.succeeded()
        for engine_id, item in list(self.inflight.items()):
            if item.message.job_id in closed:
                self.engine.abort(engine_id)
                self._ack(item.delivery)
                del self.inflight[engine_id]
                if self.checkpoints is not None:
                    self.checkpoints.finished(engine_id)

    def _follow_tenants(self) -> None:
        """Consume the queue of every tenant with live jobs for this model; set their weights."""
        try:
            tenants = live_tenants(self.db, self.engine.model_name)
        except database_health.DOWN as exc:  # the queues already followed stay; new tenants once it is back
            self.database.failed(exc, len(self.inflight))
            return
        self.database.succeeded()
        for tenant, weight in tenants.items():
            self.engine.set_tenant_share(tenant, weight)
        new = {t: self.topology.request_queue(self.engine.model_name, t) for t in tenants if t not in self.queues}
        if not new or self._broken:
            return
        try:
            for queue in new.values():
                self.consumer.add_queue(queue)
            self.consumer.consume()  # starts consuming the queues added
        except self._broker_errors():
            self._broken = True
            return
        self.queues.update(new)  # kept across reconnections: a new consumer starts with them all

    def _set_prefetch(self, window: int) -> None:
        """``window`` unacked deliveries per tenant queue, and twice that for all of them together.

        RabbitMQ applies a per-consumer limit to the consumers started after it is set (a tenant
        queue followed later, a reconnection), and a channel-wide one at once: so a resize takes
        effect through the channel-wide cap, and many tenants cannot make a worker hoard the queue.
        (The embedded transport keeps one channel-wide limit: the last one set.)
        """
        self.consumer.qos(prefetch_count=window)
        self.consumer.qos(prefetch_count=2 * window, apply_global=True)

    def _resize_window(self) -> None:
        if self.settings.prefetch:
            return
        want = prefetch_window(self.engine.settings.max_num_seqs, self.kv_capacity, self.mean_kv_tokens)
        if abs(want - self.window) * 8 > self.window and not self._broken:  # not for every small change
            try:
                self._set_prefetch(want)
                self.window = want
            except self._broker_errors():
                self._broken = True

    # ---- stopping
    def _begin_drain(self) -> float:
        log.info("worker %s stopping: %d requests running, up to %.0fs to finish", self.name,
                 len(self.inflight), self.settings.drain_timeout)
        try:
            self.consumer.cancel()
        except self._broker_errors():
            self._broken = True
        self._hand_back(count_attempt=False, only_unstarted=True)
        return time.monotonic() + self.settings.drain_timeout

    def _hand_back(self, count_attempt: bool, only_unstarted: bool = False) -> None:
        """Abort requests and requeue their messages; a graceful hand-back is no failed attempt."""
        items = [(k, i) for k, i in self.inflight.items() if not (only_unstarted and i.started)]
        if not count_attempt:
            try:
                release(self.db, [i.message.request_id for _, i in items])
            except Exception:  # noqa: BLE001 (stopping anyway; at worst the attempt counts)
                log.exception("could not release attempts")
        for engine_id, item in items:
            self.engine.abort(engine_id)
            self._reject(item.delivery)
            del self.inflight[engine_id]
            if self.checkpoints is not None:
                self.checkpoints.released(engine_id)
        if not only_unstarted:
            for delivery in self.incoming:
                self._reject(delivery)
            self.incoming.clear()

    def _close(self) -> None:
        if self.checkpoints is not None:
            self.restorer.close()
            self.checkpoints.close(CHECKPOINT_FLUSH)
        self._close_connection()
        if self._publisher is not None:
            self._publisher.close()

    def _close_connection(self) -> None:
        if self.connection is not None:
            try:
                self.connection.release()
            except Exception:  # noqa: BLE001 (a broken connection may fail to close)
                pass

    # ---- broker calls that must not kill the loop
    def _broker_errors(self) -> tuple:
        return self.connection.connection_errors + self.connection.channel_errors

    def _current(self, delivery: Message | None) -> bool:
        return (delivery is not None and not self._broken and delivery.channel is self.consumer.channel
                and not delivery.acknowledged)  # e.g. acked when its job closed while its outcome waited

    def _ack(self, delivery: Message | None) -> None:
        if self._current(delivery):
            try:
                delivery.ack()
            except self._broker_errors():
                self._broken = True

    def _reject(self, delivery: Message | None) -> None:
        if self._current(delivery):
            try:
                delivery.reject(requeue=True)
            except self._broker_errors():
                self._broken = True

    def _dead_letter(self, delivery: Message, reason: str, attempts: int) -> None:
        if self._publisher is None:
            self._publisher = Publisher(self.settings)
        self._publisher.dead_letter(delivery.body, delivery.content_type, delivery.content_encoding, reason, attempts)
        log.warning("dead-lettered a message: %s", reason)
