"""Turning a submitted file into request rows and queue messages, a chunk of lines at a time: each
chunk committed, then published with confirms. An ingest always finishes (a line that breaks the
validator or the database is that line's error), resumes after the last line stored when run again,
and never stores a line twice or once its job has left ``validating`` (docs/jobs.md).

The first chunk is small and each next one twice the last, up to ``CHUNK_LINES``: a worker already
consuming (``berth run``'s, ``berth serve``'s, a fleet's) starts on the first requests within
milliseconds, not once a whole 2,000-line chunk is checked, while a long file still goes in large chunks.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from sqlalchemy import func, insert, select, update
from sqlalchemy.exc import DataError, DBAPIError, IntegrityError, StatementError
from sqlalchemy.orm import Session

from jobs.lines.batch_format import LineError
from jobs.lines.validate import InputError, LineValidator, RawLine, model_info, read_lines
from jobs.pipeline.finalize import close_unread, fail_unfinished, write_outputs
from jobs.pipeline.publish import Publisher
from jobs.pipeline.request_messages import RequestMessage, params_to_dict
from jobs.records import budgets
from jobs.records.db import Database
from jobs.records.job_files import JobFiles
from jobs.records.lifecycle import mark_finalizing
from jobs.records.models import Job, JobStatus, LineErrorRow, RequestRow, Tenant, now
from jobs.records.stored_lines import last_stored_line, line_custom_id
from storage import ObjectNotFound
from worker.config import Settings

log = logging.getLogger("berth.ingest")

CHUNK_LINES = 2000
FIRST_CHUNK_LINES = 64  # then 128, 256, ... up to CHUNK_LINES
HEARTBEAT_SECONDS = 15.0  # a running ingest's sign of life; the reconciler waits 8 of them (INGEST_SILENCE_SECONDS)
PUBLISH_BATCH = 2000
MAX_MESSAGE = 1000  # characters of an exception's text kept in a line's error


@dataclass(frozen=True)
class JobTarget:
    """What every message of a job carries besides the request itself."""

    job_id: str
    model: str
    priority: int
    tenant: str
    window: float | None = None  # seconds from the job's creation to the end of its completion window

    def message(self, row: RequestRow) -> RequestMessage:
        return RequestMessage.from_row(row, self.model, self.priority, self.tenant, self.window)


def job_target(db: Database, job_id: str) -> JobTarget:
    with db.session() as s:
        job, tenant = s.execute(select(Job, Tenant.name).join(Tenant).where(Job.id == job_id)).one()
        return JobTarget(job.id, job.model, job.priority, tenant, job.expires_at - job.created_at)


def ingest(db: Database, files: JobFiles, settings: Settings, job_id: str,
           stop: Callable[[], bool] | None = None, published: Callable[[], None] | None = None) -> list[str]:
    """Validate, store and publish the job's lines; returns the jobs now ready to finalize. ``stop`` is
    asked before each chunk: once true the ingest returns [] at once, its job left ``validating`` with
    the lines stored and published so far, as a crash between two chunks leaves it (the next ingest of
    the job goes on after them). ``published`` is called each time messages of the job are out."""
    with db.session() as s, s.begin():
        if not hold_validating(s, job_id):
            return []
        input_key = s.scalar(select(Job.input_key).where(Job.id == job_id))
    with heartbeat(db, job_id):
        return _ingest(db, files, settings, job_id, input_key, stop or (lambda: False), published or (lambda: None))


def chunk_sizes() -> Iterator[int]:
    """``FIRST_CHUNK_LINES``, doubling, up to ``CHUNK_LINES`` (both read now: tests set them)."""
    size = max(1, min(FIRST_CHUNK_LINES, CHUNK_LINES))
    while True:
        yield size
        size = min(size * 2, CHUNK_LINES)


def _ingest(db: Database, files: JobFiles, settings: Settings, job_id: str, input_key: str,
            stop: Callable[[], bool], published: Callable[[], None]) -> list[str]:
    target = job_target(db, job_id)
    last_line, seen = _stored(db, job_id)
    validator = LineValidator(model_info(settings), seen=seen, tenant=target.tenant)
    error = None
    with Publisher(settings) as publisher:
        if publish_unpublished(db, publisher, job_id):  # a previous run's last chunk, if it died before publishing
            published()
        try:
            with files.open(input_key) as f:
                lines = (raw for raw in read_lines(f) if raw.number > last_line)
                sizes = chunk_sizes()
                while chunk := list(itertools.islice(lines, next(sizes))):
                    if stop():  # asked between chunks: what is stored is published, the rest waits
                        return []
                    try:
                        rows = _store_chunk(db, target, validator, chunk, settings.tenant_max_enqueued_tokens)
                    except budgets.TokenLimitExceeded as exc:
                        return _refuse(db, files, job_id, str(exc), exc.code)
                    if rows is None:  # the job was cancelled or expired: its finalize closes the rest
                        return []
                    if publish(db, publisher, [target.message(r) for r in rows]):
                        published()
        except InputError as exc:
            error = str(exc)
        except ObjectNotFound:
            error = f"the input file {input_key} is gone from the job store: submit the file again"
    return _close_validation(db, files, job_id, error)


def hold_validating(session: Session, job_id: str) -> bool:
    """Note the ingest's sign of life, if the job is still validating; whether it is. As the first
    statement of a transaction it locks the job row (PostgreSQL) or the database (SQLite) until the
    transaction ends, and what the transaction reads after it is current."""
    return session.execute(update(Job).where(Job.id == job_id, Job.status == JobStatus.VALIDATING)
                           .values(ingest_seen_at=now())).rowcount == 1


@contextmanager
def heartbeat(db: Database, job_id: str, every: float | None = None) -> Iterator[None]:
    """Stamp ``ingest_seen_at`` every ``every`` seconds (``HEARTBEAT_SECONDS``) while the block runs:
    liveness by the clock, not by chunks, so the reconciler never starts a second ingest beside a
    slow one. It ends with the block, and with the process: an ingest that died falls silent."""
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(HEARTBEAT_SECONDS if every is None else every):
            try:
                with db.session() as s, s.begin():
                    if not hold_validating(s, job_id):
                        return  # cancelled, expired or done: nothing to keep alive
            except Exception as exc:  # noqa: BLE001 (the next beat tries again; the ingest sees the outage itself)
                log.warning("job %s: the ingest's heartbeat could not be written: %s", job_id, _describe(exc))

    thread = threading.Thread(target=beat, name=f"berth-ingest-heartbeat-{job_id}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _stored(db: Database, job_id: str) -> tuple[int, set[str]]:
    with db.session() as s:
        last = last_stored_line(s, job_id)
        seen = set(s.scalars(select(RequestRow.custom_id).where(RequestRow.job_id == job_id)))
    return last, seen


def _error_row(job_id: str, line: int, custom_id: str | None, message: str, code: str = "invalid_request",
               param: str | None = None) -> dict:
    return {"job_id": job_id, "line": line, "custom_id": custom_id, "param": param, "code": code,
            "message": message}


def _describe(exc: BaseException) -> str:
    """An exception's type and the first line of its message (a database error's own, not the SQL)."""
    orig = getattr(exc, "orig", None) or exc
    text = str(orig).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:MAX_MESSAGE].replace("\x00", "\\x00")


def _check(validator: LineValidator, job_id: str, chunk: list[RawLine]) -> tuple[list[dict], list[dict]]:
    """The chunk's request rows and line-error rows; one line's failure is that line's error."""
    requests, errors = [], []
    created = now()
    for raw in chunk:
        try:
            custom_id, url, request = validator.check(raw)
            params = params_to_dict(request.params)
            requests.append({"job_id": job_id, "line": raw.number, "custom_id": custom_id, "url": url,
                             "prompt_token_ids": request.prompt_token_ids, "params": params,
                             "cache_salt": request.cache_salt, "attempts": 0, "created_at": created,
                             "tokens": budgets.line_tokens(len(request.prompt_token_ids), params)})
        except LineError as e:
            errors.append(_error_row(job_id, e.line, e.custom_id, e.message, e.code, e.param))
        except InputError:  # the whole file is refused (a request past the line limit)
            raise
        except Exception as exc:
            log.warning("job %s line %d: checking it raised %s", job_id, raw.number, _describe(exc), exc_info=True)
            errors.append(_error_row(job_id, raw.number, line_custom_id(raw),
                                     f"this line could not be checked: {_describe(exc)}"))
    return requests, errors


