"""In-memory stand-ins for the engine worker's parts: the ledger (the jobs database), the broker link
and the engine, so that admission, poison and outage logic run in milliseconds with no server."""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass, field

import worker.consumer.loop as consumer
from worker.config import Settings
from worker.consumer.broker import Delivery
from worker.consumer.ledger import Claim, Death, LedgerDown, Outcome
from worker.engine.engine import EngineStats, RequestRejected, StepLatencies
from worker.engine.request import Completion, Request, RequestOutput, SamplingParams, Sequence
from worker.messaging.topology import request_body

MODEL = "m"


@dataclass
class Row:
    job_id: str
    tenant: str = "default"
    prompt: list[int] = field(default_factory=lambda: [1, 2, 3])
    params: SamplingParams = field(default_factory=lambda: SamplingParams(max_tokens=3, temperature=0))
    model: str = MODEL
    job_live: bool = True
    attempts: int = 0
    holder: str | None = None
    started: bool = False
    progress: int = 0
    strikes: int = 0
    last_error: str | None = None
    outcome: Outcome | None = None
    suspect: int = 0
    holder_life: str | None = None
    checkpoint: str | None = None  # where its latest checkpointed state is (``Ledger.checkpointed``)


class FakeLedger:
    def __init__(self):
        self.rows: dict[int, Row] = {}
        self.down = False
        self.events: list[tuple] = []  # ("record", ids) ... in call order, shared with the broker's acks
        self.beats: list = []
        self.lives: Counter[str] = Counter()  # worker name -> its lives that died (``died``)
        self.deaths: dict[str, Death] = {}  # life -> its death, as claims found it

    def _check(self):
        if self.down:
            raise LedgerDown("the database is down")

    def claim(self, request_ids, worker):
        self._check()
        out = {}
        for rid in request_ids:
            row = self.rows.get(rid)
            if row is None:
                continue
            row.attempts += 1
            crashed = row.holder is not None and row.started
            death = self._death(row) if crashed else None
            out[rid] = Claim(rid, row.job_id, row.model, row.tenant, 0, row.prompt, row.params,
                             row.outcome is None and row.job_live, row.attempts,
                             crashed=crashed, progress=row.progress,
                             strikes=row.strikes, last_error=row.last_error, suspect=row.suspect, death=death,
                             checkpoint=row.checkpoint)
        for rid in request_ids:
            if rid in self.rows:
                row = self.rows[rid]
                row.holder, row.started, row.holder_life = worker, False, f"{worker}/{self.lives[worker]}"
        return out

    def _death(self, row: Row) -> Death:
        """As ``jobs.records.workers.found_dead``: the first claim to find a death counts what it was running."""
        life = row.holder_life or row.holder
        if life not in self.deaths:
            running = sum(1 for r in self.rows.values()
                          if (r.holder_life or r.holder) == life and r.started and r.outcome is None)
            self.deaths[life] = Death(len(self.deaths) + 1, row.holder, max(1, running), time.time())
        return self.deaths[life]

    def died(self, worker: str) -> None:
        """The worker process named so died: its next claims are another life."""
        self.lives[worker] += 1

    def running(self, worker: str) -> set[int]:
        """What a death of ``worker`` now would be charged to: its rows an engine step ran, without outcome."""
        return {rid for rid, r in self.rows.items() if r.holder == worker and r.started and r.outcome is None}

    def suspect(self, classes):
        self._check()
        for rid, k in classes.items():
            self.rows[rid].suspect = k

    def paused(self, request_ids, starting=()):
        self._check()
        for rid in request_ids:
            self.rows[rid].started = False
        for rid in starting:
            self.rows[rid].started = True

    def cleared(self, request_ids):
        self._check()
        for rid in request_ids:
            self.rows[rid].started, self.rows[rid].suspect = False, 0

    def worker_deaths(self, window):
        self._check()
        t = time.time()
        return dict(Counter(d.worker.rpartition(":")[0] for d in self.deaths.values() if d.at >= t - window))

    def started(self, request_ids):
        self._check()
        for rid in request_ids:
            self.rows[rid].started = True

    def begin(self, baselines, started=()):
        self._check()
        for rid, (tokens, strikes) in baselines.items():
            self.rows[rid].progress, self.rows[rid].strikes = tokens, strikes
        for rid in started:
            self.rows[rid].started = True

    def release(self, request_ids):
        for rid in request_ids:
            self.rows[rid].attempts -= 1
            self.rows[rid].holder = None

    def checkpointed(self, refs, worker):
        self._check()
        for rid, ref in refs.items():
            if rid in self.rows and self.rows[rid].holder == worker:
                self.rows[rid].checkpoint = ref

    def note_error(self, request_id, error):
        self.rows[request_id].last_error = error

    def record(self, outcomes, worker):
        self._check()
        new = set()
        for o in outcomes:
            row = self.rows[o.request_id]
            if row.outcome is None:
                row.outcome = o
                row.holder = None
                new.add(o.request_id)
        self.events.append(("record", sorted(o.request_id for o in outcomes)))
        return new

    def closed_jobs(self, job_ids):
        self._check()
        return {r.job_id for r in self.rows.values() if r.job_id in job_ids and not r.job_live}

    def live_tenants(self, model):
        self._check()
        return {r.tenant: 1.0 for r in self.rows.values() if r.job_live and r.model == model}

    def token_budgets(self, model):
        self._check()
        return {}

    def heartbeat(self, beat):
        self._check()
        self.beats.append(beat)

    def close(self):
        self.closed = True

    def crash(self, request_id: int, worker: str = "dead-host:1") -> None:
        """As a worker that died while an engine step ran the request leaves its row."""
        row = self.rows[request_id]
        row.holder, row.started, row.holder_life = worker, True, f"{worker}/{self.lives[worker]}"


