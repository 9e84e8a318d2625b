"""The outbox of job events (``job_events``), as the jobs side keeps it: database triggers write a row
for each change of a job's status (migration 0004), ``raise_at_risk`` one when a live job is first found
at risk of missing its window, the queue door's relay and webhook sender read them
(``jobs.queue_door.events``), and the reconcile task prunes them here, published or not."""

from __future__ import annotations

import time

from sqlalchemy import Float, case, delete, insert, literal, null, select, update

from jobs.records.db import Database
from jobs.records.lifecycle import LIVE
from jobs.records.models import AT_RISK_EVENT, Job, JobEvent, now
from jobs.records.status import live_jobs_not_yet_at_risk


def prune_events(db: Database, keep_seconds: float) -> int:
    """Delete the events that happened over ``keep_seconds`` ago; how many."""
    with db.session() as s, s.begin():
        return s.execute(delete(JobEvent).where(JobEvent.created_at < time.time() - keep_seconds)).rowcount


def raise_at_risk(db: Database) -> list[str]:
    """Raise the at-risk event of each live job found at risk (``JobView.at_risk``, what ``berth status``
    says) that never had one: its ``at_risk_at`` set and an event of kind 'at_risk' written, with its status,
    counts and files as they are and its expected finish, in one transaction. Once raised, never again,
    even if the job speeds up. The ids of the jobs raised.

    Safe beside itself (every embedded engine worker runs it, and Celery beat may too): the update takes
    only a job still live and not yet marked, and the event is written only where it took the job, so a
    job's event is written once however many run at once."""
    raised = []
    for view in live_jobs_not_yet_at_risk(db):
        finish = view.expected_finish_at
        if not view.at_risk or finish is None:
            continue
        t, jobs = now(), Job.__table__.c
        with db.session() as s, s.begin():
            taken = s.execute(update(Job.__table__).where(jobs.id == view.id, jobs.at_risk_at.is_(None),
                                                          jobs.status.in_(LIVE)).values(at_risk_at=t)).rowcount
            if taken != 1:
                continue  # another chore raised it, or the job ended meanwhile
            at = literal(t, Float())
            s.execute(insert(JobEvent.__table__).from_select(
                ["job_id", "kind", "status", "total", "completed", "failed", "prompt_tokens", "completion_tokens",
                 "output_key", "errors_key", "error", "webhook_url", "created_at", "webhook_due_at",
                 "webhook_attempts", "expected_finish_at"],
                select(jobs.id, literal(AT_RISK_EVENT), jobs.status, jobs.total, jobs.completed, jobs.failed,
                       jobs.prompt_tokens, jobs.completion_tokens, jobs.output_key, jobs.errors_key, jobs.error,
                       jobs.webhook_url, at, case((jobs.webhook_url.is_(None), null()), else_=at), literal(0),
                       literal(finish, Float())).where(jobs.id == view.id)))
        raised.append(view.id)
    return raised