def _caused_by_rows(exc: Exception) -> bool:
    """A database error that the rows themselves caused (not an outage or a lock)."""
    return isinstance(exc, (DataError, IntegrityError)) or (isinstance(exc, StatementError)
                                                            and not isinstance(exc, DBAPIError))


def _store_chunk(db: Database, target: JobTarget, validator: LineValidator, chunk: list[RawLine],
                 token_limit: int = 0) -> list[RequestRow] | None:
    """Store the chunk's lines not stored yet; the new request rows (None: the job is no longer validating).
    ``budgets.TokenLimitExceeded`` (nothing stored) when they would pass the tenant's enqueued-token limit
    (``token_limit``, the default of a tenant without its own)."""
    requests, errors = _check(validator, target.job_id, chunk)
    lines = [raw.number for raw in chunk]
    try:
        return _insert(db, target.job_id, lines, requests, errors, one_by_one=False, token_limit=token_limit)
    except Exception as exc:
        if not _caused_by_rows(exc):
            raise
        log.warning("job %s lines %d-%d: the database refused the chunk (%s); storing it line by line",
                    target.job_id, lines[0], lines[-1], _describe(exc))
        return _insert(db, target.job_id, lines, requests, errors, one_by_one=True, token_limit=token_limit)


def _insert(db: Database, job_id: str, lines: list[int], requests: list[dict], errors: list[dict],
            one_by_one: bool, token_limit: int = 0) -> list[RequestRow] | None:
    with db.session() as s, s.begin():
        if not hold_validating(s, job_id):
            return None
        last = last_stored_line(s, job_id)  # another ingest of this job may have stored these lines
        requests = [r for r in requests if r["line"] > last]
        errors = [e for e in errors if e["line"] > last]
        new_lines = sum(1 for n in lines if n > last)
        budgets.check_room(s, job_id, sum(r["tokens"] for r in requests), token_limit)
        if one_by_one:
            requests, ids = _insert_each(s, requests, errors)
            errors.sort(key=lambda e: e["line"])
        else:
            ids = list(s.scalars(insert(RequestRow).returning(RequestRow.id, sort_by_parameter_order=True),
                                 requests)) if requests else []
            if errors:
                s.execute(insert(LineErrorRow), errors)
        s.execute(update(Job).where(Job.id == job_id)
                  .values(total=Job.total + new_lines, failed=Job.failed + len(errors),
                          enqueued_tokens=Job.enqueued_tokens + sum(r["tokens"] for r in requests),
                          output_budget=Job.output_budget + sum(r["tokens"] - len(r["prompt_token_ids"])
                                                                for r in requests)))
    return [RequestRow(id=i, **r) for i, r in zip(ids, requests)]


