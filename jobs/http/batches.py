"""Jobs as OpenAI Batch objects, for the HTTP API: made from an uploaded file, read, listed a
page at a time and cancelled, each only by the tenant whose job it is (another tenant's batch is as
missing as one that never was)."""

from __future__ import annotations

import re

from sqlalchemy import select

from jobs.http.files import UPLOAD_PURPOSE, FileNotFound, attach_job_files, get_file
from jobs.http.pagination import page_after
from jobs.pipeline.submit import JobSpec, create_job_from
from jobs.records.db import Database
from jobs.records.job_files import JobFiles
from jobs.records.lifecycle import JobNotFound
from jobs.records.lifecycle import cancel as cancel_job
from jobs.records.models import Job, Tenant
from jobs.records.status import JobView, get_job
from worker.config import Settings

BATCH_ID = re.compile(r"batch_[0-9a-f]{24}")
FILE_ID = re.compile(r"file-[0-9a-f]{24}")


class InputFileMissing(LookupError):
    """The ``input_file_id`` of a new batch names no file of the tenant's (a 400, not a 404: the
    route exists, a field of the body is wrong)."""


def _stamp(t: float | None) -> int | None:
    return None if t is None else int(t)


def _metadata(view: JobView) -> dict | None:
    """The job's metadata, and while it runs berth's expected finish and whether it is at risk of missing
    its window (OpenAI's metadata is strings: a unix time and "true"/"false"; an extension, docs/http-api.md)."""
    metadata = dict(view.metadata or {})
    finish = view.expected_finish_at
    if finish is not None:
        metadata["berth_expected_finish"] = str(int(finish))
        metadata["berth_at_risk"] = "true" if view.at_risk else "false"
    return metadata or None


def batch_object(view: JobView) -> dict:
    """The job as OpenAI's Batch object (its file ids made by ``jobs.http.files.attach_job_files``)."""
    errors = None
    if view.error is not None:
        errors = {"object": "list", "data": [{"code": view.error_code or "invalid_file", "message": view.error,
                                              "param": None, "line": None}]}
    stamps = {f"{name}_at": _stamp(getattr(view, f"{name}_at")) for name in (
        "created", "in_progress", "expires", "finalizing", "completed", "failed", "expired", "cancelling",
        "cancelled")}
    return {
        "id": view.id, "object": "batch", "endpoint": view.endpoint or "/v1/chat/completions", "model": view.model,
        "errors": errors, "input_file_id": view.input_file_id, "completion_window": view.completion_window,
        "status": view.status.value, "output_file_id": view.output_file_id, "error_file_id": view.error_file_id,
        **stamps,
        "request_counts": {"total": view.total, "completed": view.completed, "failed": view.failed},
        "metadata": _metadata(view),
        "usage": {"input_tokens": view.prompt_tokens, "input_tokens_details": {"cached_tokens": view.cached_tokens},
                  "output_tokens": view.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": view.prompt_tokens + view.completion_tokens},
    }


def tenant_job(db: Database, tenant: str, batch_id: str) -> JobView:
    """The tenant's job ``batch_id``; ``JobNotFound`` for another tenant's."""
    if not BATCH_ID.fullmatch(batch_id):
        raise JobNotFound(batch_id)
    view = get_job(db, batch_id)
    if view.tenant != tenant:
        raise JobNotFound(batch_id)
    return view


def get_batch(db: Database, files: JobFiles, tenant: str, batch_id: str) -> JobView:
    return attach_job_files(db, files.store, tenant_job(db, tenant, batch_id))


def create_batch(db: Database, files: JobFiles, settings: Settings, tenant: str, input_file_id: str,
                 endpoint: str, completion_window: str, metadata: dict | None,
                 output_expires_after: int | None = None) -> str:
    """A job of the tenant's uploaded file ``input_file_id``, in ``validating``; its id. The caller
    dispatches its ingest. ``output_expires_after``: seconds its output files are kept once written."""
    try:
        if not FILE_ID.fullmatch(input_file_id):
            raise FileNotFound(input_file_id)
        upload = get_file(db, tenant, input_file_id)
    except FileNotFound:
        raise InputFileMissing(f"input_file_id {input_file_id!r} names no file of yours: upload the requests with "
                               "POST /v1/files (purpose 'batch') and give the id it returns") from None
    if upload.purpose != UPLOAD_PURPOSE:
        raise ValueError(f"file {input_file_id} is a batch's {upload.purpose}, not requests: give a file uploaded "
                         "with purpose 'batch'")
    spec = JobSpec(tenant=tenant, completion_window=completion_window, metadata=dict(metadata or {}),
                   endpoint=endpoint, output_expires_after=output_expires_after)
    with files.open(upload.key) as src:
        return create_job_from(db, files, src, upload.filename, settings.served_model_name(), spec, settings,
                               input_file_id=upload.id)


def list_batches(db: Database, files: JobFiles, tenant: str, after: str | None, limit: int) -> list[JobView]:
    """Up to ``limit + 1`` of the tenant's batches, newest first, after the batch ``after``."""
    cursor = None
    if after is not None:
        found = tenant_job(db, tenant, after)
        cursor = (found.created_at, found.id)
    query = select(Job, Tenant.name).join(Tenant).where(Tenant.name == tenant)
    with db.session() as s:
        rows = s.execute(page_after(query, Job.created_at, Job.id, cursor, limit)).all()
    return [attach_job_files(db, files.store, JobView.of(job, name)) for job, name in rows]


def cancel_batch(db: Database, tenant: str, batch_id: str) -> None:
    """Move the tenant's batch to ``cancelling``; the caller dispatches its finalize."""
    tenant_job(db, tenant, batch_id)
    cancel_job(db, batch_id)
