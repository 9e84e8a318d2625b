"""Putting back what a crash can leave behind, from the database: requests never confirmed by the
broker, dead or stale deliveries of the embedded queue, jobs stuck in ``finalizing`` or
``cancelling``, and ingests that fell silent. Run periodically (Celery beat, or the embedded
housekeeping); safe to repeat and to run side by side (docs/jobs.md).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from sqlalchemy import and_, func, or_, select, update

from jobs.pipeline.ingest import publish
from jobs.pipeline.publish import Publisher
from jobs.pipeline.request_messages import RequestMessage
from jobs.records.db import Database
from jobs.records.lifecycle import LIVE
from jobs.records.models import Job, JobStatus, RequestRow, Result, Tenant, now
from worker.config import Settings
from worker.messaging.topology import is_embedded

STALE_DELIVERY_SECONDS = 1800.0
INGEST_SILENCE_SECONDS = 120.0  # eight of a running ingest's heartbeats (jobs.pipeline.ingest.HEARTBEAT_SECONDS)


@dataclass(frozen=True)
class Reconciled:
    republished: int
    finalize: list[str]  # jobs whose finalize task must run (again)
    ingest: list[str]  # jobs whose ingest task must run (again)


def reconcile(db: Database, settings: Settings, older_than: float = 60.0,
              ingest_silence: float = INGEST_SILENCE_SECONDS) -> Reconciled:
    t = now()
    lost = and_(RequestRow.published_at.is_(None), RequestRow.created_at < t - older_than)
    open_requests = and_(Job.status.in_(LIVE), Result.id.is_(None))
    with db.session() as s:
        if is_embedded(settings):
            stale = t - STALE_DELIVERY_SECONDS
            lost = or_(lost, and_(RequestRow.delivered_at < stale, RequestRow.published_at < stale))
            held = s.execute(select(RequestRow.id, RequestRow.holder)
                             .join(Job, Job.id == RequestRow.job_id)
                             .outerjoin(Result, Result.request_id == RequestRow.id)
                             .where(open_requests, RequestRow.holder.is_not(None),
                                    RequestRow.delivered_at > RequestRow.published_at)).all()
            orphans = [i for i, holder in held if holder_is_dead(holder)]
            if orphans:
                lost = or_(lost, RequestRow.id.in_(orphans))
        rows = s.execute(
            select(RequestRow, Job.model, Job.priority, Tenant.name, Job.expires_at - Job.created_at)
            .join(Job, Job.id == RequestRow.job_id).join(Tenant, Tenant.id == Job.tenant_id)
            .outerjoin(Result, Result.request_id == RequestRow.id)
            .where(open_requests, lost)).all()
        stuck = list(s.scalars(select(Job.id).where(or_(
            and_(Job.status == JobStatus.FINALIZING, Job.finalizing_at < t - older_than),
            and_(Job.status == JobStatus.CANCELLING, Job.cancelling_at < t - older_than)))))
    with db.session() as s, s.begin():  # claimed: another reconciler sees a sign of life
        silent = list(s.scalars(
            update(Job).where(Job.status == JobStatus.VALIDATING,
                              func.coalesce(Job.ingest_seen_at, Job.created_at) < t - ingest_silence)
            .values(ingest_seen_at=t).returning(Job.id)))
    republished = 0
    if rows:
        with Publisher(settings) as publisher:
            republished = publish(db, publisher, [RequestMessage.from_row(r, model, priority, tenant, window)
                                                  for r, model, priority, tenant, window in rows])
    return Reconciled(republished, stuck, sorted(silent))


def holder_is_dead(holder: str) -> bool:
    """Whether ``holder`` ("host:pid") names a process of this host that no longer exists. A holder
    elsewhere, or one that cannot be read, is not known to be dead."""
    host, _, pid = holder.rpartition(":")
    if host != socket.gethostname() or not pid.isdigit() or int(pid) <= 0:
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError):  # it exists under another user; not a pid at all
        return False
    return False
