"""The engine worker (``berth worker``), as dramatiq's worker: queue deliveries in, one engine running
across jobs and tenants, results out, acked only after their outcome commits. One loop, never blocked
while the engine has work; its parts each have a module (broker, admission, outcomes, ledger,
suspects, housekeeper), and absent optional parts are null objects (``absent``). docs/engine.md tells
the loop's story: prefetch, idempotency, poison, consumer_timeout, draining, checkpoints, interactive."""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from dataclasses import dataclass

from worker.checkpoint.connector import StoreConnector
from worker.config import Settings
from worker.consumer import admission, suspects
from worker.consumer.absent import NoInbox, NoRemote, NoStore
from worker.consumer.admission import Action
from worker.consumer.broker import BrokerLink, Delivery
from worker.consumer.committer import Committer
from worker.consumer.database_health import DOWN, DatabaseHealth
from worker.consumer.housekeeper import Chore, Housekeeper
from worker.consumer.interactive_inbox import InteractiveInbox
from worker.consumer.interactive_queue import Door, RemoteRequests
from worker.consumer.ledger import Claim, Heartbeat, Ledger, Outcome
from worker.consumer.outcomes import OutcomeBook, Pending
from worker.consumer.suspects import CLEAR_TOKENS, CrashSuspects
from worker.engine.engine import Engine, RequestRejected
from worker.engine.request import Request
from worker.frozen_heap import frozen_heap
from worker.messaging.message_body import UnreadableBody
from worker.messaging.topology import BadMessage, RequestRef, parse_request_body
from worker.metrics import WorkerMetrics
from worker.process_clock import seconds_since_start

log = logging.getLogger("berth.worker")

IDLE_WAIT = 0.5  # seconds to wait for deliveries when the engine has nothing to do
RESTORE_WAIT = 0.02  # ... when it has nothing to do but requests are being restored from checkpoints
CHECKPOINT_FLUSH = 10.0  # seconds a stopping worker waits for its last checkpoints to be written
CONTROL_INTERVAL = 1.0  # seconds between checks for closed jobs, window resizing, metrics
QUEUE_DEPTH_INTERVAL = 5.0
HEARTBEAT_INTERVAL = 5.0  # seconds between the worker's heartbeats in the database
# Python hands the GIL to a thread that asks for it after this long at most (5 ms by default): the loop, back
# from a device wait while the committer, claim or ingest threads run, waited up to that a step. Process-wide
# while the loop runs; servers' job path 0.911 of the engine alone against 0.900 at 5 ms (9 pairs, HISTORY.md)
SWITCH_INTERVAL = 0.0005
ADMIT_DELAY = 0.05  # seconds a delivery may wait to be claimed with others while the engine has enough waiting
CLAIM_WAIT = 10.0  # seconds a stopping worker waits for a claim under way, to hand its deliveries back


def worker_name() -> str:
    """How a worker is named in the database (``requests.holder``): host and process id."""
    return f"{socket.gethostname()}:{os.getpid()}"


@dataclass
class Inflight:
    claim: Claim
    request: Request  # as the engine runs it
    delivery: Delivery | None  # None once handed over to another delivery's bookkeeping
    suspect: int = 0  # its suspect size class in this delivery (0: innocent): runs apart (``worker.consumer.suspects``)
    begun: bool = False  # its baseline was written with its claim (``EngineWorker._claim``), not in ``_begin``
    finishing: bool = False  # its outcome is with the committer: held until committed, then acked

    @property
    def started(self) -> bool:
        """An engine step has run it. A finished one has (its KV freed, it counts no computed token)."""
        return self.finishing or any(s.num_computed_tokens for s in self.request.sequences)


