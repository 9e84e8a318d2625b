"""Accepting a job: its input file copied into the job store and a ``validating`` job row, in
well under a second whatever the file's size; the lines are checked and queued by the ingest task.

A submit is refused at once, with the limit and the setting that raises it, when the file is over
``Settings.max_file_bytes`` or holds a request past line ``max_file_lines`` (``InputError``), or
when the tenant already has ``max_jobs_in_flight`` jobs validating or in progress (``JobRefused``), or
when the job's copy of its input does not fit the tenant's storage quota (``QuotaExceeded``, which
counts every byte a tenant stores: ``jobs.records.storage_quota``).
A job submitted through the queue (``jobs.queue_door.consumer``) is made the same way from its input
stream, and carries its message's id (unique per tenant: a message that comes twice makes one job).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from sqlalchemy import delete, func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from jobs.lines.request_fields import URLS
from jobs.lines.validate import check_file_size, copy_checked
from jobs.records import job_files as keys
from jobs.records.db import Database
from jobs.records.job_files import JobFiles
from jobs.records.lifecycle import window_seconds
from jobs.records.models import Job, JobStatus, Tenant, now
from jobs.records.storage_quota import check_room, hold_tenant
from jobs.records.tenants import check_tenant_name, tenant_id
from worker.config import Settings
from worker.messaging.topology import MAX_PRIORITY

IN_FLIGHT = (JobStatus.VALIDATING, JobStatus.IN_PROGRESS)


@dataclass(frozen=True)
class JobSpec:
    """What a user chooses about a job besides its requests."""

    tenant: str = "default"
    priority: int = 0  # 0-9, higher runs first
    completion_window: str = "24h"
    metadata: dict = field(default_factory=dict)
    endpoint: str | None = None  # an OpenAI batch's endpoint, as shown; each line still runs at its own url
    output_expires_after: int | None = None  # seconds its output and errors files are kept; None: until deleted

    def check(self) -> None:
        check_tenant_name(self.tenant)
        if self.endpoint is not None and self.endpoint not in URLS:
            raise ValueError(f"endpoint {self.endpoint!r}: give {', '.join(URLS[:-1])} or {URLS[-1]}")
        if not 0 <= self.priority <= MAX_PRIORITY:
            raise ValueError(f"priority {self.priority}: give an integer from 0 to {MAX_PRIORITY} (higher runs first)")
        window_seconds(self.completion_window)
        if not isinstance(self.metadata, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                          for k, v in self.metadata.items()):
            raise ValueError("metadata must map strings to strings")


def new_job_id() -> str:
    return f"batch_{uuid.uuid4().hex[:24]}"


class JobRefused(ValueError):
    """The tenant may not start another job now; the message says why and what to do."""


def create_job(db: Database, files: JobFiles, path: str | Path, model: str, spec: JobSpec,
               settings: Settings | None = None) -> str:
    """Store the input and create the job in ``validating``; returns its id. ``settings`` gives the
    limits (default: from the environment)."""
    limits = settings or Settings()
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} is not a file: give the path of a JSONL request file")
    check_file_size(path, limits.max_file_bytes)
    with open(path, "rb") as src:
        return create_job_from(db, files, src, path.name, model, spec, limits)


class _Counted:
    """A writer that counts the bytes written through it."""

    def __init__(self, out: BinaryIO):
        self.out, self.bytes = out, 0

    def write(self, data: bytes) -> int:
        self.bytes += len(data)
        return self.out.write(data)


class DuplicateSubmit(Exception):
    """A job with this submit message id exists already (the message came twice): ``job_id``."""

    def __init__(self, job_id: str):
        super().__init__(f"job {job_id} was made by this message already")
        self.job_id = job_id


def create_job_from(db: Database, files: JobFiles, source: BinaryIO, input_name: str, model: str, spec: JobSpec,
                    settings: Settings | None = None, *, input_file_id: str | None = None,
                    message_id: str | None = None, webhook_url: str | None = None) -> str:
    """``create_job`` from an open file: a local file, an upload of the HTTP API (``input_file_id``),
    or the input of a queue submit (``message_id`` unique per tenant: ``DuplicateSubmit`` when it made
    a job already)."""
    spec.check()
    settings = settings or Settings()
    with db.session() as s:
        _check_in_flight(s, spec.tenant, settings.max_jobs_in_flight)  # before the copy: refuse at once
    job_id = new_job_id()
    with files.writer(keys.input_key(job_id)) as out:
        counted = _Counted(out)
        copy_checked(source, counted, settings.max_file_bytes, settings.max_file_lines)
        size = counted.bytes
    created = now()
    try:
        with db.session() as s, s.begin():
            tenant = tenant_id(s, spec.tenant)
            hold_tenant(s, tenant)  # one submit of a tenant at a time (SQLite too: an UPDATE takes its lock)
            _check_in_flight(s, spec.tenant, settings.max_jobs_in_flight)  # again: others may have won the race
            check_room(s, tenant, size, settings, listed=False)  # its copy of its input counts in its quota
            s.add(Job(id=job_id, tenant_id=tenant, model=model, status=JobStatus.VALIDATING, priority=spec.priority,
                      completion_window=spec.completion_window, metadata_=dict(spec.metadata),
                      input_name=input_name[:500], input_key=keys.input_key(job_id), total=0, completed=0, failed=0,
                      prompt_tokens=0, completion_tokens=0, created_at=created,
                      expires_at=created + window_seconds(spec.completion_window), endpoint=spec.endpoint,
                      input_file_id=input_file_id, submit_message_id=message_id, webhook_url=webhook_url,
                      output_expires_after=spec.output_expires_after, input_bytes=size))
    except BaseException as exc:
        try:
            files.store.delete(keys.input_key(job_id))
        except Exception:  # noqa: BLE001 (an orphan input costs space, not correctness; the error to raise is exc)
            pass
        if isinstance(exc, IntegrityError) and message_id is not None:
            existing = submitted_job(db, spec.tenant, message_id)
            if existing is not None:  # the same message, handled at the same moment elsewhere
                raise DuplicateSubmit(existing) from None
        raise
    return job_id


def withdraw_job(db: Database, files: JobFiles, job_id: str) -> None:
    """Undo ``create_job`` when its ingest could not be queued (the broker did not answer): a refused
    submission leaves no job, and no stored input, behind."""
    with db.session() as s, s.begin():
        s.execute(delete(Job).where(Job.id == job_id, Job.status == JobStatus.VALIDATING))
    files.store.delete(keys.input_key(job_id))


def submitted_job(db: Database, tenant: str, message_id: str) -> str | None:
    """The job a tenant's submit message made, if any."""
    with db.session() as s:
        return s.scalar(select(Job.id).join(Tenant).where(Tenant.name == tenant, Job.submit_message_id == message_id))


