"""Accepting a job: its input file copied into the job store and a ``validating`` job row, in
well under a second whatever the file's size; the lines are checked and queued by the ingest task."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from pathlib import Path

from jobs import files as keys
from jobs.db import Database
from jobs.files import JobFiles
from jobs.lifecycle import window_seconds
from jobs.models import Job, JobStatus, now
from worker.queues import MAX_PRIORITY
from jobs.tenants import tenant_id

_TENANT_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-@")


@dataclass(frozen=True)
class JobSpec:
    """What a user chooses about a job besides its requests."""

    tenant: str = "default"
    priority: int = 0  # 0-9, higher runs first
    completion_window: str = "24h"
    metadata: dict = field(default_factory=dict)

    def check(self) -> None:
        if not self.tenant or len(self.tenant) > 64 or not set(self.tenant) <= _TENANT_CHARS:
            raise ValueError(f"tenant {self.tenant!r}: use 1-64 letters, digits or _ . - @")
        if not 0 <= self.priority <= MAX_PRIORITY:
            raise ValueError(f"priority {self.priority}: give an integer from 0 to {MAX_PRIORITY} (higher runs first)")
        window_seconds(self.completion_window)
        if not isinstance(self.metadata, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                          for k, v in self.metadata.items()):
            raise ValueError("metadata must map strings to strings")


def new_job_id() -> str:
    return f"batch_{uuid.uuid4().hex[:24]}"


def create_job(db: Database, files: JobFiles, path: str | Path, model: str, spec: JobSpec) -> str:
    """Store the input and create the job in ``validating``; returns its id."""
    spec.check()
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} is not a file: give the path of a JSONL request file")
    job_id = new_job_id()
    files.put_file(keys.input_key(job_id), path)
    created = now()
    with db.session() as s, s.begin():
        tenant = tenant_id(s, spec.tenant)
        s.add(Job(id=job_id, tenant_id=tenant, model=model, status=JobStatus.VALIDATING, priority=spec.priority,
                  completion_window=spec.completion_window, metadata_=dict(spec.metadata), input_name=path.name[:500],
                  input_key=keys.input_key(job_id), total=0, completed=0, failed=0, prompt_tokens=0,
                  completion_tokens=0, created_at=created,
                  expires_at=created + window_seconds(spec.completion_window)))
    return job_id

