"""What of a job's input the database holds: the last line stored, and a line's ``custom_id`` as a
line error can store it. The ingest stores lines in order and resumes after the last one; the
finalize of a job stopped during its ingest makes the lines never stored into line errors."""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from jobs.lines.batch_format import parse_line
from jobs.lines.validate import MAX_CUSTOM_ID, RawLine
from jobs.records.models import LineErrorRow, RequestRow


def last_stored_line(session: Session, job_id: str) -> int:
    return max(session.scalar(select(func.max(RequestRow.line)).where(RequestRow.job_id == job_id)) or 0,
               session.scalar(select(func.max(LineErrorRow.line)).where(LineErrorRow.job_id == job_id)) or 0)


def line_custom_id(raw: RawLine) -> str | None:
    """The line's ``custom_id`` if the line parses that far and any database can store it (for its
    error line), else None."""
    if raw.data is None:
        return None
    try:
        custom_id = parse_line(raw.data, raw.number).custom_id
        custom_id.encode("utf-8")  # a lone surrogate ("\ud800" in the JSON) is not text a database stores
    except Exception:  # noqa: BLE001 (any line that does not parse simply has none)
        return None
    return custom_id if len(custom_id) <= MAX_CUSTOM_ID and "\x00" not in custom_id else None
