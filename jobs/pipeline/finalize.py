"""Closing a job: the output file (one line per request, in input order) and the errors file
(bad input lines and failed requests, in input order), then its final state.

A job is finalized from ``finalizing`` (to ``completed``, or ``expired`` when its window passed)
or ``cancelling`` (to ``cancelled``); requests still without an outcome then fail with
``batch_expired`` or ``batch_cancelled``. A job cancelled or expired while its ingest was still
reading the file has lines that never became a request or a line error: each becomes a line error
with the same code (its line number, and its custom_id when the line parses), so every line of the
input is in exactly one of the two files and the counts add up. Running it twice writes the same
files and moves the job once.
"""

from __future__ import annotations

import heapq
import itertools
import json
import logging
from collections.abc import Iterator
from typing import NamedTuple

from sqlalchemy import insert, literal, select, update
from sqlalchemy.types import JSON

from jobs.lines.batch_format import LineError
from jobs.lines.validate import InputError, read_lines
from jobs.records import job_files as keys
from jobs.records.db import Database
from jobs.records.job_files import JobFiles
from jobs.records.models import (
    Job,
    JobStatus,
    LineErrorRow,
    RequestRow,
    Result,
    ResultStatus,
    now,
)
from jobs.records.stored_lines import last_stored_line, line_custom_id
from storage import ObjectNotFound

log = logging.getLogger("berth.finalize")

_CLOSE_CODES = {JobStatus.CANCELLED: ("batch_cancelled", "the job was cancelled before this request ran"),
                JobStatus.EXPIRED: ("batch_expired", "the job's completion window passed before this request ran")}
_UNREAD = {JobStatus.CANCELLED: "the job was cancelled before this line was checked",
           JobStatus.EXPIRED: "the job's completion window passed before this line was checked"}
INSERT_CHUNK = 2000


def finalize(db: Database, files: JobFiles, job_id: str) -> JobStatus | None:
    """Finish a finalizing or cancelling job; returns its final state (None: not ready to finalize)."""
    with db.session() as s, s.begin():
        job = s.get(Job, job_id, with_for_update=True)
        if job is None or job.status not in (JobStatus.FINALIZING, JobStatus.CANCELLING):
            return None
        leaving = job.status
        if leaving is JobStatus.CANCELLING:
            target = JobStatus.CANCELLED
        else:
            target = JobStatus.EXPIRED if job.expired_at is not None else JobStatus.COMPLETED
        if target in _CLOSE_CODES:
            code = _CLOSE_CODES[target][0]
            closed = fail_unfinished(s, job_id, *_CLOSE_CODES[target])  # first a write: SQLite's lock is held
            unread = close_unread(s, files, job, code, _UNREAD[target]) if job.in_progress_at is None else 0
            s.execute(update(Job).where(Job.id == job_id)
                      .values(total=Job.total + unread, failed=Job.failed + closed + unread))
    outputs = write_outputs(db, files, job_id)
    with db.session() as s, s.begin():
        stamp = getattr(Job, f"{target.value}_at")
        s.execute(update(Job).where(Job.id == job_id, Job.status == leaving).values(
            {Job.status: target, **outputs.columns(), Job.enqueued_tokens: 0,
             stamp: stamp if target is JobStatus.EXPIRED else now()}))
    return target


def fail_unfinished(session, job_id: str, code: str, message: str) -> int:
    """Give every request of the job still without an outcome a failed one; how many there were."""
    unfinished = (select(RequestRow.id, RequestRow.job_id, literal(ResultStatus.FAILED.value),
                         literal({"code": code, "message": message}, JSON), literal(0), literal(0), literal(now()))
                  .outerjoin(Result, Result.request_id == RequestRow.id)
                  .where(RequestRow.job_id == job_id, Result.id.is_(None)))
    columns = ["request_id", "job_id", "status", "error", "prompt_tokens", "completion_tokens", "created_at"]
    return len(session.scalars(insert(Result).from_select(columns, unfinished).returning(Result.request_id)).all())