class FakeMessage:
    def __init__(self, broker, channel):
        self.broker, self.channel, self.acknowledged = broker, channel, False


class FakeBroker:
    """The broker link's calls, over a list of messages; a channel number that a reconnect bumps."""

    def __init__(self, ledger: FakeLedger):
        self.ledger = ledger
        self.ready: list[tuple[bytes, str | None, str | None]] = []  # (body, content type, tenant)
        self.channel = 0
        self.broken = False
        self.window = 1
        self.queues: dict[str, object] = {}
        self.acked: list[bytes] = []
        self.requeued: list[bytes] = []
        self.dead: list[tuple[bytes, str]] = []
        self.dead_letter_fails = False

    def publish(self, body, content_type="application/json", tenant="default") -> None:
        self.ready.append((body if isinstance(body, bytes) else json.dumps(body).encode(), content_type, tenant))

    def publish_request(self, request_id: int, job_id: str, tenant="default") -> None:
        self.publish(request_body(request_id, job_id), tenant=tenant)

    def connect(self, max_retries=None):
        self.broken = False

    def start(self):
        self.connect()

    def maintain(self):
        return not self.broken

    def follow(self, tenants):
        self.queues = {t: t for t in tenants}

    def receive(self, limit, timeout):
        taken, self.ready = self.ready[:max(limit, 0)], self.ready[max(limit, 0):]
        if not taken and timeout:
            time.sleep(timeout)  # as a broker's drain_events waits for the first delivery
        return [Delivery(body, ctype, None, False, tenant, FakeMessage(self, self.channel))
                for body, ctype, tenant in taken]

    def is_current(self, delivery):
        m = delivery.message if delivery is not None else None
        return m is not None and not self.broken and m.channel == self.channel and not m.acknowledged

    def ack(self, delivery):
        if self.is_current(delivery):
            delivery.message.acknowledged = True
            self.acked.append(delivery.body)
            try:
                request_id = json.loads(delivery.body).get("request_id")
            except (ValueError, AttributeError):
                request_id = None
            self.ledger.events.append(("ack", request_id, delivery.body))

    def ack_all(self, deliveries):
        for delivery in deliveries:
            self.ack(delivery)

    def requeue(self, delivery):
        if self.is_current(delivery):
            delivery.message.acknowledged = True
            self.requeued.append(delivery.body)

    def dead_letter(self, delivery, reason, strikes=0):
        if self.dead_letter_fails:
            return False
        self.dead.append((delivery.body, reason))
        self.ack(delivery)
        return True

    def set_window(self, window):
        self.window = window

    def depth(self):
        return len(self.ready)

    def heartbeat(self):
        pass

    def cancel(self):
        pass

    def close(self):
        pass


