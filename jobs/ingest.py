"""Turning a submitted file into request rows and queue messages, a chunk of lines at a time.

Each chunk's rows (good lines as requests, bad lines as line errors) are committed in one
transaction with bulk inserts, and only then published; ``published_at`` is set once the broker
confirmed. A crash between the two leaves rows without ``published_at``, which the reconciler
publishes. An ingest run again (a retried task) resumes after the last line stored.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from sqlalchemy import func, insert, select, update

from jobs.batch_format import LineError
from jobs.db import Database
from jobs.files import JobFiles
from jobs.finalize import write_outputs
from jobs.lifecycle import mark_finalizing
from jobs.messages import RequestMessage, params_to_dict
from jobs.models import Job, JobStatus, LineErrorRow, RequestRow, Tenant, now
from jobs.queue import Publisher
from jobs.validate import InputError, LineValidator, RawLine, model_info, read_lines
from worker.config import Settings

CHUNK_LINES = 2000
PUBLISH_BATCH = 2000


@dataclass(frozen=True)
class JobTarget:
    """What every message of a job carries besides the request itself."""

    job_id: str
    model: str
    priority: int
    tenant: str

    def message(self, row: RequestRow) -> RequestMessage:
        return RequestMessage.from_row(row, self.model, self.priority, self.tenant)


def job_target(db: Database, job_id: str) -> JobTarget:
    with db.session() as s:
        job, tenant = s.execute(select(Job, Tenant.name).join(Tenant).where(Job.id == job_id)).one()
        return JobTarget(job.id, job.model, job.priority, tenant)


def ingest(db: Database, files: JobFiles, settings: Settings, job_id: str) -> list[str]:
    """Validate, store and publish the job's lines; returns the jobs now ready to finalize."""
    with db.session() as s:
        job = s.get(Job, job_id)
        if job is None or job.status is not JobStatus.VALIDATING:
            return []
        input_key = job.input_key
    target = job_target(db, job_id)
    last_line, seen = _stored(db, job_id)
    validator = LineValidator(model_info(settings), seen=seen)
    error = None
    with Publisher(settings) as publisher:
        publish_unpublished(db, publisher, job_id)  # a previous run's last chunk, if it died before publishing
        try:
            with files.open(input_key) as f:
                lines = (raw for raw in read_lines(f) if raw.number > last_line)
                while chunk := list(itertools.islice(lines, CHUNK_LINES)):
                    rows = _store_chunk(db, target, validator, chunk)
                    publish(db, publisher, [target.message(r) for r in rows])
                    if not _still_validating(db, job_id):
                        return []
        except InputError as exc:
            error = str(exc)
    return _close_validation(db, files, job_id, error)


def _stored(db: Database, job_id: str) -> tuple[int, set[str]]:
    with db.session() as s:
        last = max(s.scalar(select(func.max(RequestRow.line)).where(RequestRow.job_id == job_id)) or 0,
                   s.scalar(select(func.max(LineErrorRow.line)).where(LineErrorRow.job_id == job_id)) or 0)
        seen = set(s.scalars(select(RequestRow.custom_id).where(RequestRow.job_id == job_id)))
    return last, seen


def _store_chunk(db: Database, target: JobTarget, validator: LineValidator, chunk: list[RawLine]) -> list[RequestRow]:
    requests, errors = [], []
    created = now()
    for raw in chunk:
        try:
            custom_id, url, request = validator.check(raw)
        except LineError as e:
            errors.append({"job_id": target.job_id, "line": e.line, "custom_id": e.custom_id, "param": e.param,
                           "code": e.code, "message": e.message})
            continue
        requests.append({"job_id": target.job_id, "line": raw.number, "custom_id": custom_id, "url": url,
                         "prompt_token_ids": request.prompt_token_ids, "params": params_to_dict(request.params),
                         "attempts": 0, "created_at": created})
    with db.session() as s, s.begin():
        ids = list(s.scalars(insert(RequestRow).returning(RequestRow.id, sort_by_parameter_order=True),
                             requests)) if requests else []
        if errors:
            s.execute(insert(LineErrorRow), errors)
        s.execute(update(Job).where(Job.id == target.job_id)
                  .values(total=Job.total + len(chunk), failed=Job.failed + len(errors)))
    return [RequestRow(id=i, **r) for i, r in zip(ids, requests)]


def publish(db: Database, publisher: Publisher, messages: list[RequestMessage]) -> int:
    """Publish committed requests, then mark them published."""
    for start in range(0, len(messages), PUBLISH_BATCH):
        batch = messages[start:start + PUBLISH_BATCH]
        publisher.publish(batch)
        with db.session() as s, s.begin():
            s.execute(update(RequestRow).where(RequestRow.id.in_([m.request_id for m in batch]))
                      .values(published_at=now()))
    return len(messages)


def publish_unpublished(db: Database, publisher: Publisher, job_id: str) -> int:
    with db.session() as s:
        rows = list(s.scalars(select(RequestRow).where(RequestRow.job_id == job_id, RequestRow.published_at.is_(None))))
    if not rows:
        return 0
    target = job_target(db, job_id)
    return publish(db, publisher, [target.message(r) for r in rows])


def _still_validating(db: Database, job_id: str) -> bool:
    with db.session() as s:
        return s.scalar(select(Job.status).where(Job.id == job_id)) is JobStatus.VALIDATING


def _close_validation(db: Database, files: JobFiles, job_id: str, error: str | None) -> list[str]:
    with db.session() as s:
        total, failed = s.execute(select(Job.total, Job.failed).where(Job.id == job_id)).one()
    if error is None and total == 0:
        error = "the input file has no request lines: give one JSON request per line (OpenAI Batch format)"
    elif error is None and failed == total:
        error = f"none of the {total} lines is a valid request: the errors file says what is wrong with each"
    if error is None:
        with db.session() as s, s.begin():
            s.execute(update(Job).where(Job.id == job_id, Job.status == JobStatus.VALIDATING)
                      .values(status=JobStatus.IN_PROGRESS, in_progress_at=now()))
            return mark_finalizing(s, [job_id])
    _, errors_key = write_outputs(db, files, job_id)
    with db.session() as s, s.begin():
        s.execute(update(Job).where(Job.id == job_id, Job.status == JobStatus.VALIDATING).values(
            status=JobStatus.FAILED, failed_at=now(), error=error, errors_key=errors_key))
    return []
