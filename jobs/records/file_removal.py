"""Removing a file of the Files API: deleted by its tenant, or expired at its ``expires_at``
(``expire_files``, periodic). Content first, then the row; a job's own copy of its input stays, and a
removed output leaves its batch showing an id that is then a 404 (docs/http-api.md).
"""

from __future__ import annotations

import logging

from sqlalchemy import delete, func, or_, select, update

from jobs.records.db import Database
from jobs.records.job_files import input_key
from jobs.records.job_status import JobStatus
from jobs.records.models import FileRow, Job, now
from storage.base import ObjectStore

log = logging.getLogger("berth.files")

BATCH = 500  # files removed per query


def remove_file(db: Database, store: ObjectStore, file_id: str | None, key: str, job_id: str | None) -> None:
    """Delete a file's content (unless it is its job's own input) and its row (``file_id``; None: a
    job's output that never got one)."""
    if job_id is None or key != input_key(job_id):
        store.delete(key)
    with db.session() as s, s.begin():
        if file_id is not None:
            s.execute(delete(FileRow).where(FileRow.id == file_id))
        if job_id is not None:
            s.execute(update(Job).where(Job.id == job_id, Job.output_key == key).values(output_key=None))
            s.execute(update(Job).where(Job.id == job_id, Job.errors_key == key).values(errors_key=None))


def expire_files(db: Database, store: ObjectStore, at: float | None = None) -> int:
    """Remove every file whose time has come (``at``: now); how many."""
    at = now() if at is None else at
    removed = 0
    while True:
        with db.session() as s:
            rows = s.execute(select(FileRow.id, FileRow.key, FileRow.job_id)
                             .where(FileRow.expires_at.is_not(None), FileRow.expires_at <= at)
                             .order_by(FileRow.expires_at).limit(BATCH)).all()
        for file_id, key, job_id in rows:
            remove_file(db, store, file_id, key, job_id)
        removed += len(rows)
        if len(rows) < BATCH:
            break
    removed += _expire_unshown_outputs(db, store, at)
    if removed:
        log.info("expired %d files", removed)
    return removed


def _expire_unshown_outputs(db: Database, store: ObjectStore, at: float) -> int:
    ended = func.coalesce(Job.completed_at, Job.failed_at, Job.cancelled_at, Job.expired_at)
    final = [status for status in JobStatus if status.is_final]
    removed = 0
    while True:
        with db.session() as s:
            jobs = s.execute(select(Job.id, Job.output_key, Job.errors_key).where(
                Job.output_expires_after.is_not(None), Job.status.in_(final),
                or_(Job.output_key.is_not(None), Job.errors_key.is_not(None)),
                ended + Job.output_expires_after <= at).limit(BATCH)).all()
            rows = {(r.job_id, r.key): r.id for r in s.execute(select(FileRow.id, FileRow.job_id, FileRow.key).where(
                FileRow.job_id.in_([j.id for j in jobs])))} if jobs else {}
        for job_id, *keys in jobs:
            for key in filter(None, keys):
                remove_file(db, store, rows.get((job_id, key)), key, job_id)
                removed += 1
        if len(jobs) < BATCH:
            return removed