class EngineWorker:
    def __init__(self, settings: Settings, engine: Engine, ledger: Ledger, *, broker: BrokerLink | None = None,
                 chores: list[Chore] = (), interactive: InteractiveInbox | None = None, door: Door | None = None):
        """``interactive``: live callers' requests handed over in this process (``berth serve`` on the
        embedded defaults); ``door``: how an interactive queue's message becomes a request (``jobs``
        checks it as a batch line), without which the worker does not consume that queue."""
        self.settings = settings
        self.engine = engine
        self.ledger = ledger
        self.name = worker_name()
        self.metrics = WorkerMetrics()
        self.broker = broker or BrokerLink(settings, engine.model_name, self.metrics, self.name)
        # The one place that decides which optional parts this worker has; an absent one is a null object
        # (``worker.consumer.absent``), so the loop calls each part the same way.
        self.remote: RemoteRequests | NoRemote = NoRemote()  # the interactive queue's requests (RabbitMQ)
        self.consumes_interactive_queue = bool(door is not None and getattr(self.broker, "interactive_prefetch", 0))
        if self.consumes_interactive_queue:
            interactive = interactive or InteractiveInbox()
            self.remote = RemoteRequests(interactive, self.broker, door, self.metrics, settings.http_max_body_bytes,
                                         self.name)
        elif hasattr(self.broker, "interactive_prefetch"):
            self.broker.interactive_prefetch = 0  # nobody here would read them
        # live callers' requests handed over in this process (not by the queue): the loop waits on them
        self.waits_on_inbox = interactive is not None and not self.consumes_interactive_queue
        self.interactive: InteractiveInbox | NoInbox = interactive or NoInbox()  # live callers', beside the queue's
        self.interactive.attach(engine)
        self.database = DatabaseHealth(self.name, self.metrics)
        self.outcomes = OutcomeBook(ledger, self.database, self.metrics, self.name)
        self.committer = Committer(self.outcomes)  # commits them beside the engine's next step
        self.housekeeper = Housekeeper(list(chores))
        self.store: StoreConnector | NoStore = NoStore()  # checkpoints, restores and shared prefixes
        if settings.checkpoint_interval:
            self.store = StoreConnector.open(self.engine, settings, self.metrics, self._checkpointed)
        self.kv_capacity = self.engine.kv_usage()["blocks_total"] * self.engine.settings.block_size
        self.inflight: dict[str, Inflight] = {}
        self.incoming: list[Delivery] = []
        self.incoming_since = 0.0  # monotonic time the oldest delivery in ``incoming`` came
        # a claim under way on a thread of its own (the deliveries it claims, its answer, whether it says
        # its requests started): the loop steps on
        self.claiming: tuple[list[tuple[RequestRef, Delivery]], Future, bool] | None = None
        self._claims: ThreadPoolExecutor | None = None  # its thread, made at the first claim
        self.looking: Future | None = None  # a look's reads under way on a thread of their own (``_look``)
        self._looks: ThreadPoolExecutor | None = None
        self.commit_peak = 0.0  # outcomes with the committer at a time, lately (their messages hold the window)
        self.mean_kv_tokens: float | None = None
        self.broker.window = settings.prefetch or admission.prefetch_window(
            self.engine.settings.max_num_seqs, self.kv_capacity, None)
        self.stop_requested = 0  # signals received
        self.started_at = time.time()
        self._next_beat = 0.0
        self.suspects = CrashSuspects(self.name, settings.checkpoint_interval or CLEAR_TOKENS, engine, ledger,
                                      self._ledger, self.database, self.metrics, self.inflight)
        engine.on_start = self.suspects.on_start
        self._closed = False

    @property
    def window(self) -> int:
        return self.broker.window

    # ---- the loop
    def run(self, until: Callable[[], bool] | None = None) -> None:
        """Work until stopped by a signal, or until ``until()`` is true: checked about every second, and at
        once when the worker falls idle after committing outcomes (the last of a job's, as a rule: `berth
        run` returned up to a second after its job ended)."""
        previous = sys.getswitchinterval()
        sys.setswitchinterval(SWITCH_INTERVAL)
        try:
            with frozen_heap():  # the collector's full walks skip what start-up made
                self._run(until)
        finally:
            sys.setswitchinterval(previous)

    def _run(self, until: Callable[[], bool] | None) -> None:
        if self.settings.metrics_port:
            self.metrics.serve(self.settings.metrics_port, self.settings.metrics_host)
        previous_handlers = self._install_signal_handlers()
        self.broker.start()  # a broker that does not answer: tried again in the loop, which stops on SIGTERM
        self._follow_tenants()
        self.housekeeper.start()
        log.info("worker %s consuming %s.requests.%s.* (prefetch %d)%s: ready, %.1fs since the process started",
                 self.name, self.settings.queue_prefix, self.engine.model_name, self.window,
                 f" and {self.broker.topology.interactive_queue(self.engine.model_name).name} (prefetch "
                 f"{self.broker.interactive_prefetch})" if self.consumes_interactive_queue else "",
                 seconds_since_start())
        drain_deadline = None
        next_control = next_depth = time.monotonic()  # due at once
        graceful = False
        settled = False  # outcomes were acked since ``until`` was last asked
        try:
            while True:
                busy = self.engine.has_unfinished() or self.interactive.pending()
                if not self.stop_requested and not self.broker.maintain() and not busy:
                    self._idle(IDLE_WAIT)  # no broker and nothing to run: wait, then try again
                if not self.database.ready() and not busy:
                    self._idle(IDLE_WAIT)  # no database and nothing to run: the same
                soon = self.store.reading or self.committer.pending or self.claiming is not None
                wait = 0 if busy else RESTORE_WAIT if soon else IDLE_WAIT
                if wait and self.claiming is not None:  # the loop waits for the claim's answer, not a delivery's
                    wait_for([self.claiming[1]], wait)
                    wait = 0
                    self._admit_claimed()
                # an engine that has just been given its first requests steps before more deliveries are read:
                # reading the window's (hundreds, at a job's start) took 86 ms before the job's first step
                if not (wait == 0 and not busy and self.engine.has_unfinished()):
                    self._receive(wait)
                settled = self._settle() or settled  # outcomes committed since: ack them
                self._admit()
                self.remote.admit()
                self.interactive.admit()
                self._add_restored()
                self._act_on_look()
                # no group of suspects starts while a claim under way says its requests started: they would
                # count as running beside the group (``_claim``)
                hold = self.claiming is not None and self.claiming[2]
                self.suspects.start_next(bool(self.stop_requested) or hold, self._add, self._record)
                if self.engine.has_unfinished():
                    self._step()
                self.remote.keepalive()
                t = time.monotonic()
                # the look waits while the engine is empty and a claim is under way (at most a second): at the
                # start it delayed the job's first step by its heartbeat, queue depth and tenants (~75 ms)
                claim_first = (self.claiming is not None and not self.engine.has_unfinished()
                               and t < next_control + CONTROL_INTERVAL)
                look = t >= next_control and not claim_first
                if look:
                    next_control = t + CONTROL_INTERVAL
                    self._control(t >= next_depth)
                    next_depth = next_depth if t < next_depth else t + QUEUE_DEPTH_INTERVAL
                if until is not None and (look or settled and self._idle_now()):
                    settled = False
                    if until():
                        graceful = True
                        break
                if self.stop_requested:
                    if drain_deadline is None:
                        drain_deadline = self._begin_drain()
                    finished = (not self.engine.has_unfinished() and not self.committer.pending
                                and self.claiming is None and not self.incoming)
                    if self.stop_requested > 1 or finished or t > drain_deadline:
                        graceful = True
                        break
        finally:
            self.remote.hand_back()  # those that said nothing yet: to another worker
            self.interactive.fail_all("the server's engine worker stopped", close=True)
            self.housekeeper.stop()
            self.committer.close(flush=graceful, timeout=CHECKPOINT_FLUSH)  # a killed worker commits nothing more
            self._settle()
            if graceful:  # what is handed back continues from here elsewhere
                self.store.save_all(CHECKPOINT_FLUSH)
            self._hand_back(count_attempt=not graceful)
            self.close()
            for sig, handler in previous_handlers.items():
                signal.signal(sig, handler)

    def stop(self) -> None:
        self.stop_requested += 1

    def _receive(self, wait: float) -> None:
        """Deliveries, waiting up to ``wait`` for the first; with live callers' requests beside the queue,
        the wait is on them (a request or an abort ends it) after one look at the queue."""
        limit = self.window - len(self.incoming) - (len(self.claiming[0]) if self.claiming else 0)
        if not self.waits_on_inbox or not wait:  # the broker brings them all
            got = self.broker.receive(limit, wait)
        else:
            got = self.broker.receive(limit, 0)
            if not got:
                self.interactive.wait(wait)
        if got and not self.incoming:
            self.incoming_since = time.monotonic()
        self.incoming += got

    def _idle(self, seconds: float) -> None:
        self.interactive.wait(seconds)  # without an inbox: a sleep

    def _install_signal_handlers(self) -> dict:
        """SIGTERM and SIGINT ask the loop to stop; the handlers replaced, to put back."""
        if threading.current_thread() is not threading.main_thread():
            return {}
        return {sig: signal.signal(sig, lambda *_: self.stop()) for sig in (signal.SIGTERM, signal.SIGINT)}

    def _ledger(self, call, *args):
        """A ledger call, or ``DOWN`` while the database does not answer (the loop carries on)."""
        return self.database.call(call, *args, running=len(self.inflight))

    # ---- admission
    def _admit_due(self) -> bool:
        """Whether to claim what came now. Each claim is a few round trips to the database, so while
        the engine has waiting requests enough to fill the seats its steps free, deliveries gather for
        up to ``ADMIT_DELAY`` seconds or a batch of ``admission.CLAIM_BATCH``."""
        return (len(self.incoming) >= admission.CLAIM_BATCH or self.stop_requested
                or self.engine.num_waiting < admission.CLAIM_BATCH
                or time.monotonic() - self.incoming_since >= ADMIT_DELAY)

    def _admit(self) -> None:
        """Deliveries to claims, on a thread of their own (one claim under way at a time: the loop
        steps the engine meanwhile); ``_admit_claimed`` goes on once the database answered."""
        self._admit_claimed()
        if self.claiming is not None or not self.database.ready() or not self.incoming or not self._admit_due():
            return  # deliveries wait in ``incoming`` (the window keeps more from coming)
        batch, self.incoming = self.incoming, []
        fresh: list[tuple[RequestRef, Delivery]] = []
        for delivery in batch:
            try:
                ref = parse_request_body(delivery.decode())
            except Exception as exc:  # noqa: BLE001 (BadMessage, UnreadableBody: not JSON, a content type; or a bug)
                why = str(exc) if isinstance(exc, (BadMessage, UnreadableBody)) else f"{type(exc).__name__}: {exc}"
                self.broker.dead_letter(delivery, f"unreadable message: {why}"[:1000])
                continue
            running = self.inflight.get(str(ref.request_id))
            if running is None:
                fresh.append((ref, delivery))
            elif (verdict := admission.judge(ref, running.claim, self.engine.model_name, delivery.tenant)).reason:
                self.broker.dead_letter(delivery, verdict.reason)  # names a request this worker runs, wrongly
            elif not self.broker.is_current(running.delivery):
                running.delivery = delivery  # the redelivery of what this worker runs: ack it when done
            else:
                self.broker.ack(delivery)  # a duplicate of what this worker runs
        if not fresh:
            return
        if self._claims is None:
            self._claims = ThreadPoolExecutor(1, thread_name_prefix="berth-claims")
        says_started = self.suspects.may_say_started()
        self.claiming = (fresh, self._claims.submit(self._claim, fresh, says_started), says_started)

    def _claim(self, fresh: list[tuple[RequestRef, Delivery]], says_started: bool) -> tuple[dict | object, set[int]]:
        """On the claims thread: the claim, then in one more transaction the baselines of the requests it
        runs from their start (innocent, nothing checkpointed to read first) and, with ``says_started``,
        that they run (``CrashSuspects.on_start``'s write, said ahead of their first step). Those two
        writes were two transactions on the loop's thread before most steps that started requests, the
        device waiting (benchmarks/HISTORY.md, "The claim says what the loop said"); ``_begin`` writes
        the rest. The claims (or ``DOWN``) and the ids begun here."""
        claims = self._ledger(self.ledger.claim, list(dict.fromkeys(r.request_id for r, _ in fresh)), self.name)
        if claims is DOWN:
            return claims, set()
        baselines: dict[int, tuple[int, int]] = {}
        for ref, delivery in fresh:
            claim = claims.get(ref.request_id)
            if claim is None or claim.checkpoint or claim.suspect or admission.judge(
                    ref, claim, self.engine.model_name, delivery.tenant).action is not Action.RUN:
                continue
            standing, reason = self._standing(claim, 0)
            if not standing.suspect and reason is None:
                baselines[claim.request_id] = (0, standing.strikes)
        if not baselines:
            return claims, set()
        wrote = self._ledger(self.ledger.begin, baselines, list(baselines) if says_started else [])
        return claims, set() if wrote is DOWN else set(baselines)

    def _admit_claimed(self) -> None:
        """Admit the deliveries of the claim under way once it has its answer (its errors are raised here)."""
        if self.claiming is None or not self.claiming[1].done():
            return
        (fresh, future, says_started), self.claiming = self.claiming, None
        claims, begun = future.result()
        if says_started:  # the database holds them as running here from now
            self.suspects.said_ahead([str(rid) for rid in begun])
        if claims is DOWN:
            self.incoming[:0] = [delivery for _, delivery in fresh]  # admitted once the database is back
            return
        self.suspects.note_deaths(claims.values())
        failures: list[Pending] = []
        starting: list[Inflight] = []
        for ref, delivery in fresh:
            claim = claims.get(ref.request_id)
            verdict = admission.judge(ref, claim, self.engine.model_name, delivery.tenant)
            if verdict.action is Action.RUN and str(ref.request_id) in self.inflight:  # twice in this batch
                verdict = admission.Verdict(Action.SKIP)
            if verdict.action is Action.REFUSE:
                self.broker.dead_letter(delivery, verdict.reason)
            elif verdict.action is Action.SKIP:
                self.broker.ack(delivery)
            elif verdict.action is Action.FAIL:
                failures.append(Pending(Outcome.failure(claim.request_id, claim.job_id, "request_unreadable",
                                                        verdict.reason), claim.tenant, delivery))
            else:
                item = Inflight(claim, Request(str(claim.request_id), list(claim.prompt_token_ids), claim.params,
                                               priority=claim.priority, tenant=claim.tenant,
                                               cache_salt=claim.cache_salt, deadline=claim.deadline,
                                               job=claim.job_id, text_later=True), delivery,
                                       begun=claim.request_id in begun)
                self.inflight[item.request.request_id] = item
                if not self.store.begin(item.request, claim.checkpoint):  # else it begins once read (_add_restored)
                    starting.append(item)
        self._record(failures)
        self._begin(starting)

    def _add_restored(self) -> None:
        if not self.store.reading:
            return
        ready = []
        for request in self.store.ready():
            item = self.inflight.get(request.request_id)
            if item is not None and item.request is request:  # not dropped or handed back meanwhile
                ready.append(item)
        self._begin(ready)

    def _begin(self, items: list[Inflight]) -> None:
        """Judge poison from what the checkpoint says, note each one's starting point, add to the engine."""
        failures: list[Pending] = []
        baselines: dict[int, tuple[int, int]] = {}
        classes: dict[int, int] = {}
        runnable = []
        for item in items:
            claim = item.claim
            if item.begun:  # written with its claim: innocent, from its start
                runnable.append(item)
                continue
            tokens = sum(len(out) for out in item.request.resume_output_ids)
            standing, reason = self._standing(claim, tokens)
            if reason is not None:
                del self.inflight[item.request.request_id]
                failures.append(Pending(Outcome.failure(claim.request_id, claim.job_id, "delivery_limit", reason),
                                        claim.tenant, item.delivery, dead_reason=reason))
                continue
            baselines[claim.request_id] = (tokens, standing.strikes)
            if standing.suspect != claim.suspect:
                classes[claim.request_id] = standing.suspect
            item.suspect = standing.suspect
            runnable.append(item)
        if baselines:  # without the database they run all the same; a crash is judged by the older baseline
            self._ledger(self.ledger.begin, baselines)
        if classes:  # without it, a suspect is one all the same here, and its next crash judged from the row
            self._ledger(self.ledger.suspect, classes)
        for item in runnable:
            if item.suspect:
                self.suspects.wait(item)  # runs apart, in a group of its own
            else:
                self._add(item, failures)
        self._record(failures)

    def _standing(self, claim: Claim, tokens: int) -> tuple[suspects.Standing, str | None]:
        """A claimed request's standing once it starts from ``tokens`` checkpointed; why it is poison, or None."""
        standing = suspects.standing_after(claim, tokens)
        return standing, suspects.poison_reason(claim, standing, self.settings.max_delivery_attempts)

    def _add(self, item: Inflight, failures: list[Pending]) -> None:
        claim = item.claim
        try:
            self.engine.add_request(item.request)
        except RequestRejected as exc:  # never runnable here: fail it now
            del self.inflight[item.request.request_id]
            failures.append(Pending(Outcome.failure(claim.request_id, claim.job_id, "request_rejected", str(exc)),
                                    claim.tenant, item.delivery))
            return
        except Exception as exc:
            log.exception("request %s could not be admitted", claim.request_id)
            del self.inflight[item.request.request_id]
            failures.append(Pending(Outcome.failure(claim.request_id, claim.job_id, "engine_error",
                                                    f"{type(exc).__name__}: {exc}"), claim.tenant, item.delivery))
            return
        size = claim.kv_tokens
        self.mean_kv_tokens = size if self.mean_kv_tokens is None else 0.9 * self.mean_kv_tokens + 0.1 * size

    def _checkpointed(self, refs: dict[str, str]) -> None:
        """On the checkpoint writer's thread: record in the requests' rows where their latest states are
        (``LedgerDown`` propagates: the writer tries again later). Never called by the engine loop."""
        self.ledger.checkpointed({int(r): ref for r, ref in refs.items() if r.isdigit()}, self.name)

    # ---- results out
    def _step(self) -> None:
        t0 = time.perf_counter()
        try:
            outputs = self.engine.step()
        except Exception:
            log.exception("worker %s: an engine step failed outside any one request; handing its requests back",
                          self.name)
            self._hand_back(count_attempt=True)
            self.interactive.fail_all("the engine failed a step: try again")
            return
        self.metrics.observe_step(self.engine, time.perf_counter() - t0)
        self.store.after_step()
        self.suspects.after_step()
        self.interactive.after_step(outputs)
        done = []
        for output in outputs:
            item = self.inflight.get(output.request_id)
            if item is None:
                continue
            claim = item.claim
            if output.error is not None:
                log.warning("request %s failed: %s", claim.request_id, output.error)
                outcome = Outcome.failure(claim.request_id, claim.job_id, "engine_error", output.error)
            else:
                outcome = Outcome(claim.request_id, claim.job_id, output)
            item.finishing = True
            done.append(Pending(outcome, claim.tenant, item.delivery))
        self._record(done)

    def _record(self, items: list[Pending]) -> None:
        """Hand the outcomes to the committer; ``_settle`` acks them once committed."""
        self.committer.put(items, len(self.inflight))
        self.commit_peak = max(self.commit_peak, self.committer.pending)

    def _idle_now(self) -> bool:
        """Nothing running, committing, claiming or waiting to be claimed."""
        return not (self.engine.has_unfinished() or self.committer.pending or self.claiming is not None
                    or self.incoming or self.interactive.pending())

    def _settle(self) -> bool:
        """The outcomes committed since the last call: dead-letter what must be and ack the rest. Whether
        there were any."""
        acks, taken = [], False
        for p in self.committer.take():
            taken = True
            item = self.inflight.pop(p.engine_id, None)
            delivery = item.delivery if item is not None else p.delivery  # it may have been redelivered since
            if p.dead_reason is not None and delivery is not None:
                if not self.broker.dead_letter(delivery, p.dead_reason, self.settings.max_delivery_attempts):
                    acks.append(delivery)  # its outcome is committed: the message has done its work
            else:
                acks.append(delivery)
            self.store.finished(p.engine_id)
        if acks:
            self.broker.ack_all(acks)
        return taken

    # ---- every second
    def _control(self, measure_queue: bool) -> None:
        self.broker.heartbeat()
        self._act_on_look()
        if self.database.ready() and self.looking is None:
            if self._looks is None:
                self._looks = ThreadPoolExecutor(1, thread_name_prefix="berth-look")
            self.looking = self._looks.submit(self._look, {item.claim.job_id for item in self.inflight.values()},
                                              self.suspects.death_rates_due())
        self._resize_window()
        self.metrics.observe_kv(self.engine)
        # the heartbeat on the loop, written when due before the caller's ``until`` reads the job: a job's
        # progress (its running requests' tokens) is as of this moment, not of the look before
        if time.monotonic() >= self._next_beat and self.database.ready():
            self._next_beat = time.monotonic() + HEARTBEAT_INTERVAL
            self._ledger(self.ledger.heartbeat, self._heartbeat())
        if measure_queue:
            depth = self.broker.depth()
            if depth is not None:
                self.metrics.queue_depth.set(depth)
            if self.settings.metrics_port and self.database.ready():  # the tenants' token budgets, for the page
                budgets = self._ledger(self.ledger.token_budgets, self.engine.model_name)
                if budgets is not DOWN:
                    self.metrics.set_budgets(budgets)

    def _heartbeat(self) -> Heartbeat:
        kv = self.engine.kv_usage()
        return Heartbeat(self.name, socket.gethostname(), self.engine.model_name,
                         self.engine.settings.resolved_device(), self.engine.num_running, self.engine.num_waiting,
                         kv["blocks_used"], kv["blocks_free"], round(self.metrics.recent_output_rate(), 2),
                         self.started_at, time.time(), self._job_tokens())

    def _job_tokens(self) -> dict[str, int]:
        """Per job, the output tokens its requests running here have made so far: with the finished ones',
        the work done a job's progress and ETA count (``jobs.records.status``)."""
        by_job: dict[str, int] = {}
        for request_id, tokens, _ in self.engine.kv.progress():
            item = self.inflight.get(request_id)
            if item is not None and tokens:
                by_job[item.claim.job_id] = by_job.get(item.claim.job_id, 0) + tokens
        return by_job

    def _look(self, job_ids: set[str], deaths: bool) -> tuple:
        """On the look's thread, what a look asks the database (each answer ``DOWN`` while it does not answer):
        which of ``job_ids`` are closed, the live tenants, and the workers' deaths when due. The loop acts on
        the answers (``_act_on_look``) and steps on meanwhile: on the loop these round trips left the device
        idle 20-50 ms a second (a simulated H200)."""
        closed = self._ledger(self.ledger.closed_jobs, job_ids) if job_ids else set()
        tenants = self._ledger(self.ledger.live_tenants, self.engine.model_name)
        if deaths:
            self.suspects.read_death_rates()
        return closed, tenants

    def _act_on_look(self) -> None:
        """The answers of the look under way, once it has them: closed jobs' requests dropped, tenants followed."""
        if self.looking is None or not self.looking.done():
            return
        future, self.looking = self.looking, None
        closed, tenants = future.result()
        if closed is not DOWN and closed:
            self._drop_closed_jobs(closed)
        if tenants is not DOWN:
            self._follow(tenants)

    def _drop_closed_jobs(self, closed: set[str]) -> None:
        """Abort the requests of jobs cancelled, expired or otherwise closed; ack their messages."""
        for engine_id, item in list(self.inflight.items()):
            if item.claim.job_id in closed and not item.finishing:  # a finishing one is acked once committed
                self.engine.abort(engine_id)
                self.broker.ack(item.delivery)
                del self.inflight[engine_id]
                self.store.finished(engine_id)

    def _follow_tenants(self) -> None:
        """Consume the queue of every tenant with live jobs for this model; set their weights."""
        tenants = self._ledger(self.ledger.live_tenants, self.engine.model_name)
        if tenants is not DOWN:  # the queues already followed stay; new tenants once it is back
            self._follow(tenants)

    def _follow(self, tenants: dict[str, float]) -> None:
        for tenant, weight in tenants.items():
            self.engine.set_tenant_share(tenant, weight)
        self.metrics.follow_tenants(tenants)
        held = {item.claim.tenant for item in self.inflight.values()}
        self.broker.follow(set(tenants) | held)

    def _resize_window(self) -> None:
        if self.settings.prefetch:
            return
        want = admission.prefetch_window(self.engine.settings.max_num_seqs, self.kv_capacity, self.mean_kv_tokens,
                                         int(self.commit_peak))
        self.commit_peak = max(self.committer.pending, 0.9 * self.commit_peak)  # forgets a burst slowly
        if abs(want - self.window) * 8 > self.window and not self.broker.broken:  # not for every small change
            self.broker.set_window(want)

    # ---- stopping
    def _begin_drain(self) -> float:
        log.warning("worker %s stopping: %d requests running, up to %.0f s to finish them; Ctrl-C (SIGINT or "
                    "SIGTERM) again to stop now, handing them back", self.name, len(self.inflight),
                    self.settings.drain_timeout)
        self.broker.cancel()
        self.remote.hand_back()
        self.interactive.close("the server is stopping: try again on another")
        self._hand_back(count_attempt=False, only_unstarted=True)
        return time.monotonic() + self.settings.drain_timeout

    def _hand_back(self, count_attempt: bool, only_unstarted: bool = False) -> None:
        """Abort requests and requeue their messages; a graceful hand-back is no failed attempt."""
        if not only_unstarted:
            self._hand_back_claiming(count_attempt)
        items = [(k, i) for k, i in self.inflight.items() if not (only_unstarted and i.started)]
        if not count_attempt and items:
            try:
                self.ledger.release([i.claim.request_id for _, i in items])
            except Exception:
                log.exception("could not release attempts")
        for engine_id, item in items:
            self.engine.abort(engine_id)
            self.broker.requeue(item.delivery)
            del self.inflight[engine_id]
            self.store.released(engine_id)
        if not only_unstarted:
            for delivery in self.incoming:
                self.broker.requeue(delivery)
            self.incoming.clear()

    def _hand_back_claiming(self, count_attempt: bool) -> None:
        """The deliveries of a claim under way, once it answered: acked where there is nothing to run
        (a result, a closed job), the others requeued (their attempts released)."""
        if self.claiming is None:
            return
        (fresh, future, _), self.claiming = self.claiming, None
        wait_for([future], CLAIM_WAIT)
        claims = future.result()[0] if future.done() and future.exception() is None else DOWN
        claims = {} if claims is DOWN else claims
        done = [delivery for ref, delivery in fresh if admission.judge(
            ref, claims.get(ref.request_id), self.engine.model_name, delivery.tenant).action is Action.SKIP]
        for delivery in done:
            self.broker.ack(delivery)
        back = [ref.request_id for ref, delivery in fresh if delivery not in done and ref.request_id in claims]
        if not count_attempt and back:
            try:
                self.ledger.release(back)
            except Exception:
                log.exception("could not release attempts")
        for _, delivery in fresh:
            if delivery not in done:
                self.broker.requeue(delivery)

    def close(self) -> None:
        """Release what the worker holds (the ledger's process, the broker's connections, the store's
        threads): ``run`` does as it ends; a worker built and never run (``berth run`` of a file refused,
        or of a job already over) is closed by its builder. Once is enough; again does nothing."""
        if self._closed:
            return
        self._closed = True
        if self._claims is not None:
            self._claims.shutdown(wait=False)
            self._claims = None
        if self._looks is not None:  # a look under way ends before the ledger closes
            self._looks.shutdown(wait=True)
            self._looks, self.looking = None, None
        self.engine.on_start = None
        self.store.close(CHECKPOINT_FLUSH)
        self.broker.close()
        self.ledger.close()
