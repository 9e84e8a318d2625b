"""A tenant's storage quota: the bytes and the number of its files (``tenant_max_storage_bytes``,
``tenant_max_files``), counted over what ``GET /v1/files`` lists it, uploads and batch outputs alike,
so that a tenant frees room the way it sees it used: by deleting files (or letting them expire).

An upload past either limit is refused with a 413 (``QuotaExceeded``), not a 429: waiting does not
make room, and the openai client retries a 429 by itself. The check that lets an upload in runs
in the transaction that adds its row, with the tenant's row held (``hold_tenant``), so that two
uploads at once cannot both take the last room. A batch's own copy of its input file is not
counted: it is the batch's, not a file the tenant can list or delete.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from jobs.records.models import FileRow, Tenant
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
    used, count = s.execute(select(func.coalesce(func.sum(FileRow.bytes), 0), func.count(FileRow.id))
                            .where(FileRow.tenant_id == tenant_id)).one()
    return Usage(int(used), int(count))


def hold_tenant(s: Session, tenant_id: int) -> None:
    """Hold the tenant's row until this transaction ends: a row lock on PostgreSQL, the write lock on
    SQLite (where ``SELECT ... FOR UPDATE`` locks nothing, but an UPDATE does)."""
    s.execute(update(Tenant).where(Tenant.id == tenant_id).values(id=Tenant.id))


def check_room(s: Session, tenant_id: int, adding: int, settings: Settings) -> None:
    """``QuotaExceeded`` unless one more file of ``adding`` bytes fits the tenant's quota."""
    used = usage(s, tenant_id)
    max_files, max_bytes = settings.tenant_max_files, settings.tenant_max_storage_bytes
    if max_files and used.files + 1 > max_files:
        raise QuotaExceeded(f"you have {used.files:,} files, the most a tenant may keep here: delete files you no "
                            "longer need (DELETE /v1/files/{id}), or ask the operator to raise BERTH_TENANT_MAX_FILES",
                            "too_many_files")
    if max_bytes and used.bytes + adding > max_bytes:
        raise QuotaExceeded(f"this file of {adding:,} bytes does not fit your storage quota: your files hold "
                            f"{used.bytes:,} of {max_bytes:,} bytes; delete files you no longer need (DELETE "
                            "/v1/files/{id}), or ask the operator to raise BERTH_TENANT_MAX_STORAGE_BYTES",
                            "storage_quota_exceeded")
