"""A job's states, as the OpenAI Batch object names them (``jobs.records.lifecycle`` draws their diagram).

Apart from ``jobs.records.models`` so that the command line can list them without importing SQLAlchemy,
which ``berth generate`` never needs.
"""

from __future__ import annotations

import enum


class JobStatus(str, enum.Enum):
    VALIDATING = "validating"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"
    EXPIRED = "expired"

    @property
    def is_final(self) -> bool:
        return self in (JobStatus.COMPLETED, JobStatus.FAILED, JobStatus.CANCELLED, JobStatus.EXPIRED)
