"""A tenant's storage quota on the HTTP API: ``jobs.records.storage_quota``, which every door that stores
files (uploads here; a batch's, a CLI job's, a retry's and a queue submit's copy of its input) checks."""

from jobs.records.storage_quota import QuotaExceeded, Usage, check_room, hold_tenant, usage

__all__ = ["QuotaExceeded", "Usage", "check_room", "hold_tenant", "usage"]