class WorkerKilled(BaseException):
    """The worker process dies here (no ``except Exception`` catches it): nothing more runs in it."""


class FakeEngine:
    """One token a step for every request; a request whose prompt holds ``crash_token`` makes the
    step fail it (as the engine's blast radius does); ``rejected_token`` is refused at admission; a
    step running a request whose prompt holds ``kill_token`` kills the worker (``WorkerKilled``).
    While a request marked ``isolated`` is in it, only isolated ones step, as the engine does.
    ``batches``: the request ids of each step; ``on_batch(ids)`` is called before each step runs."""

    model_name = MODEL

    def __init__(self, settings, crash_token: int | None = None, rejected_token: int | None = None,
                 kill_token: int | None = None, on_batch=None):
        self.settings = settings
        self.crash_token, self.rejected_token, self.kill_token = crash_token, rejected_token, kill_token
        self.requests: dict[str, Request] = {}
        self.tokens: dict[str, list[int]] = {}
        self.stats = EngineStats()
        self.latencies = StepLatencies()  # what a step measured: none here
        self.on_start = None
        self.shares: dict[str, float] = {}
        self.batches: list[set[str]] = []
        self.on_batch = on_batch

    def add_request(self, request: Request) -> None:
        if self.rejected_token in request.prompt_token_ids:
            raise RequestRejected("refused by the fake engine")
        self.requests[request.request_id] = request
        self.tokens[request.request_id] = [list(o) for o in request.resume_output_ids] or [[]]
        prompt = list(request.prompt_token_ids)
        request.sequences = [Sequence(request, 0, prompt + self.tokens[request.request_id][0], len(prompt))]

    def abort(self, request_id: str) -> bool:
        return self.requests.pop(request_id, None) is not None

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def queued_to_start(self) -> list[str]:
        return [rid for rid, r in self.requests.items() if not r.started and not r.isolated]

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    num_running = num_unfinished
    num_waiting = 0

    def set_tenant_share(self, tenant, share):
        self.shares[tenant] = share

    def release(self, request_id):
        if request_id in self.requests:
            self.requests[request_id].isolated = False

    def kv_usage(self) -> dict:
        return {"blocks_used": 0, "blocks_free": 100, "blocks_total": 100, "kv_bytes": 0, "slot_utilization": 1.0}

    @property
    def kv(self) -> FakeEngine:
        """The KV view's ``progress`` (the engine's ``KVView``), all this fake has of one."""
        return self

    def progress(self):
        for request_id, tokens in self.tokens.items():
            yield request_id, sum(map(len, tokens)), True

    def step(self) -> list[RequestOutput]:
        isolated = any(r.isolated for r in self.requests.values())
        batch = {rid: r for rid, r in self.requests.items() if r.isolated or not isolated}
        fresh = [r for r in batch.values() if not r.started]
        for r in fresh:
            r.started = True
        if fresh and self.on_start is not None:
            self.on_start([r.request_id for r in fresh])
        self.batches.append(set(batch))
        if self.on_batch is not None:
            self.on_batch(set(batch))
        if any(self.kill_token in r.prompt_token_ids for r in batch.values()):
            raise WorkerKilled(f"killed running {sorted(batch)}")
        outputs = []
        for rid, request in list(batch.items()):
            if self.crash_token in request.prompt_token_ids:
                del self.requests[rid]
                outputs.append(RequestOutput(rid, request.prompt_token_ids, [], error="RuntimeError: injected"))
                continue
            out = self.tokens[rid][0]
            out.append(7)
            seq = request.sequences[0]
            seq.token_ids.append(7)
            seq.num_computed_tokens = len(seq.token_ids) - 1
            self.stats.output_tokens += 1
            if len(out) >= request.params.max_tokens:
                del self.requests[rid]
                seq.num_computed_tokens = 0  # its KV blocks freed, as the engine's block manager does
                outputs.append(RequestOutput(rid, request.prompt_token_ids,
                                             [Completion(0, list(out), "x" * len(out), "length")]))
        return outputs


