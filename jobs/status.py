"""A job as a user sees it: state, request counts, tokens, throughput and time left."""

from __future__ import annotations

import time
from dataclasses import dataclass

from sqlalchemy import select

from jobs.db import Database
from jobs.lifecycle import JobNotFound
from jobs.models import Job, JobStatus, Tenant


@dataclass(frozen=True)
class JobView:
    id: str
    status: JobStatus
    tenant: str
    model: str
    priority: int
    completion_window: str
    metadata: dict
    input_name: str
    total: int
    completed: int
    failed: int
    prompt_tokens: int
    completion_tokens: int
    created_at: float
    in_progress_at: float | None
    finalizing_at: float | None
    completed_at: float | None
    failed_at: float | None
    cancelling_at: float | None
    cancelled_at: float | None
    expired_at: float | None
    expires_at: float
    output_key: str | None
    errors_key: str | None
    error: str | None
    # what the HTTP API shows (None for a job submitted by the CLI, until the API first shows it)
    endpoint: str | None = None
    input_file_id: str | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    message_id: str | None = None  # the AMQP message_id of a job submitted through the queue
    output_expires_after: int | None = None  # seconds its output and errors files are kept once written
    cached_tokens: int = 0  # of prompt_tokens, taken from a prefix cache (OpenAI's usage.input_tokens_details)

    @classmethod
    def of(cls, job: Job, tenant: str) -> JobView:
        return cls(job.id, job.status, tenant, job.model, job.priority, job.completion_window, dict(job.metadata_),
                   job.input_name, job.total, job.completed, job.failed, job.prompt_tokens, job.completion_tokens,
                   job.created_at, job.in_progress_at, job.finalizing_at, job.completed_at, job.failed_at,
                   job.cancelling_at, job.cancelled_at, job.expired_at, job.expires_at, job.output_key,
                   job.errors_key, job.error, job.endpoint, job.input_file_id, job.output_file_id, job.error_file_id,
                   job.submit_message_id, job.output_expires_after, job.cached_tokens)

    @property
    def done(self) -> int:
        return self.completed + self.failed

    @property
    def progress(self) -> float:
        """The fraction of requests done (0 while there are none); the SQL view ``berth_jobs`` says the same."""
        return self.done / self.total if self.total else 0.0

    @property
    def ended_at(self) -> float | None:
        return self.completed_at or self.failed_at or self.cancelled_at or self.expired_at

    @property
    def seconds_running(self) -> float:
        if self.in_progress_at is None:
            return 0.0
        return max((self.finalizing_at or self.ended_at or time.time()) - self.in_progress_at, 0.0)

    @property
    def output_tokens_per_second(self) -> float:
        s = self.seconds_running
        return self.completion_tokens / s if s else 0.0

    @property
    def requests_per_second(self) -> float:
        s = self.seconds_running
        return self.done / s if s else 0.0

    @property
    def eta_seconds(self) -> float | None:
        """Time left at the rate so far; None before there is a rate or once the job is over."""
        rate = self.requests_per_second
        if self.status.is_final or not rate:
            return None
        return (self.total - self.done) / rate

    def to_dict(self) -> dict:
        """Shaped like OpenAI's Batch object, with berth's tenant, priority and throughput."""
        stamp = lambda t: None if t is None else int(t)  # noqa: E731
        return {
            "id": self.id, "object": "batch", "model": self.model, "status": self.status.value,
            "tenant": self.tenant, "priority": self.priority, "completion_window": self.completion_window,
            "metadata": self.metadata, "input_file": self.input_name,
            "output_file": self.output_key, "error_file": self.errors_key,
            "errors": None if self.error is None else {"data": [{"code": "job_failed", "message": self.error}]},
            "request_counts": {"total": self.total, "completed": self.completed, "failed": self.failed},
            "progress": round(self.progress, 6), "message_id": self.message_id,
            "usage": {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                      "cached_tokens": self.cached_tokens},
            "output_tokens_per_second": round(self.output_tokens_per_second, 2),
            "eta_seconds": None if self.eta_seconds is None else round(self.eta_seconds, 1),
            **{f"{name}_at": stamp(getattr(self, f"{name}_at")) for name in (
                "created", "in_progress", "finalizing", "completed", "failed", "cancelling", "cancelled", "expired",
                "expires")},
        }


def get_job(db: Database, job_id: str) -> JobView:
    with db.session() as s:
        row = s.execute(select(Job, Tenant.name).join(Tenant).where(Job.id == job_id)).one_or_none()
    if row is None:
        raise JobNotFound(job_id)
    return JobView.of(*row)


def list_jobs(db: Database, tenant: str | None = None, status: JobStatus | None = None,
              limit: int = 20) -> list[JobView]:
    """The newest jobs first."""
    query = select(Job, Tenant.name).join(Tenant).order_by(Job.created_at.desc()).limit(limit)
    if tenant is not None:
        query = query.where(Tenant.name == tenant)
    if status is not None:
        query = query.where(Job.status == status)
    with db.session() as s:
        return [JobView.of(job, name) for job, name in s.execute(query)]
