"""Whether the jobs database answers the engine worker, and when to try it again while it does not.

Every call that needs the database asks ``ready()`` first and goes through ``call``: one that failed
for want of it (``LedgerDown``) reports ``failed``, which backs off (``RETRY``: first, most seconds between tries);
the next call that gets through reports ``succeeded``. The ``berth_database_up`` gauge and
``berth_database_errors`` counter show it, and the first failure and the recovery are logged once each.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

from worker.consumer.ledger import LedgerDown
from worker.messaging.backoff import Backoff
from worker.metrics import WorkerMetrics

T = TypeVar("T")
DOWN = object()  # what ``call`` returns when the database did not answer

log = logging.getLogger("berth.worker")

RETRY = (0.5, 10.0)  # seconds between tries of a database that went away: first, most


class DatabaseHealth:
    def __init__(self, worker_name: str, metrics: WorkerMetrics):
        self.worker_name = worker_name
        self.metrics = metrics
        self.backoff = Backoff(*RETRY)
        metrics.database_up.set(1)

    def ready(self) -> bool:
        """False while the database is down and its next try is not due yet."""
        return self.backoff.ready()

    def failed(self, exc: Exception, running: int) -> None:
        """A call failed for want of the database (``running``: the requests that keep running)."""
        self.metrics.database_errors.inc()
        if self.backoff.failed():
            self.metrics.database_up.set(0)
            log.warning("worker %s: database unreachable, %d requests keep running and their results wait: %s",
                        self.worker_name, running, str(exc).splitlines()[0] if str(exc) else type(exc).__name__)

    def succeeded(self) -> None:
        """A database call got through."""
        lasted = self.backoff.succeeded()
        if lasted is not None:
            log.warning("worker %s: database back after %.1fs", self.worker_name, lasted)
            self.metrics.database_up.set(1)

    def call(self, fn: Callable[..., T], *args, running: int = 0) -> T | object:
        """``fn(*args)``, or ``DOWN`` when the database did not answer (noted, and backed off)."""
        try:
            result = fn(*args)
        except LedgerDown as exc:
            self.failed(exc, running)
            return DOWN
        self.succeeded()
        return result