def create_failed_job(db: Database, tenant: str, error: str, *, model: str = "", input_name: str = "",
                      priority: int = 0, completion_window: str = "24h", metadata: dict | None = None,
                      message_id: str | None = None, webhook_url: str | None = None) -> str:
    """A job that failed before it had an input: a refused submit message, so that its producer
    finds the reason where it finds its jobs (and in the job's ``job.failed`` event). The same
    message twice makes one (``DuplicateSubmit``)."""
    job_id = new_job_id()
    created = now()
    try:
        with db.session() as s, s.begin():
            s.add(Job(id=job_id, tenant_id=tenant_id(s, tenant), model=model[:200], status=JobStatus.FAILED,
                      priority=priority, completion_window=completion_window, metadata_=dict(metadata or {}),
                      input_name=input_name[:500], input_key="", total=0, completed=0, failed=0, prompt_tokens=0,
                      completion_tokens=0, created_at=created, failed_at=created, error=error,
                      expires_at=created + window_seconds(completion_window), submit_message_id=message_id,
                      webhook_url=webhook_url))
    except IntegrityError:
        existing = submitted_job(db, tenant, message_id) if message_id is not None else None
        if existing is None:
            raise
        raise DuplicateSubmit(existing) from None
    return job_id


def _check_in_flight(s: Session, tenant: str, limit: int) -> None:
    count = s.scalar(select(func.count()).select_from(Job).join(Tenant)
                     .where(Tenant.name == tenant, Job.status.in_(IN_FLIGHT)))
    if count >= limit:
        raise JobRefused(f"tenant {tenant!r} has {count} jobs validating or in progress, the limit: wait for some "
                         "to finish (`berth list --tenant`), cancel some, or raise BERTH_MAX_JOBS_IN_FLIGHT")
