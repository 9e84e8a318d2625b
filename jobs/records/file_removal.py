"""Removing a file of the Files API: deleted by its tenant, or expired at its ``expires_at``
(``expire_files``, periodic). Content first, then the row; a job's own copy of its input stays while
the job does, and a removed output leaves its batch showing an id that is then a 404 (docs/http-api.md).
A job's copy of its input expires with the job: with its outputs (``output_expires_after``) or
``input_retention`` seconds after it ended, whichever comes first (then a retry of it says its input
is gone). Each removal zeroes the bytes the job's row counted for it (``jobs.records.storage_quota``).
"""

from __future__ import annotations

import logging

from sqlalchemy import case, delete, func, or_, select, update

from jobs.records.db import Database
from jobs.records.job_files import input_key
from jobs.records.job_status import JobStatus
from jobs.records.models import FileRow, Job, now
from storage.base import ObjectStore

log = logging.getLogger("berth.files")

BATCH = 500  # files removed per query
INPUT_RETENTION = 30 * 86400  # Settings.job_input_retention_seconds's default


def remove_file(db: Database, store: ObjectStore, file_id: str | None, key: str, job_id: str | None) -> None:
    """Delete a file's content (unless it is its job's own input) and its row (``file_id``; None: a
    job's output that never got one)."""
    if job_id is None or key != input_key(job_id):
        store.delete(key)
    with db.session() as s, s.begin():
        if file_id is not None:
            s.execute(delete(FileRow).where(FileRow.id == file_id))
        if job_id is not None:
            s.execute(update(Job).where(Job.id == job_id, Job.output_key == key).values(output_key=None,
                                                                                         output_bytes=0))
            s.execute(update(Job).where(Job.id == job_id, Job.errors_key == key).values(errors_key=None,
                                                                                         errors_bytes=0))


def expire_files(db: Database, store: ObjectStore, at: float | None = None,
                 input_retention: float = INPUT_RETENTION) -> int:
    """Remove every file whose time has come (``at``: now), jobs' copies of their inputs included; how many."""
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
    removed += _expire_job_inputs(db, store, at, input_retention)
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


def _expire_job_inputs(db: Database, store: ObjectStore, at: float, retention: float) -> int:
    """Delete the copies of their inputs of the jobs that ended ``output_expires_after`` (if shorter) or
    ``retention`` seconds before ``at``; and their rows in the Files API, where a CLI job's input got one."""
    ended = func.coalesce(Job.completed_at, Job.failed_at, Job.cancelled_at, Job.expired_at)
    kept = case((Job.output_expires_after < retention, Job.output_expires_after), else_=retention)
    final = [status for status in JobStatus if status.is_final]
    removed = 0
    while True:
        with db.session() as s:
            jobs = s.execute(select(Job.id, Job.input_key).where(
                Job.input_bytes > 0, Job.status.in_(final), ended + kept <= at).limit(BATCH)).all()
        for job_id, key in jobs:
            store.delete(key)
            with db.session() as s, s.begin():
                s.execute(delete(FileRow).where(FileRow.job_id == job_id, FileRow.key == key))
                s.execute(update(Job).where(Job.id == job_id).values(input_bytes=0))
            removed += 1
        if len(jobs) < BATCH:
            return removed