def _insert_each(s: Session, requests: list[dict], errors: list[dict]) -> tuple[list[dict], list[int]]:
    """Insert rows one at a time, each in a savepoint: a request the database refuses becomes a line
    error (``errors`` grows), and an error row it refuses is stored without its custom_id."""
    stored, ids = [], []
    for r in requests:
        try:
            with s.begin_nested():
                ids.append(s.scalar(insert(RequestRow).returning(RequestRow.id), r))
            stored.append(r)
        except Exception as exc:
            if not _caused_by_rows(exc):
                raise
            errors.append(_error_row(r["job_id"], r["line"], r["custom_id"],
                                     f"this line could not be stored: {_describe(exc)}"))
    for e in errors:
        try:
            with s.begin_nested():
                s.execute(insert(LineErrorRow), e)
        except Exception as exc:
            if not _caused_by_rows(exc):
                raise
            s.execute(insert(LineErrorRow), {**e, "custom_id": None, "param": None,
                                             "message": e["message"].encode("ascii", "backslashreplace").decode()})
    return stored, ids


def publish(db: Database, publisher: Publisher, messages: list[RequestMessage]) -> int:
    """Publish committed requests, then mark them published."""
    for start in range(0, len(messages), PUBLISH_BATCH):
        batch = messages[start:start + PUBLISH_BATCH]
        publisher.publish(batch)
        with db.session() as s, s.begin():
            s.execute(update(RequestRow).where(RequestRow.id.in_([m.request_id for m in batch]))
                      .values(published_at=now()))
    return len(messages)


