"""Building an engine worker: the engine, the jobs database as its ledger, and on the embedded
defaults the chores Celery beat would otherwise run. What ``berth worker`` and ``berth run`` start."""

from __future__ import annotations

from jobs.ledger import JobsLedger
from worker.config import Settings
from worker.consumer.interactive import InteractiveInbox
from worker.consumer.loop import EngineWorker
from worker.engine.engine import Engine


def engine_worker(settings: Settings, engine: Engine | None = None, eager_tasks: bool | None = None,
                  chores: bool = True, interactive: InteractiveInbox | None = None) -> EngineWorker:
    """``eager_tasks``: run finalize tasks in this process (default: when the broker is embedded);
    ``chores``: on the embedded defaults, reconcile, expire and collect garbage on a thread of its own;
    ``interactive``: live callers' requests beside the queue's (``berth serve`` on the embedded defaults)."""
    from jobs.housekeeping import chores as embedded_chores

    engine = engine or Engine(settings)
    ledger = JobsLedger(settings, engine.tokenizer, engine.model_name, eager_tasks)
    worker = EngineWorker(settings, engine, ledger, chores=embedded_chores(settings) if chores else [],
                          interactive=interactive)
    return worker
