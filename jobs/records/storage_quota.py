"""A tenant's storage quota: the bytes of everything it stores (``tenant_max_storage_bytes``) and the
number of its files (``tenant_max_files``, what ``GET /v1/files`` lists).

The bytes are its uploads (``files`` rows of no job) and what its jobs hold in the store, whatever
door made them (an HTTP batch, ``berth submit``, a retry, a queue submit's input, inline or not):
each job's copy of its input, its output and its errors files (``jobs.input_bytes``,
``output_bytes``, ``errors_bytes``, set as they are written and zeroed as they are deleted or
expire). A job's copy of its input is deleted with its outputs (``output_expires_after``) or
``job_input_retention_seconds`` after it ends (``jobs.records.file_removal``).

An upload or a new job past either limit is refused (``QuotaExceeded``): a 413 on the HTTP API,
not a 429, since waiting makes no room before something expires, and the openai client retries a
429 by itself. The check runs in the transaction that adds the file's or the job's row, with the
tenant's row held (``hold_tenant``), so that two at once cannot both take the last room.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from jobs.records.models import FileRow, Job, Tenant
from worker.config import Settings


class QuotaExceeded(Exception):
    def __init__(self, message: str, code: str):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Usage:
    bytes: int
    files: int


def usage(s: Session, tenant_id: int) -> Usage:
    """The bytes it stores and the files it has (its jobs' files are counted through their job)."""
    uploads = select(func.coalesce(func.sum(FileRow.bytes), 0)).where(
        FileRow.tenant_id == tenant_id, FileRow.job_id.is_(None)).scalar_subquery()
    jobs = select(func.coalesce(func.sum(Job.input_bytes + Job.output_bytes + Job.errors_bytes), 0)).where(
        Job.tenant_id == tenant_id).scalar_subquery()
    count = select(func.count(FileRow.id)).where(FileRow.tenant_id == tenant_id).scalar_subquery()
    used_uploads, used_jobs, files = s.execute(select(uploads, jobs, count)).one()
    return Usage(int(used_uploads) + int(used_jobs), int(files))


def hold_tenant(s: Session, tenant_id: int) -> None:
    """Hold the tenant's row until this transaction ends: a row lock on PostgreSQL, the write lock on
    SQLite (where ``SELECT ... FOR UPDATE`` locks nothing, but an UPDATE does)."""
    s.execute(update(Tenant).where(Tenant.id == tenant_id).values(id=Tenant.id))


def check_room(s: Session, tenant_id: int, adding: int, settings: Settings, *, listed: bool = True) -> None:
    """``QuotaExceeded`` unless one more file of ``adding`` bytes fits the tenant's quota (``listed``:
    a file ``GET /v1/files`` lists; a job's copy of its input is not, and counts in bytes only)."""
    used = usage(s, tenant_id)
    max_files, max_bytes = settings.tenant_max_files, settings.tenant_max_storage_bytes
    if listed and max_files and used.files + 1 > max_files:
        raise QuotaExceeded(f"you have {used.files:,} files, the most a tenant may keep here: delete files you no "
                            "longer need (DELETE /v1/files/{id}), or ask the operator to raise BERTH_TENANT_MAX_FILES",
                            "too_many_files")
    if max_bytes and used.bytes + adding > max_bytes:
        raise QuotaExceeded(f"this file of {adding:,} bytes does not fit your storage quota: your files and your "
                            f"batches' copies of their inputs and outputs hold {used.bytes:,} of {max_bytes:,} bytes; "
                            "delete files you no longer need (DELETE /v1/files/{id}), wait for your batches' files "
                            "to expire, or ask the operator to raise BERTH_TENANT_MAX_STORAGE_BYTES",
                            "storage_quota_exceeded")