def make_worker(ledger, broker, engine=None, **settings):
    s = Settings(checkpoint_interval=0, **settings)
    return consumer.EngineWorker(s, engine or FakeEngine(s), ledger, broker=broker)


def run_until_done(worker, ledger, ids, limit=2000, hook=None):
    calls = [0]

    def until() -> bool:
        calls[0] += 1
        assert calls[0] < limit, "the worker did not finish"
        if hook is not None:
            hook(calls[0])
        return all(ledger.rows[i].outcome is not None for i in ids) and not worker.inflight

    worker.run(until=until)


class FakeInteractiveBroker(FakeBroker):
    """``FakeBroker`` with a model's interactive queue as RabbitMQ runs it: a consumer takes messages
    while it has fewer unacked than its prefetch (set when it starts), an ack frees a place, a
    requeued message goes back to the head of the queue, a cancelled consumer takes none. Each reply
    is kept with the time it was published: ``replies[correlation_id]`` is a list of
    (seconds, seq, events)."""

    def __init__(self, ledger: FakeLedger, interactive_prefetch: int = 8):
        from worker.messaging.topology import Topology

        super().__init__(ledger)
        self.topology = Topology("test")
        self.interactive_prefetch = interactive_prefetch
        self.interactive_ready: list[bytes] = []
        self.consumer_prefetch = interactive_prefetch  # of the consumer now, as it started
        self.interactive_paused = False
        self.unacked: list[FakeMessage] = []  # interactive messages delivered and neither acked nor requeued
        self.aborts: list[str] = []
        self.replies: dict[str, list[tuple[float, int, list]]] = {}
        self.most_unacked = 0
        self.consumer = 0  # the consumer now: a new one each time it starts again
        self.on_reply = lambda: None  # called at each reply (on the loop's thread)

    def publish_interactive(self, request_id: str, body: dict, tenant: str = "default",
                            url: str = "/v1/chat/completions") -> None:
        from worker.consumer.interactive_queue import message_body

        self.interactive_ready.append(message_body(request_id, tenant, url, body))

    def receive(self, limit, timeout):
        return super().receive(limit, 0)  # interactive deliveries are taken by ``take_interactive``

    def take_interactive(self):
        out = []
        while (self.interactive_ready and not self.interactive_paused
               and sum(m.consumer == self.consumer for m in self.unacked if not m.acknowledged)
               < self.consumer_prefetch):
            body = self.interactive_ready.pop(0)
            message = FakeMessage(self, self.channel)
            message.body, message.consumer = body, self.consumer
            self.unacked.append(message)
            request_id = json.loads(body)["request_id"]
            out.append(Delivery(body, "application/json", "utf-8", False, None, message,
                                "amq.rabbitmq.reply-to.test", request_id))
        self.unacked = [m for m in self.unacked if not m.acknowledged]
        self.most_unacked = max(self.most_unacked, len(self.unacked))
        aborts, self.aborts = self.aborts, []
        return out, aborts

    def interactive_room(self, room: int) -> None:
        if room <= 0:
            self.interactive_paused = True
        elif self.interactive_paused:
            self.interactive_paused, self.consumer_prefetch = False, min(room, self.interactive_prefetch)
            self.consumer += 1

    def requeue(self, delivery):
        if self.is_current(delivery) and delivery.reply_to is not None:
            delivery.message.acknowledged = True
            self.interactive_ready.insert(0, delivery.body)
            return
        super().requeue(delivery)

    def reply(self, reply_to, correlation_id, body) -> bool:
        from worker.consumer.interactive_queue import read_reply

        seq, events = read_reply(body)
        self.replies.setdefault(correlation_id, []).append((time.monotonic(), seq, events))
        self.on_reply()
        return True

    def cancel(self):
        self.interactive_paused = True
