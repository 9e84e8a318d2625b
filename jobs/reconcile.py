"""Putting back what a crash can leave behind, from the database (the source of truth). Run
periodically by Celery beat.

- A request committed but never confirmed by the broker (``published_at`` empty: the submitter
  died between commit and publish, or the broker refused it) is published.
- On the embedded queue only: a request delivered long ago without an outcome is published again,
  since that transport keeps a dead worker's delivery hidden forever (RabbitMQ requeues it itself).
  If its worker is in fact still running it, that worker acks the copy and carries on.
- A job left in ``finalizing`` or ``cancelling`` (its finalize task lost) is finalized.

Everything here is safe to repeat: a request published twice still gets one result.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import and_, or_, select

from jobs.db import Database
from jobs.ingest import publish
from jobs.lifecycle import LIVE
from jobs.messages import RequestMessage
from jobs.models import Job, JobStatus, RequestRow, Result, Tenant, now
from jobs.queue import Publisher, is_embedded
from worker.config import Settings

STALE_DELIVERY_SECONDS = 1800.0


@dataclass(frozen=True)
class Reconciled:
    republished: int
    finalize: list[str]  # jobs whose finalize task must run (again)


def reconcile(db: Database, settings: Settings, older_than: float = 60.0) -> Reconciled:
    t = now()
    lost = and_(RequestRow.published_at.is_(None), RequestRow.created_at < t - older_than)
    if is_embedded(settings):
        stale = t - STALE_DELIVERY_SECONDS
        lost = or_(lost, and_(RequestRow.delivered_at < stale, RequestRow.published_at < stale))
    with db.session() as s:
        rows = s.execute(
            select(RequestRow, Job.model, Job.priority, Tenant.name)
            .join(Job, Job.id == RequestRow.job_id).join(Tenant, Tenant.id == Job.tenant_id)
            .outerjoin(Result, Result.request_id == RequestRow.id)
            .where(Job.status.in_(LIVE), Result.id.is_(None), lost)).all()
        stuck = list(s.scalars(select(Job.id).where(or_(
            and_(Job.status == JobStatus.FINALIZING, Job.finalizing_at < t - older_than),
            and_(Job.status == JobStatus.CANCELLING, Job.cancelling_at < t - older_than)))))
    republished = 0
    if rows:
        with Publisher(settings) as publisher:
            republished = publish(db, publisher, [RequestMessage.from_row(r, model, priority, tenant)
                                                  for r, model, priority, tenant in rows])
    return Reconciled(republished, stuck)
