"""A job's ingest on a thread of this process, so that an engine worker here consumes its first
requests while it reads the rest: `berth run`'s (``jobs.hosting.local_run``) and, on the embedded
defaults, the reconciler's (``jobs.pipeline.celery_tasks.dispatch``), which must not wait for it.

One such thread a job in a process: a second start of a job whose ingest runs here gets the running
one, so the reconciler of `berth run`'s own worker never starts a second ingest beside it (two
would store each line once anyway, at twice the work). The handle keeps what ended the ingest
(the caller raises it) and the thread's CPU (benchmarks), says when its first messages are out,
and asks it to stop before its next chunk (``jobs.pipeline.ingest.ingest``'s ``published`` and ``stop``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

Work = Callable[["IngestAside"], object]  # the ingest, given its handle: its ``stopping`` and ``published``


class IngestAside:
    """One job's ingest on a thread of its own (started by ``start``)."""

    def __init__(self, job_id: str, work: Work):
        self.job_id = job_id
        self.error: BaseException | None = None  # what ended the ingest, once it ended
        self.cpu_seconds = 0.0  # the thread's CPU, once it ended
        self.stopping = threading.Event()  # asked between chunks: set, the ingest stops
        self.published = threading.Event()  # set by the ingest once messages of the job are out, or when it ends
        self._work = work
        self.thread = threading.Thread(target=self._run, name=f"berth-ingest-{job_id}", daemon=True)

    def _run(self) -> None:
        started = time.thread_time()
        try:
            self._work(self)
        except BaseException as exc:  # noqa: BLE001 (kept for the caller, which raises it in its own thread)
            self.error = exc
        finally:
            self.cpu_seconds = time.thread_time() - started
            self.published.set()

    @property
    def done(self) -> bool:
        return not self.thread.is_alive()

    @property
    def failed(self) -> bool:
        """It ended on an error (``error``): its job is left ``validating``, what it stored kept."""
        return self.done and self.error is not None

    def stop(self, timeout: float | None = None) -> None:
        """Ask the ingest to stop before its next chunk and wait up to ``timeout`` for it (None: until it
        stops, at most a chunk's checking and storing); an ingest that does not stop stays a daemon thread."""
        self.stopping.set()
        self.thread.join(timeout)


_running: dict[str, IngestAside] = {}
_lock = threading.Lock()


def start(job_id: str, work: Work) -> tuple[IngestAside, bool]:
    """The ingest of ``job_id`` on a thread: ``work`` started on a new one, or the one running here
    already; whether it is new."""
    with _lock:
        for done in [j for j, aside in _running.items() if aside.done]:
            del _running[done]
        if job_id in _running:
            return _running[job_id], False
        aside = _running[job_id] = IngestAside(job_id, work)
        aside.thread.start()
        return aside, True


def running(job_id: str) -> IngestAside | None:
    """The ingest of ``job_id`` running on a thread of this process, if any."""
    with _lock:
        aside = _running.get(job_id)
        return aside if aside is not None and not aside.done else None
