"""A job asked for that does not exist, or is in a state that does not allow what was asked.

Apart from ``jobs.records.lifecycle`` (which raises them and re-exports them) so that the commands that only
read a job (``berth status``, ``list``, ``results``) can raise and name them without importing
SQLAlchemy's ORM and the models, which they do not use.
"""

from __future__ import annotations


class JobNotFound(LookupError):
    def __init__(self, job_id: str):
        super().__init__(f"no job {job_id!r}: `berth list` shows the jobs there are")


class JobStateError(RuntimeError):
    """The job is not in a state that allows what was asked."""


class TenantNotFound(LookupError):
    def __init__(self, name: str):
        super().__init__(f"no tenant {name!r}: a tenant is created by its first job (`berth submit --tenant`)")
