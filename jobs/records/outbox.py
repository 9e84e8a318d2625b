"""The outbox of job events (``job_events``), as the jobs side keeps it: database triggers write a row
for each change of a job's status (migration 0004), the queue door's relay and webhook sender read
them (``jobs.queue_door.events``), and the reconcile task prunes them here, published or not."""

from __future__ import annotations

import time

from sqlalchemy import delete

from jobs.records.db import Database
from jobs.records.models import JobEvent


def prune_events(db: Database, keep_seconds: float) -> int:
    """Delete the events that happened over ``keep_seconds`` ago; how many."""
    with db.session() as s, s.begin():
        return s.execute(delete(JobEvent).where(JobEvent.created_at < time.time() - keep_seconds)).rowcount
