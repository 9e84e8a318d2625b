"""Building an engine worker: the engine, the jobs database as its ledger, the door of its interactive
queue, and on the embedded defaults the chores Celery beat would otherwise run. What ``berth worker``
and ``berth run`` start."""

from __future__ import annotations

import functools

from jobs.batch_format import BatchLine, LineError, to_request
from jobs.ledger import JobsLedger
from jobs.validate import ModelInfo
from worker.config import Settings
from worker.consumer.interactive import InteractiveInbox
from worker.consumer.interactive_queue import Refused
from worker.consumer.loop import EngineWorker
from worker.engine.engine import Engine
from worker.engine.request import Request


def engine_worker(settings: Settings, engine: Engine | None = None, eager_tasks: bool | None = None,
                  chores: bool = True, interactive: InteractiveInbox | None = None) -> EngineWorker:
    """``eager_tasks``: run finalize tasks in this process (default: when the broker is embedded);
    ``chores``: on the embedded defaults, reconcile, expire and collect garbage on a thread of its own;
    ``interactive``: live callers' requests beside the queue's (``berth serve`` on the embedded defaults).
    With RabbitMQ and ``interactive_prefetch`` > 0 the worker also answers the model's interactive queue."""
    from jobs.housekeeping import chores as embedded_chores

    engine = engine or Engine(settings)
    ledger = JobsLedger(settings, engine.tokenizer, engine.model_name, eager_tasks)
    worker = EngineWorker(settings, engine, ledger, chores=embedded_chores(settings) if chores else [],
                          interactive=interactive, door=InteractiveDoor(engine, settings))
    return worker


class InteractiveDoor:
    """An interactive queue's message to an engine request, checked by the batch lines' own front door
    (``to_request``) against this worker's engine, as ``berth serve`` checked it before publishing:
    any producer with broker access can publish, so the worker never takes the server's word for it."""

    def __init__(self, engine: Engine, settings: Settings):
        self.engine, self.settings = engine, settings

    @functools.cached_property
    def info(self) -> ModelInfo:
        return ModelInfo.of_engine(self.engine, self.settings)

    def __call__(self, url: str, body: dict, request_id: str, tenant: str) -> Request:
        info = self.info
        line = BatchLine(1, "request", url, body)
        try:
            return to_request(line, info.tokenizer, info.name, info.max_model_len, request_id=request_id,
                              tenant=tenant, vocab_size=info.vocab_size, structured_limits=info.structured_limits,
                              hidden_size=info.hidden_size)
        except LineError as exc:
            param = exc.param.removeprefix("body.") if exc.param else None
            raise Refused(f"{param}: {exc.message}" if param else exc.message, "invalid_request") from None
