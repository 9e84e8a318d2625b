"""Building an engine worker: the engine, the jobs database as its ledger, its interactive queue's
consumer, and on the embedded defaults the chores Celery beat would otherwise run. What ``berth worker``
and ``berth run`` start. The ledger's side is imported and opened on a thread while the model loads, and
the ledger's process (``worker.consumer.ledger_process``: its calls answered off the loop's GIL) started
from there; the worker is ready once both are done (docs/operations.md).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from worker.config import Settings
from worker.engine.engine import Engine

if TYPE_CHECKING:
    from worker.consumer.interactive_inbox import InteractiveInbox
    from worker.consumer.loop import EngineWorker


def engine_worker(settings: Settings, engine: Engine | None = None, eager_tasks: bool | None = None,
                  chores: bool = True, interactive: InteractiveInbox | None = None,
                  checks_lines: bool = False) -> EngineWorker:
    """``eager_tasks``: run finalize tasks in this process (default: when the broker is embedded);
    ``chores``: on the embedded defaults, reconcile, expire and collect garbage on a thread of its own;
    ``interactive``: live callers' requests beside the queue's (``berth serve`` on the embedded defaults);
    ``checks_lines``: this process ingests a job too (``berth run``): the line checks' model facts
    (``jobs.lines.validate.model_info``: the tokenizer read, the chat template compiled) are read beside
    the model's load, not before the job's first chunk, which the worker waits for.
    With RabbitMQ and ``interactive_prefetch`` > 0 the worker also answers the model's interactive queue."""
    ledger_side = LedgerSide(settings, checks_lines, engine.model_path if engine else None, eager_tasks)
    if engine is None:
        ledger_side.start()  # beside the model's load
        try:
            engine = Engine(settings)
        except BaseException:
            ledger_side.thread.join()  # not left half way through a migration when the error ends the process
            ledger_side.close()
            raise
    modules = ledger_side.result()
    return modules.EngineWorker(settings, engine, ledger_side.ledger, chores=modules.chores(settings) if chores else [],
                                interactive=interactive, door=modules.InteractiveDoor(engine, settings))


LEDGER_MODULE = "jobs.hosting.database_ledger"  # the ledger's recipe, which its process imports as it starts


class LedgerModules(NamedTuple):
    open_database: Callable
    LedgerRecipe: type  # the jobs ledger, as its process builds it
    LedgerProcess: type
    chores: Callable  # the embedded chores' factory
    EngineWorker: type
    InteractiveDoor: type


def ledger_modules() -> LedgerModules:
    """What the worker imports beside the engine (SQLAlchemy, Celery, kombu, the jobs modules, the
    consumer's): ``open_database``, the ledger class, the embedded chores' factory, the worker's loop and
    its interactive door. Importing runs nothing: a ``--respawn`` parent calls it to import them once,
    before it forks."""
    from jobs.hosting.chores import chores
    from jobs.hosting.database_ledger import LedgerRecipe
    from jobs.hosting.interactive_check import InteractiveDoor
    from jobs.records.db import open_database
    from worker.consumer.ledger_process import LedgerProcess
    from worker.consumer.loop import EngineWorker

    return LedgerModules(open_database, LedgerRecipe, LedgerProcess, chores, EngineWorker, InteractiveDoor)


class LedgerSide:
    """The worker's imports beside the engine, the database's opening (and the line checks' model facts
    when asked) and then the ledger's process, on a thread of their own when started, else in the
    caller's when asked for; errors (a database at another migration, unreachable) are raised to the
    caller as they would have been without the thread. ``model_path``: the model whose tokenizer the
    ledger reads (default: the settings')."""

    def __init__(self, settings: Settings, checks_lines: bool = False, model_path: str | None = None,
                 eager_tasks: bool | None = None):
        self.settings, self.checks_lines = settings, checks_lines
        self.model_path, self.eager_tasks = model_path, eager_tasks
        self.thread: threading.Thread | None = None
        self.value: LedgerModules | None = None
        self.ledger = None  # the ledger's process, once started
        self.error: BaseException | None = None

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name="berth-ledger-start", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        from worker.consumer.ledger_process import LedgerChild

        child = None
        try:
            child = LedgerChild(LEDGER_MODULE)  # first: its imports run beside ours and the database's opening
            modules = ledger_modules()
            modules.open_database(self.settings.database_url)  # one per process: the ledger's is this one
            if self.checks_lines:
                from jobs.lines.validate import model_info

                model_info(self.settings)  # kept for the process: the ingest's validator takes it from there
            settings = self.settings
            self.ledger = modules.LedgerProcess(modules.LedgerRecipe(
                settings, self.model_path or settings.model_path(), settings.served_model_name(), self.eager_tasks),
                child)
            self.value = modules
        except BaseException as exc:  # noqa: BLE001 (raised again in the caller's thread)
            if child is not None and self.ledger is None:
                child.close()
            self.error = exc

    def close(self) -> None:
        """End the ledger's process, if started (the worker was not built)."""
        if self.ledger is not None:
            self.ledger.close()

    def result(self) -> LedgerModules:
        """The modules' classes and functions, once imported and the database opened."""
        if self.thread is None:
            self._run()
        else:
            self.thread.join()
        if self.error is not None:
            raise self.error
        return self.value
