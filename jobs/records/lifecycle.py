"""A job's moves between states (OpenAI's Batch states), each conditional on the state it leaves, so
racing workers, tasks and users cannot move a job twice. The functions return the jobs whose
finalize the caller must dispatch (docs/jobs.md).
"""

from __future__ import annotations

import re

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from jobs.records.db import Database
from jobs.records.job_errors import JobNotFound, JobStateError
from jobs.records.models import Job, JobStatus, now

LIVE = (JobStatus.VALIDATING, JobStatus.IN_PROGRESS)
_WINDOW = re.compile(r"\s*(\d+)\s*([smhd])\s*")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def window_seconds(window: str) -> float:
    m = _WINDOW.fullmatch(window)
    if not m or int(m.group(1)) == 0:
        raise ValueError(f"completion window {window!r}: give a number and a unit, e.g. 24h, 90m or 7d")
    return int(m.group(1)) * _UNIT_SECONDS[m.group(2)]


def mark_finalizing(session: Session, job_ids: list[str]) -> list[str]:
    """In-progress jobs among ``job_ids`` whose every request has an outcome move to finalizing."""
    if not job_ids:
        return []
    t, jobs = now(), Job.__table__.c  # SQLAlchemy's core: an ORM update's bulk machinery costs ten times more
    return list(session.connection().execute(
        update(Job.__table__).where(jobs.id.in_(sorted(job_ids)), jobs.status == JobStatus.IN_PROGRESS,
                                    jobs.completed + jobs.failed >= jobs.total)
        .values(status=JobStatus.FINALIZING, finalizing_at=t).returning(jobs.id)).scalars())


def cancel(db: Database, job_id: str) -> JobStatus:
    """Ask for a job to stop: its waiting requests are dropped, the running ones aborted by the workers,
    and the ingest of a validating job stops before its next chunk."""
    with db.session() as s, s.begin():  # conditional on the state it leaves: an ingest may be closing it
        moved = s.execute(update(Job).where(Job.id == job_id, Job.status.in_(LIVE))
                          .values(status=JobStatus.CANCELLING, cancelling_at=now())).rowcount
        if not moved:
            status = s.scalar(select(Job.status).where(Job.id == job_id))
            if status is None:
                raise JobNotFound(job_id)
            raise JobStateError(f"job {job_id} is {status.value}: only a validating or in-progress job can be "
                                "cancelled")
    return JobStatus.CANCELLING


def expire_due(db: Database) -> list[str]:
    """Live jobs past their completion window (validating ones too: an ingest that never finishes
    must not hold a job open) move to finalizing, marked expired."""
    t = now()
    with db.session() as s, s.begin():
        return list(s.scalars(
            update(Job).where(Job.status.in_(LIVE), Job.expires_at < t)
            .values(status=JobStatus.FINALIZING, finalizing_at=t, expired_at=t).returning(Job.id)))
