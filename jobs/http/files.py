"""Files as the HTTP API shows them (OpenAI's File object): uploads, and each job's own files. An
upload is stored under an id made here; a batch copies its input, so deleting the upload changes
nothing for the batch. Only a file that is not JSONL at all is refused whole (docs/http-api.md).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, replace
from typing import BinaryIO

from sqlalchemy import insert, select, update

from jobs.http.pagination import page_after
from jobs.http.quota import check_room, hold_tenant
from jobs.lines.validate import InputError, copy_checked, read_lines
from jobs.records.db import Database
from jobs.records.file_removal import remove_file
from jobs.records.job_files import input_key
from jobs.records.models import FileRow, Job, Tenant, now
from jobs.records.status import JobView
from jobs.records.tenants import tenant_id
from storage import ObjectNotFound
from storage.base import ObjectStore
from worker.config import Settings

UPLOAD_PURPOSE, OUTPUT_PURPOSE = "batch", "batch_output"
MIN_EXPIRY, MAX_EXPIRY = 3600, 30 * 86400  # OpenAI's bounds of expires_after and output_expires_after (seconds)


class FileNotFound(LookupError):
    def __init__(self, file_id: str):
        super().__init__(f"no file {file_id!r}: GET /v1/files lists your files")
        self.file_id = file_id


@dataclass(frozen=True)
class FileView:
    id: str
    tenant: str
    purpose: str
    filename: str
    bytes: int
    created_at: float
    key: str
    job_id: str | None
    expires_at: float | None = None

    @classmethod
    def of(cls, row: FileRow, tenant: str) -> FileView:
        return cls(row.id, tenant, row.purpose, row.filename, row.bytes, row.created_at, row.key, row.job_id,
                   row.expires_at)

    def to_openai(self) -> dict:
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": int(self.created_at),
                "filename": self.filename, "purpose": self.purpose, "status": "processed",
                "expires_at": None if self.expires_at is None else int(self.expires_at), "status_details": None}


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex[:24]}"


def upload_key(file_id: str) -> str:
    return f"files/{file_id}"


def clean_filename(name: str | None) -> str:
    """A name any database stores: no NUL, no lone surrogate, at most 500 characters."""
    name = (name or "upload.jsonl").replace("\x00", "")
    return name.encode("utf-8", "replace").decode("utf-8")[:500] or "upload.jsonl"


def check_jsonl(f: BinaryIO) -> None:
    """Refuse a file that is not JSONL at all (``InputError``); rewinds it."""
    first = next(iter(read_lines(f)), None)  # raises for UTF-16 and UTF-32
    f.seek(0)
    if first is None:
        raise InputError("the file has no lines: give one JSON request per line (OpenAI Batch format, JSONL)")
    if first.data is None:
        return  # a first line over the line limit: that line's error when the batch runs
    try:
        obj = json.loads(first.data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise InputError(f"line {first.number} is not JSON: the file must be JSONL, one JSON request object "
                         "per line (OpenAI Batch format)") from None
    if not isinstance(obj, dict):
        raise InputError(f"line {first.number} is a JSON {type(obj).__name__}, not an object: each line must be "
                         "a request object (OpenAI Batch format)")


def expiry_of_form(fields: dict[str, str]) -> int | None:
    """The seconds of an upload's ``expires_after`` (form fields ``expires_after[anchor]`` and
    ``expires_after[seconds]``, as the openai client sends them); None when not given; ``ValueError``."""
    anchor, seconds = fields.get("expires_after[anchor]"), fields.get("expires_after[seconds]")
    if anchor is None and seconds is None:
        return None
    if anchor != "created_at":
        raise ValueError(f"expires_after[anchor] must be 'created_at', not {(anchor or '')[:40]!r}")
    if seconds is None or not seconds.strip().isdigit() or not MIN_EXPIRY <= int(seconds) <= MAX_EXPIRY:
        raise ValueError(f"expires_after[seconds] must be a whole number of seconds from {MIN_EXPIRY} (an hour) to "
                         f"{MAX_EXPIRY} (30 days), not {(seconds or '')[:40]!r}")
    return int(seconds)


def check_quota(db: Database, tenant: str, size: int, settings: Settings) -> None:
    """``QuotaExceeded`` unless a file of ``size`` bytes fits the tenant's quota now."""
    with db.session() as s, s.begin():
        check_room(s, tenant_id(s, tenant), size, settings)


