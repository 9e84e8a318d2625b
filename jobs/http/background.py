"""Where the HTTP server's ingests and finalizes run: Celery tasks with a broker; on the embedded
queue, a thread pool of the server's process (the eager Celery app), so that no request waits for an
ingest. A task lost with the process is run again by the reconciler (``jobs.pipeline.reconcile``)."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

from jobs.pipeline.celery_tasks import make_app
from worker.config import Settings
from worker.messaging.topology import is_embedded

log = logging.getLogger("berth.http")


class Tasks:
    """The ingest and finalize of the batches this server makes: Celery tasks with a broker; on the
    embedded queue, on a thread of this process, so a request never waits for an ingest."""

    def __init__(self, settings: Settings):
        self.app = make_app(settings)
        self.pool = ThreadPoolExecutor(2, thread_name_prefix="berth-task") if is_embedded(settings) else None

    def run(self, name: str, job_id: str) -> None:
        task = self.app.tasks[name]
        if self.pool is None:
            task.delay(job_id)
        else:
            self.pool.submit(self._logged, task, job_id)

    @staticmethod
    def _logged(task, job_id: str) -> None:
        try:
            task.delay(job_id)
        except Exception:
            log.exception("%s of %s failed; the reconciler runs it again", task.name, job_id)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
