"""In-memory stand-ins for the engine worker's parts: the ledger (the jobs database), the broker link
and the engine, so that admission, poison and outage logic run in milliseconds with no server."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from worker.consumer.ledger import Claim, LedgerDown, Outcome
from worker.consumer.queues import request_body
from worker.engine.engine import EngineStats, RequestRejected
from worker.engine.request import Completion, Request, RequestOutput, SamplingParams

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
    checkpoint: str | None = None  # where its latest checkpointed state is (``Ledger.checkpointed``)


class FakeLedger:
    def __init__(self):
        self.rows: dict[int, Row] = {}
        self.down = False
        self.events: list[tuple] = []  # ("record", ids) ... in call order, shared with the broker's acks
        self.beats: list = []

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
            out[rid] = Claim(rid, row.job_id, row.model, row.tenant, 0, row.prompt, row.params,
                             row.outcome is None and row.job_live, row.attempts,
                             crashed=row.holder is not None and row.started, progress=row.progress,
                             strikes=row.strikes, last_error=row.last_error, checkpoint=row.checkpoint)
            row.holder, row.started = worker, False
        return out

    def started(self, request_ids):
        self._check()
        for rid in request_ids:
            self.rows[rid].started = True

    def begin(self, baselines):
        self._check()
        for rid, (tokens, strikes) in baselines.items():
            self.rows[rid].progress, self.rows[rid].strikes = tokens, strikes

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

    def heartbeat(self, beat):
        self._check()
        self.beats.append(beat)

    def crash(self, request_id: int, worker: str = "dead-host:1") -> None:
        """As a worker that died while an engine step ran the request leaves its row."""
        row = self.rows[request_id]
        row.holder, row.started = worker, True


class FakeMessage:
    def __init__(self, broker, channel):
        self.broker, self.channel, self.acknowledged = broker, channel, False


@dataclass(eq=False)
class FakeDelivery:
    body: bytes
    content_type: str | None
    content_encoding: str | None
    redelivered: bool
    tenant: str | None
    message: FakeMessage

    def decode(self):
        if self.content_type != "application/json":
            raise ValueError(f"content type {self.content_type!r} refused")
        return json.loads(self.body)


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

    def maintain(self):
        return not self.broken

    def follow(self, tenants):
        self.queues = {t: t for t in tenants}

    def receive(self, limit, timeout):
        taken, self.ready = self.ready[:max(limit, 0)], self.ready[max(limit, 0):]
        return [FakeDelivery(body, ctype, None, False, tenant, FakeMessage(self, self.channel))
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


class FakeEngine:
    """One token a step for every request; a request whose prompt holds ``crash_token`` makes the
    step fail it (as the engine's blast radius does); ``rejected_token`` is refused at admission."""

    model_name = MODEL

    def __init__(self, settings, crash_token: int | None = None, rejected_token: int | None = None):
        self.settings = settings
        self.crash_token, self.rejected_token = crash_token, rejected_token
        self.requests: dict[str, Request] = {}
        self.tokens: dict[str, list[int]] = {}
        self.stats = EngineStats()
        self.on_start = None
        self.shares: dict[str, float] = {}

    def add_request(self, request: Request) -> None:
        if self.rejected_token in request.prompt_token_ids:
            raise RequestRejected("refused by the fake engine")
        self.requests[request.request_id] = request
        self.tokens[request.request_id] = [list(o) for o in request.resume_output_ids] or [[]]

    def abort(self, request_id: str) -> bool:
        return self.requests.pop(request_id, None) is not None

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    num_running = num_unfinished
    num_waiting = 0

    def set_tenant_share(self, tenant, share):
        self.shares[tenant] = share

    def kv_usage(self) -> dict:
        return {"blocks_used": 0, "blocks_free": 100, "blocks_total": 100, "kv_bytes": 0, "slot_utilization": 1.0}

    def step(self) -> list[RequestOutput]:
        fresh = [r for r in self.requests.values() if not r.started]
        for r in fresh:
            r.started = True
        if fresh and self.on_start is not None:
            self.on_start([r.request_id for r in fresh])
        outputs = []
        for rid, request in list(self.requests.items()):
            if self.crash_token in request.prompt_token_ids:
                del self.requests[rid]
                outputs.append(RequestOutput(rid, request.prompt_token_ids, [], error="RuntimeError: injected"))
                continue
            out = self.tokens[rid][0]
            out.append(7)
            self.stats.output_tokens += 1
            if len(out) >= request.params.max_tokens:
                del self.requests[rid]
                outputs.append(RequestOutput(rid, request.prompt_token_ids,
                                             [Completion(0, list(out), "x" * len(out), "length")]))
        return outputs
