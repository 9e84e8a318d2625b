"""A job worked to its end in this process by an engine worker of its own: `berth run`'s path
(``jobs.api.run``), and what ``benchmarks/job_path.py`` measures of it.

The job's ingest runs on a thread beside the worker (``jobs.pipeline.celery_tasks.ingest_beside``), the
worker consuming each chunk's requests as soon as they are published: at a GPU's pace the ingest of a
file is a second or so of a run of a few, which the device no longer waits for. The worker runs the
requests of a job still ``validating`` as any worker of a fleet does, and the ingest and the results
meet in the database as they do there (docs/jobs.md): nothing is lost or run twice.

- An ingest that fails the job (no valid line, an unreadable file, the tenant's token limit) ends it,
  and the worker stops at its next look at the job (``work``'s ``until``, about every second).
- An ingest that stops on an error (the database, the store, the broker) ends ``work`` with that error
  at the worker's next look, the job left ``validating`` with what it stored and published.
- A worker stopped by SIGINT or SIGTERM stops the ingest before its next chunk: the job is left
  ``validating`` with its lines so far, and the same `berth run` goes on with it (``api.unfinished_run``,
  then ``resume``), its ingest after the last stored line, at once.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from jobs.pipeline.celery_tasks import ingest_beside, make_app
from jobs.pipeline.ingest_threads import IngestAside
from jobs.pipeline.submit import JobSpec, create_job
from jobs.records.db import open_database
from jobs.records.job_files import JobFiles
from jobs.records.job_status import JobStatus
from jobs.records.status import JobView, get_job
from worker.config import Settings

if TYPE_CHECKING:
    from worker.consumer.loop import EngineWorker

STOP_WAIT = 10.0  # seconds a stopped run waits for its ingest's chunk under way; the ingest stops after it anyway
FIRST_WAIT = 2.0  # seconds a new job's worker waits to start for its first chunk's messages (see ``submit``)


class LocalRun:
    """A job of this process and its ingest beside (None: nothing left to ingest)."""

    def __init__(self, settings: Settings, job_id: str, ingest: IngestAside | None):
        self.settings, self.job_id, self.ingest = settings, job_id, ingest

    @classmethod
    def submit(cls, path: str | Path, settings: Settings, spec: JobSpec | None = None) -> LocalRun:
        """Accept the file as a job (``create_job``: refused at once past a limit) and start its ingest;
        return once its first chunk's messages are out (or it ended, or ``FIRST_WAIT`` passed). A worker
        started before would find the embedded queue empty, and kombu looks at an empty queue again
        only after its polling interval (a second, half of it within the loop's wait): longer than the
        first chunk takes. On RabbitMQ, which pushes, the worker would only have waited the same."""
        job_id = create_job(open_database(settings.database_url), JobFiles(settings.storage_url), path,
                            settings.served_model_name(), spec or JobSpec(), settings)
        ingest = ingest_beside(make_app(settings, eager=True), settings, job_id)
        try:
            ingest.published.wait(FIRST_WAIT)
        except BaseException:  # Ctrl-C before the worker took the signals: no ingest left running behind
            ingest.stop(STOP_WAIT)
            raise
        return cls(settings, job_id, ingest)

    @classmethod
    def resume(cls, job_id: str, settings: Settings) -> LocalRun:
        """Go on with a job; one still ``validating`` (its ingest stopped, or its process killed) has its
        ingest started again here, after its last stored line, rather than when the reconciler finds it silent."""
        validating = get_job(open_database(settings.database_url), job_id).status is JobStatus.VALIDATING
        return cls(settings, job_id, ingest_beside(make_app(settings, eager=True), settings, job_id)
                   if validating else None)

    def view(self) -> JobView:
        return get_job(open_database(self.settings.database_url), self.job_id)

    def work(self, worker: EngineWorker, on_progress: Callable[[JobView], None] | None = None) -> JobView:
        """Run ``worker`` until the job ends; the job as it is then (not final when the worker was
        stopped). Raises what stopped the ingest, if an error did. ``on_progress`` gets the job's view
        about every second."""

        def over() -> bool:
            view = self.view()
            if on_progress is not None:
                on_progress(view)
            return view.status.is_final or (self.ingest is not None and self.ingest.failed)

        try:
            if not self.view().status.is_final:
                worker.run(until=over)
        finally:
            if self.ingest is not None:
                self.ingest.stop(STOP_WAIT)
        if self.ingest is not None and self.ingest.error is not None:
            raise self.ingest.error
        return self.view()
