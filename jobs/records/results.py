"""Each request's one outcome, as the jobs database keeps it (``jobs.hosting.database_ledger`` writes it for the
workers).

An outcome is a result row and the job's counters, in one transaction. ``results.request_id`` is
unique and the insert skips a conflict, so a second outcome for a request (a redelivered message,
two workers racing, a finalizer closing the job) changes nothing and counts nothing.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from sqlalchemy import case, func, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from jobs.records.db import Database, one_of
from jobs.records.lifecycle import mark_finalizing
from jobs.records.models import Job, JobProgress, RequestRow, Result, ResultStatus, now


@dataclass
class ResultRecord:
    request_id: int
    job_id: str
    status: ResultStatus
    response: dict | None = None  # the output line's "response"
    error: dict | None = None  # {"code", "message"}
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # of prompt_tokens, taken from a prefix cache (the engine's or the fleet's store)

    @classmethod
    def failure(cls, request_id: int, job_id: str, code: str, message: str) -> ResultRecord:
        return cls(request_id, job_id, ResultStatus.FAILED, error={"code": code, "message": message})


@dataclass(frozen=True)
class Recorded:
    new: set[int]  # request ids whose outcome this call wrote
    finalize: list[str]  # jobs that this call finished


def record_outcomes(db: Database, outcomes: list[ResultRecord], worker: str | None = None,
                    tokens: dict[int, int] | None = None) -> Recorded:
    """Write each outcome that is the first for its request, and the counters of their jobs. ``tokens``:
    request id -> its ``requests.tokens``, where the caller read it already (else read here)."""
    if not outcomes:
        return Recorded(set(), [])
    with db.session() as s, s.begin():
        new = insert_results(s, [{
            "request_id": o.request_id, "job_id": o.job_id, "status": o.status, "response": o.response,
            "error": o.error, "prompt_tokens": o.prompt_tokens, "completion_tokens": o.completion_tokens,
            "cached_tokens": o.cached_tokens, "worker": worker, "created_at": now()} for o in outcomes])
        firsts = {}  # the outcome of each request this call wrote: the first of its outcomes here
        for o in outcomes:
            if o.request_id in new:
                firsts.setdefault(o.request_id, o)
        counts: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0, 0])
        for o in firsts.values():
            c = counts[o.job_id]
            c[0 if o.status is ResultStatus.COMPLETED else 1] += 1
            c[2] += o.prompt_tokens
            c[3] += o.completion_tokens
            c[4] += o.cached_tokens
        if tokens is not None and new <= tokens.keys():  # what the requests held, known: no query
            done: dict[str, int] = defaultdict(int)
            for rid, o in firsts.items():
                done[o.job_id] += tokens[rid]
        else:
            done = given_back(s, new)
        jobs = Job.__table__.c  # SQLAlchemy's core: the ORM's bulk machinery costs more than the statements
        connection, complete = s.connection(), []
        for job_id in sorted(counts):  # one order for every writer: no deadlocks between workers
            completed, failed, prompt, completion, cached = counts[job_id]
            if connection.execute(update(Job.__table__).where(jobs.id == job_id).values(
                    completed=jobs.completed + completed, failed=jobs.failed + failed,
                    prompt_tokens=jobs.prompt_tokens + prompt, completion_tokens=jobs.completion_tokens + completion,
                    cached_tokens=jobs.cached_tokens + cached,
                    enqueued_tokens=jobs.enqueued_tokens - done.get(job_id, 0),
                    # the output budget of those done: what they held less their prompts (a progress estimate's)
                    finished_budget=jobs.finished_budget + max(0, done.get(job_id, 0) - prompt))
                    .returning(jobs.completed + jobs.failed >= jobs.total)).scalar():
                complete.append(job_id)  # every request has its outcome now: finalizing, if in progress
            if worker is not None and completion:
                move_out_of_flight(connection, worker, job_id, completion)
        return Recorded(new, mark_finalizing(s, complete))


def move_out_of_flight(connection, worker: str, job_id: str, completion: int) -> None:
    """The tokens of requests just recorded leave the worker's in-flight count for their job (``job_progress``,
    as of its last heartbeat) in the transaction that adds them to the job's: the work done a job's progress
    and ETA count (``jobs.records.status``) is not counted twice until the worker's next heartbeat."""
    progress = JobProgress.__table__.c
    connection.execute(update(JobProgress.__table__)
                       .where(progress.worker_id == worker, progress.job_id == job_id)
                       .values(tokens=case((progress.tokens > completion, progress.tokens - completion), else_=0)))


def given_back(session: Session, request_ids: set[int]) -> dict[str, int]:
    """Job id -> the enqueued tokens its requests ``request_ids`` held (``jobs.records.budgets``), which
    their outcomes give back to their tenant."""
    if not request_ids:
        return {}
    return {job_id: int(tokens or 0) for job_id, tokens in session.execute(
        select(RequestRow.job_id, func.sum(RequestRow.tokens))
        .where(one_of(RequestRow.id, sorted(request_ids), session.get_bind().dialect.name))
        .group_by(RequestRow.job_id))}


def insert_results(session: Session, rows: list[dict]) -> set[int]:
    """Insert result rows, skipping requests that have one; the request ids inserted."""
    dialect = postgresql if session.get_bind().dialect.name == "postgresql" else sqlite
    table = Result.__table__  # the core's insert: many rows in one statement, without the ORM's bulk machinery
    stmt = dialect.insert(table).on_conflict_do_nothing(index_elements=["request_id"]).returning(table.c.request_id)
    return set(session.connection().execute(stmt, rows).scalars())