def save_upload(db: Database, store: ObjectStore, tenant: str, src: BinaryIO, filename: str,
                settings: Settings, expires_after: int | None = None) -> FileView:
    """Store an upload (a seekable file with a ``peek``, at its start) as the tenant's file, deleted
    ``expires_after`` seconds from now (None: when the tenant deletes it); ``QuotaExceeded`` when it
    does not fit the tenant's quota."""
    check_jsonl(src)
    size = src.seek(0, 2)
    src.seek(0)
    check_quota(db, tenant, size, settings)  # at once, before the copy; again below, with the tenant held
    file_id = new_file_id()
    key = upload_key(file_id)
    with store.writer(key) as out:
        copy_checked(src, out, settings.max_file_bytes, settings.max_file_lines)
    size = src.tell()
    created = now()
    try:
        with db.session() as s, s.begin():
            owner = tenant_id(s, tenant)
            hold_tenant(s, owner)
            check_room(s, owner, size, settings)
            row = FileRow(id=file_id, tenant_id=owner, purpose=UPLOAD_PURPOSE, filename=clean_filename(filename),
                          bytes=size, key=key, job_id=None, created_at=created,
                          expires_at=None if expires_after is None else created + expires_after)
            s.add(row)
    except BaseException:
        store.delete(key)
        raise
    return FileView.of(row, tenant)


def get_file(db: Database, tenant: str, file_id: str) -> FileView:
    """The tenant's file; another tenant's is as missing as one that never was."""
    with db.session() as s:
        row = s.scalar(select(FileRow).join(Tenant, Tenant.id == FileRow.tenant_id)
                       .where(FileRow.id == file_id, Tenant.name == tenant))
    if row is None:
        raise FileNotFound(file_id)
    return FileView.of(row, tenant)


def list_files(db: Database, tenant: str, after: str | None, limit: int, descending: bool = True,
               purpose: str | None = None) -> list[FileView]:
    """Up to ``limit + 1`` of the tenant's files after the file ``after``."""
    cursor = None
    if after is not None:
        found = get_file(db, tenant, after)
        cursor = (found.created_at, found.id)
    query = select(FileRow).join(Tenant, Tenant.id == FileRow.tenant_id).where(Tenant.name == tenant)
    if purpose is not None:
        query = query.where(FileRow.purpose == purpose)
    with db.session() as s:
        rows = s.scalars(page_after(query, FileRow.created_at, FileRow.id, cursor, limit, descending)).all()
    return [FileView.of(r, tenant) for r in rows]


def delete_file(db: Database, store: ObjectStore, tenant: str, file_id: str) -> None:
    found = get_file(db, tenant, file_id)
    remove_file(db, store, found.id, found.key, found.job_id)  # a job keeps its own input


def open_content(store: ObjectStore, view: FileView) -> BinaryIO:
    try:
        return store.open(view.key)
    except ObjectNotFound:
        raise FileNotFound(view.id) from None


def _size(store: ObjectStore, key: str) -> int:
    return next((info.size for info in store.list(key) if info.key == key), 0)


class _Lost(Exception):
    """Another reader gave the job's file its id first."""


def attach_job_files(db: Database, store: ObjectStore, view: JobView) -> JobView:
    """The job with an id for its input file, and for its output and errors files once it is over:
    made the first time they are asked for. Two readers at once make one id each; one id is kept."""
    wanted = [("input_file_id", input_key(view.id), UPLOAD_PURPOSE, view.input_name, None)]
    if view.status.is_final:
        expires = None  # output_expires_after counts from when the outputs were written: the batch's end
        if view.output_expires_after is not None:
            expires = (view.ended_at or now()) + view.output_expires_after
        wanted += [("output_file_id", view.output_key, OUTPUT_PURPOSE, f"{view.id}_output.jsonl", expires),
                   ("error_file_id", view.errors_key, OUTPUT_PURPOSE, f"{view.id}_error.jsonl", expires)]
    made = {}
    for column, key, purpose, name, expires_at in wanted:
        if getattr(view, column) is not None or key is None:
            continue
        file_id, col = new_file_id(), getattr(Job, column)
        try:
            with db.session() as s, s.begin():
                s.execute(insert(FileRow).values(
                    id=file_id, tenant_id=select(Job.tenant_id).where(Job.id == view.id).scalar_subquery(),
                    purpose=purpose, filename=clean_filename(name), bytes=_size(store, key), key=key,
                    job_id=view.id, created_at=now(), expires_at=expires_at))
                if not s.execute(update(Job).where(Job.id == view.id, col.is_(None)).values({col: file_id})).rowcount:
                    raise _Lost
            made[column] = file_id
        except _Lost:
            with db.session() as s:
                made[column] = s.scalar(select(col).where(Job.id == view.id))
    return replace(view, **made) if made else view