def publish_unpublished(db: Database, publisher: Publisher, job_id: str) -> int:
    with db.session() as s:
        rows = list(s.scalars(select(RequestRow).where(RequestRow.job_id == job_id, RequestRow.published_at.is_(None))))
    if not rows:
        return 0
    target = job_target(db, job_id)
    return publish(db, publisher, [target.message(r) for r in rows])


def _refuse(db: Database, files: JobFiles, job_id: str, error: str, code: str) -> list[str]:
    """The job fails, as OpenAI fails a batch past a limit, with ``code``: its lines stored so far fail with
    it (those already queued are skipped by the workers, as a cancelled job's are), and the lines not read
    become line errors with it, so every input line is in the errors file; it holds no tokens."""
    with db.session() as s, s.begin():
        if not hold_validating(s, job_id):
            return []
        job = s.get(Job, job_id)
        closed = fail_unfinished(s, job_id, code, error)
        unread = close_unread(s, files, job, code, error)
        s.execute(update(Job).where(Job.id == job_id).values(
            total=Job.total + unread, failed=Job.failed + closed + unread, enqueued_tokens=0))
    outputs = write_outputs(db, files, job_id)
    with db.session() as s, s.begin():
        if hold_validating(s, job_id):
            s.execute(update(Job).where(Job.id == job_id).values({
                Job.status: JobStatus.FAILED, Job.failed_at: now(), Job.error: error, Job.error_code: code,
                **outputs.columns(), Job.enqueued_tokens: 0}))
    return []


def _close_validation(db: Database, files: JobFiles, job_id: str, error: str | None) -> list[str]:
    """Every line is stored: the job goes in progress, or fails when it has no valid line. Under the
    job's lock, so that a cancel or another ingest in between changes nothing twice."""
    with db.session() as s, s.begin():
        if not hold_validating(s, job_id):
            return []
        total, failed = s.execute(select(Job.total, Job.failed).where(Job.id == job_id)).one()
        if error is None and total == 0:
            error = "the input file has no request lines: give one JSON request per line (OpenAI Batch format)"
        elif error is None and failed == total:
            error = f"none of the {total} lines is a valid request: the errors file says what is wrong with each"
        if error is None:  # its work began with its first chunk's messages: workers run them while it ingests
            first = s.scalar(select(func.min(RequestRow.published_at)).where(RequestRow.job_id == job_id))
            s.execute(update(Job).where(Job.id == job_id)
                      .values(status=JobStatus.IN_PROGRESS, in_progress_at=first or now()))
            return mark_finalizing(s, [job_id])
        outputs = write_outputs(db, files, job_id)  # the rows are committed; this transaction wrote none
        s.execute(update(Job).where(Job.id == job_id).values(
            status=JobStatus.FAILED, failed_at=now(), error=error, errors_key=outputs.errors_key,
            errors_bytes=outputs.errors_bytes, enqueued_tokens=0))
    return []
