"""Whether the jobs database answers the engine worker, and when to try it again while it does not.

A worker's loop never waits on a database that is down: every call that needs it asks ``ready()``
first, and a call that failed for want of the database (``DOWN``) reports it with ``failed``, which
backs off (``RETRY``: first, most seconds between tries); the next call that gets through reports
``succeeded``. The ``berth_database_up`` gauge and ``berth_database_errors`` counter show it, and the
first failure and the recovery are logged once each.
"""

from __future__ import annotations

import logging
import time

from sqlalchemy import exc as sql_errors

from worker.metrics import WorkerMetrics

log = logging.getLogger("berth.worker")

RETRY = (0.5, 10.0)  # seconds between tries of a database that went away: first, most
DOWN = (sql_errors.OperationalError, sql_errors.InterfaceError)  # not reachable (bugs are other errors)


class DatabaseHealth:
    def __init__(self, worker_name: str, metrics: WorkerMetrics):
        self.worker_name = worker_name
        self.metrics = metrics
        self.down_since: float | None = None
        self._retry_at = 0.0  # monotonic time of the next try while the database is down
        self._backoff = RETRY[0]
        metrics.database_up.set(1)

    def ready(self) -> bool:
        """False while the database is down and its next try is not due yet."""
        return self.down_since is None or time.monotonic() >= self._retry_at

    def failed(self, exc: Exception, running: int) -> None:
        """A call failed for want of the database (``running``: the requests that keep running)."""
        self.metrics.database_errors.inc()
        if self.down_since is None:
            self.down_since, self._backoff = time.monotonic(), RETRY[0]
            self.metrics.database_up.set(0)
            log.warning("worker %s: database unreachable, %d requests keep running and their results wait: %s",
                        self.worker_name, running, str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        else:
            self._backoff = min(2 * self._backoff, RETRY[1])
        self._retry_at = time.monotonic() + self._backoff

    def succeeded(self) -> None:
        """A database call got through."""
        if self.down_since is not None:
            log.warning("worker %s: database back after %.1fs", self.worker_name, time.monotonic() - self.down_since)
            self.down_since = None
            self.metrics.database_up.set(1)
