"""Finished requests out: commit their outcomes, then (the caller) ack their messages.

A result is committed before its message is acked, so a worker killed in between leaves a message
that is redelivered and skipped (its request has a result): nothing is lost, nothing counted twice.
While the database is down, outcomes wait here, their requests still held by the worker (a
redelivery is adopted, not run again) and their messages unacked; the next try that gets through
commits them all.
"""

from __future__ import annotations

from dataclasses import dataclass

from worker.consumer.broker import Delivery
from worker.consumer.database_health import DOWN, DatabaseHealth
from worker.consumer.ledger import Ledger, Outcome
from worker.metrics import WorkerMetrics


@dataclass
class Pending:
    outcome: Outcome
    tenant: str
    delivery: Delivery | None
    dead_reason: str | None = None  # dead-letter the message with this reason once committed
    new: bool = False  # set on commit: this outcome is the request's first

    @property
    def engine_id(self) -> str:
        return str(self.outcome.request_id)


class OutcomeBook:
    def __init__(self, ledger: Ledger, database: DatabaseHealth, metrics: WorkerMetrics, worker_name: str):
        self.ledger = ledger
        self.database = database
        self.metrics = metrics
        self.worker_name = worker_name
        self.waiting: list[Pending] = []

    def commit(self, items: list[Pending], running: int = 0) -> list[Pending]:
        """Commit ``items`` and those waiting; the committed ones (none while the database is down)."""
        self.waiting.extend(items)
        if not self.waiting or not self.database.ready():
            self.metrics.outcomes_waiting.set(len(self.waiting))
            return []
        new = self.database.call(self.ledger.record, [p.outcome for p in self.waiting], self.worker_name,
                                 running=running)
        if new is DOWN:
            self.metrics.outcomes_waiting.set(len(self.waiting))
            return []
        done, self.waiting = self.waiting, []
        self.metrics.outcomes_waiting.set(0)
        for p in done:
            p.new = p.outcome.request_id in new
            if p.new:
                counter = self.metrics.finished if p.outcome.completed else self.metrics.failed
                counter.labels(p.tenant).inc()
        return done
