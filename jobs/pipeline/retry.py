"""A new job of just the lines that failed in a finished one (``berth retry``, ``POST
/v1/batches/{id}/retry``): its failed requests, and the lines a cancel or an expiry kept from being
read. Lines that were bad requests are left out: they would fail the same way again. The new job
has the old one's tenant, priority, window, metadata and endpoint; its lines keep their text, so
their custom_ids and seeds are the same."""

from __future__ import annotations

import tempfile

from sqlalchemy import select

from jobs.lines.validate import read_lines
from jobs.pipeline.submit import JobSpec, create_job_from
from jobs.records.db import Database
from jobs.records.job_files import JobFiles, input_key
from jobs.records.lifecycle import JobStateError
from jobs.records.models import LineErrorRow, RequestRow, Result, ResultStatus
from jobs.records.status import JobView
from storage import ObjectNotFound
from worker.config import Settings

UNREAD_CODES = ("batch_cancelled", "batch_expired")  # line errors of lines never read, not bad lines


def failed_lines(db: Database, job_id: str) -> set[int]:
    with db.session() as s:
        failed = set(s.scalars(select(RequestRow.line).join(Result, Result.request_id == RequestRow.id)
                               .where(RequestRow.job_id == job_id, Result.status == ResultStatus.FAILED)))
        failed |= set(s.scalars(select(LineErrorRow.line).where(LineErrorRow.job_id == job_id,
                                                                LineErrorRow.code.in_(UNREAD_CODES))))
    return failed


def retry_job(db: Database, files: JobFiles, settings: Settings, job: JobView) -> str:
    """Create the job of ``job``'s failed lines (the caller dispatches its ingest); its id."""
    if not job.status.is_final:
        raise JobStateError(f"job {job.id} is {job.status.value}: only a finished job can be retried; cancel it "
                            "first, or wait for it to end")
    lines = failed_lines(db, job.id)
    if not lines:
        raise JobStateError(f"job {job.id} has no failed request to retry")
    spec = JobSpec(tenant=job.tenant, priority=job.priority, completion_window=job.completion_window,
                   metadata=job.metadata, endpoint=job.endpoint)
    with tempfile.TemporaryFile() as tmp:
        try:
            with files.open(input_key(job.id)) as src:
                for raw in read_lines(src):
                    if raw.number in lines and raw.data is not None:
                        tmp.write(raw.data + b"\n")
        except ObjectNotFound:
            raise JobStateError(f"job {job.id}'s copy of its input has expired (BERTH_JOB_INPUT_RETENTION_SECONDS, or "
                                "with its outputs): submit its failed lines again as a new file") from None
        tmp.seek(0)
        name = job.input_name.removesuffix(".jsonl")[:480] + ".retry.jsonl"
        return create_job_from(db, files, tmp, name, job.model, spec, settings)