def close_unread(session, files: JobFiles, job: Job, code: str, message: str) -> int:
    """The lines of a job stopped during its ingest that were never stored become line errors with
    ``code``; how many. The ingest stores lines in order and stores nothing once the job left
    ``validating``, so they are the lines after the last one stored."""
    last = last_stored_line(session, job.id)
    n = 0
    try:
        with files.open(job.input_key) as f:
            unread = (raw for raw in read_lines(f) if raw.number > last)
            while batch := list(itertools.islice(unread, INSERT_CHUNK)):
                session.execute(insert(LineErrorRow), [
                    {"job_id": job.id, "line": raw.number, "custom_id": line_custom_id(raw), "param": None,
                     "code": code, "message": message} for raw in batch])
                n += len(batch)
    except InputError:  # not a UTF-8 file at all: it has no lines to report
        pass
    except ObjectNotFound:
        log.warning("job %s: its input %s is gone from the job store; its unread lines cannot be reported",
                    job.id, job.input_key)
    return n


class Outputs(NamedTuple):
    """A job's output and errors files as written: their keys (None for a file with no line) and sizes."""

    output_key: str | None
    errors_key: str | None
    output_bytes: int
    errors_bytes: int

    def columns(self) -> dict:
        """The job's columns that say where they are and what they hold (its tenant's storage quota)."""
        return {Job.output_key: self.output_key, Job.errors_key: self.errors_key,
                Job.output_bytes: self.output_bytes, Job.errors_bytes: self.errors_bytes}


def write_outputs(db: Database, files: JobFiles, job_id: str) -> Outputs:
    """Write the job's output and errors files."""
    output, output_bytes = _write(files, keys.output_key(job_id), _output_lines(db, job_id))
    errors, errors_bytes = _write(files, keys.errors_key(job_id),
                                  (line for _, line in heapq.merge(_line_errors(db, job_id), _failed_lines(db, job_id),
                                                                   key=lambda item: item[0])))
    return Outputs(output, errors, output_bytes, errors_bytes)


def _write(files: JobFiles, key: str, lines: Iterator[dict]) -> tuple[str | None, int]:
    n = size = 0
    with files.writer(key) as f:
        for line in lines:
            data = json.dumps(line, ensure_ascii=False).encode() + b"\n"
            f.write(data)
            n, size = n + 1, size + len(data)
    return (key, size) if n else (None, 0)


def _results(db: Database, job_id: str, status: ResultStatus):
    with db.session() as s:
        yield from s.execute(
            select(RequestRow.line, RequestRow.id, RequestRow.custom_id, Result.response, Result.error)
            .join(Result, Result.request_id == RequestRow.id)
            .where(RequestRow.job_id == job_id, Result.status == status)
            .order_by(RequestRow.line).execution_options(yield_per=2000))


def _output_lines(db: Database, job_id: str) -> Iterator[dict]:
    for _, request_id, custom_id, response, _ in _results(db, job_id, ResultStatus.COMPLETED):
        yield {"id": f"batch_req_{request_id}", "custom_id": custom_id, "response": response, "error": None}


def _failed_lines(db: Database, job_id: str) -> Iterator[tuple[int, dict]]:
    for line, request_id, custom_id, _, error in _results(db, job_id, ResultStatus.FAILED):
        yield line, {"id": f"batch_req_{request_id}", "custom_id": custom_id, "response": None, "error": error}


def _line_errors(db: Database, job_id: str) -> Iterator[tuple[int, dict]]:
    with db.session() as s:
        for e in s.scalars(select(LineErrorRow).where(LineErrorRow.job_id == job_id)
                           .order_by(LineErrorRow.line).execution_options(yield_per=2000)):
            yield e.line, LineError(e.line, e.param, e.message, e.custom_id, e.code).to_error_line()


def finished_lines(db: Database, job_id: str) -> Iterator[dict]:
    """Every line with an outcome so far, in input order, as the output and errors files will hold
    it: a completed request's output line, a failed request's or a bad line's error line."""
    completed = ((line, {"id": f"batch_req_{request_id}", "custom_id": custom_id, "response": response,
                         "error": None})
                 for line, request_id, custom_id, response, _ in _results(db, job_id, ResultStatus.COMPLETED))
    merged = heapq.merge(completed, _failed_lines(db, job_id), _line_errors(db, job_id), key=lambda item: item[0])
    return (line for _, line in merged)
