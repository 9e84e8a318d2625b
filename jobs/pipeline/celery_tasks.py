"""The work around the engine as Celery tasks: ingest, finalize, reconcile, expire, raising at-risk
events, checkpoint collection. With a broker they run on a Celery worker with beat:

    celery -A jobs.pipeline.celery_tasks worker --beat --loglevel=INFO

On the embedded defaults they run in the calling process, the periodic ones on the engine workers'
housekeeping thread. Tasks are acked late and idempotent (docs/jobs.md).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from celery import Celery

from jobs.pipeline import ingest_threads
from jobs.pipeline.finalize import finalize
from jobs.pipeline.ingest import ingest
from jobs.pipeline.reconcile import INGEST_SILENCE_SECONDS, Reconciled, reconcile
from jobs.records.db import open_database
from jobs.records.file_removal import expire_files
from jobs.records.job_files import JobFiles
from jobs.records.lifecycle import expire_due
from jobs.records.outbox import prune_events, raise_at_risk
from storage import open_store
from worker.config import Settings
from worker.messaging.topology import Topology, is_embedded

INGEST, FINALIZE, RECONCILE, EXPIRE = "berth.ingest", "berth.finalize", "berth.reconcile", "berth.expire"
CHECKPOINT_GC = "berth.checkpoint_gc"
EXPIRE_FILES = "berth.expire_files"  # files past their expires_at (OpenAI's expires_after, output_expires_after)
AT_RISK = "berth.at_risk"  # live jobs newly expected to finish after their window: their at-risk events
log = logging.getLogger("berth.tasks")

PERIOD_SECONDS = 60.0
AT_RISK_PERIOD_SECONDS = 15.0  # an at-risk event comes well before the window ends: 5% of a 15-minute one is 45 s
CHECKPOINT_GC_PERIOD_SECONDS = 600.0


def make_app(settings: Settings, eager: bool | None = None) -> Celery:
    """The Celery app for ``settings``; ``eager`` (default: the broker is embedded) runs tasks in-process."""
    app = Celery("berth", set_as_current=False)
    app.conf.update(
        broker_url=settings.broker_url or "memory://localhost/",  # unused: eager
        task_always_eager=is_embedded(settings) if eager is None else eager,
        task_eager_propagates=True, task_default_queue=Topology(settings.queue_prefix).celery_queue,
        task_ignore_result=True, task_acks_late=True, task_reject_on_worker_lost=True, worker_prefetch_multiplier=1,
        task_serializer="json", accept_content=["json"], broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        beat_schedule={"reconcile": {"task": RECONCILE, "schedule": PERIOD_SECONDS},
                       "expire": {"task": EXPIRE, "schedule": PERIOD_SECONDS},
                       "at_risk": {"task": AT_RISK, "schedule": AT_RISK_PERIOD_SECONDS},
                       "checkpoint_gc": {"task": CHECKPOINT_GC, "schedule": CHECKPOINT_GC_PERIOD_SECONDS},
                       "expire_files": {"task": EXPIRE_FILES, "schedule": PERIOD_SECONDS}})

    def db():
        return open_database(settings.database_url)

    @app.task(name=INGEST, shared=False)
    def ingest_job(job_id: str) -> None:
        try:
            ingest_then_finalize(app, settings, job_id)
        except Exception:
            log.exception("the ingest of job %s stopped; it resumes after its last stored line once it has "
                          "been silent for %.0f s (the reconciler)", job_id, INGEST_SILENCE_SECONDS)

    @app.task(name=FINALIZE, shared=False)
    def finalize_job(job_id: str) -> None:
        finalize(db(), JobFiles(settings.storage_url), job_id)

    @app.task(name=RECONCILE, shared=False)
    def reconcile_jobs() -> None:
        dispatch(app, reconcile(db(), settings), aside=bool(app.conf.task_always_eager))
        prune_events(db(), settings.event_keep_seconds)

    @app.task(name=EXPIRE, shared=False)
    def expire_jobs() -> None:
        finalize_later(app, expire_due(db()))

    @app.task(name=AT_RISK, shared=False)
    def raise_at_risk_events() -> None:
        for job_id in raise_at_risk(db()):
            log.info("job %s is at risk: expected to finish after its window ends (its at-risk event is raised)",
                     job_id)

    @app.task(name=EXPIRE_FILES, shared=False)
    def expire_stored_files() -> None:
        expire_files(db(), open_store(settings.storage_url), input_retention=settings.job_input_retention_seconds)

    @app.task(name=CHECKPOINT_GC, shared=False)
    def collect_checkpoint_garbage() -> None:
        from jobs.pipeline.checkpoint_gc import (
            collect_checkpoints,  # reads checkpoints with torch: not at every `berth cancel`
        )

        collect_checkpoints(open_store(settings.storage_url), db(), settings.checkpoint_gc_min_age)

    return app


def finalize_later(app: Celery, job_ids: list[str]) -> None:
    """Dispatch the finalize task of each job (run now, when the app is eager)."""
    for job_id in job_ids:
        app.tasks[FINALIZE].delay(job_id)


def ingest_later(app: Celery, job_ids: list[str]) -> None:
    """Dispatch the ingest task of each job (run now, when the app is eager)."""
    for job_id in job_ids:
        app.tasks[INGEST].delay(job_id)


def ingest_then_finalize(app: Celery, settings: Settings, job_id: str, stop: Callable[[], bool] | None = None,
                         published: Callable[[], None] | None = None) -> None:
    """The ingest task's work, raising what stopped it: the job's lines stored and published
    (``jobs.pipeline.ingest``, with its ``stop`` and ``published``), then the finalize of the jobs it made ready."""
    finalize_later(app, ingest(open_database(settings.database_url), JobFiles(settings.storage_url), settings,
                               job_id, stop, published))


def ingest_aside(app: Celery, job_ids: list[str]) -> list[threading.Thread]:
    """Run the ingest task of each job on a thread of its own (``jobs.pipeline.ingest_threads``), and return
    at once: the threads started. A job whose ingest already runs on such a thread here is not started
    twice. The task logs what stops an ingest; the reconciler runs it again."""
    started = []
    for job_id in job_ids:
        aside, new = ingest_threads.start(job_id, lambda _aside, job=job_id: app.tasks[INGEST].delay(job))
        if new:
            started.append(aside.thread)
    return started


def ingest_beside(app: Celery, settings: Settings, job_id: str) -> ingest_threads.IngestAside:
    """The job's ingest on a thread of its own, for a caller that works the job in this process
    (``berth run``): what stops it is kept on the handle, not logged, for the caller to raise, the
    handle's ``published`` is set once its first messages are out, and its ``stop`` stops it between chunks.
    ``app`` (eager) runs the finalize it makes ready. The ingest already running here for the job, if any,
    instead (the reconciler's: it logs its own errors, and neither stops nor says what it published)."""
    aside, _ = ingest_threads.start(job_id, lambda handle: ingest_then_finalize(
        app, settings, job_id, handle.stopping.is_set, handle.published.set))
    return aside


def dispatch(app: Celery, reconciled: Reconciled, aside: bool = False) -> None:
    """Run what the reconciler found: the finalize of jobs left closing, the ingest of silent ones
    (``aside``: each on a thread of its own, not waited for; an eager app would run it here)."""
    finalize_later(app, reconciled.finalize)
    if aside:
        ingest_aside(app, reconciled.ingest)
    else:
        ingest_later(app, reconciled.ingest)


app = make_app(Settings())  # what `celery -A jobs.pipeline.celery_tasks` runs: configured from the environment
