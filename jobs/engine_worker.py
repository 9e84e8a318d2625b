"""Building an engine worker: the engine, the jobs database as its ledger, the door of its interactive
queue, and on the embedded defaults the chores Celery beat would otherwise run. What ``berth worker``
and ``berth run`` start.

Where the engine is built here (``berth worker``), the ledger's side (importing SQLAlchemy, Celery and
the jobs modules, about 0.6 CPU seconds, and opening the database) runs on a thread meanwhile: loading
the model is mostly torch operations that let go of the GIL (reordering the weights for oneDNN), so on a
second core the two overlap. The two import disjoint modules (``worker`` never imports ``jobs``), so
neither waits on the other's import locks. The worker is ready, as before, only once both are done.
"""

from __future__ import annotations

import functools
import threading

from jobs.batch_format import BatchLine, LineError, to_request
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
    ledger_side = LedgerSide(settings)
    if engine is None:
        ledger_side.start()  # beside the model's load
        try:
            engine = Engine(settings)
        except BaseException:
            ledger_side.thread.join()  # not left half way through a migration when the error ends the process
            raise
    JobsLedger, embedded_chores = ledger_side.result()
    ledger = JobsLedger(settings, engine.tokenizer, engine.model_name, eager_tasks)
    worker = EngineWorker(settings, engine, ledger, chores=embedded_chores(settings) if chores else [],
                          interactive=interactive, door=InteractiveDoor(engine, settings))
    return worker


def ledger_modules():
    """What the ledger's side imports (SQLAlchemy, Celery, the jobs modules): ``open_database``, the ledger
    class and the embedded chores' factory. Importing runs nothing: a ``--respawn`` parent calls it to
    import them once, before it forks."""
    from jobs.db import open_database
    from jobs.housekeeping import chores
    from jobs.ledger import JobsLedger

    return open_database, JobsLedger, chores


class LedgerSide:
    """The ledger's imports and the database's opening, on a thread of their own when started, else
    in the caller's when asked for; errors (a database at another migration, unreachable) are raised
    to the caller as they would have been without the thread."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.thread: threading.Thread | None = None
        self.value = self.error = None

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name="berth-ledger-start", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            open_database, JobsLedger, chores = ledger_modules()
            open_database(self.settings.database_url)  # one per process: the ledger's is this one
            self.value = JobsLedger, chores
        except BaseException as exc:  # noqa: BLE001 (raised again in the caller's thread)
            self.error = exc

    def result(self):
        """(the ledger class, the embedded chores' factory), once imported and the database opened."""
        if self.thread is None:
            self._run()
        else:
            self.thread.join()
        if self.error is not None:
            raise self.error
        return self.value


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
